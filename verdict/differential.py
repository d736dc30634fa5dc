"""Differential numeric check: run the single-device and the parallel plan on
the same seeded inputs in float64 and compare every parallel tensor with
the piece of the single-device tensor its lineage view names.

This is a test of plans, not a proof: it checks one input. The symbolic
verifier proves the same claims for all inputs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from verdict.final import check_layout, final_version, loss_groups, optimizer_states, rank_states
from verdict.lineage import StructureError, exact_covers
from verdict.numeric import ExecutionError, execute
from verdict.plan import Plan, Tensor

#: Plans whose tensors add up to more than this are refused by --numeric.
MAX_NUMERIC_BYTES = 2 * 1024**3


class NumericRefused(ValueError):
    """A plan too large to run numerically."""


@dataclass
class Difference:
    logical: str
    tensors: list[Tensor]
    expected: np.ndarray
    got: np.ndarray
    what: str

    def describe(self) -> str:
        where = ", ".join(f"rank {t.rank} mb {t.mb} v{t.version}" for t in self.tensors)
        err = _error(self.expected, self.got) if self.expected.shape == self.got.shape else np.inf
        return f"{self.what} of {self.logical} ({where}) differs by {err:.3g}"


@dataclass
class NumericReport:
    checked: int = 0
    groups: int = 0
    differences: list[Difference] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)
    broken: str = ""

    @property
    def equal(self) -> bool:
        return not self.differences and not self.uncovered and not self.broken


def plan_bytes(plan: Plan) -> int:
    return 8 * sum(int(np.prod(t.shape)) for t in plan.tensors)


def check_size(plan: Plan, name: str, limit: int = MAX_NUMERIC_BYTES) -> None:
    size = plan_bytes(plan)
    if size > limit:
        raise NumericRefused(
            f"{name}: {size / 2**30:.1f} GiB of tensors is too large to run numerically "
            f"(limit {limit / 2**30:.1f} GiB); use the symbolic verifier"
        )


def _error(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference; equal infinities (masked scores) count as 0."""
    with np.errstate(invalid="ignore"):
        diff = np.where(a == b, 0.0, np.abs(a - b))
    return float(np.max(np.nan_to_num(diff, nan=np.inf), initial=0.0))


def _close(a: np.ndarray, b: np.ndarray, rtol: float) -> bool:
    finite = np.abs(b[np.isfinite(b)])
    scale = max(float(np.max(finite, initial=0.0)), 1e-12)
    return a.shape == b.shape and _error(a, b) <= rtol * scale


def compare(single: Plan, parallel: Plan, seed: int = 0, rtol: float = 1e-9) -> NumericReport:
    """Compare every tensor of ``parallel`` with its lineage in ``single``,
    and what every rank ends with against the single-device step."""
    ref_values = execute(single, seed)
    report = NumericReport()
    try:
        raw = execute(parallel, seed)
    except ExecutionError as e:
        report.broken = str(e)
        return report
    ref = {(t.tid, t.version): ref_values[i] for i, t in enumerate(single.tensors)}
    order = {o: k for k, node in enumerate(parallel.nodes) for o in node.outputs if o >= 0}
    partial: dict[tuple, list[int]] = defaultdict(list)
    values = [v if v is None or parallel.tensors[i].scale == (1, 1)
              else v / float(parallel.tensors[i].factor()) for i, v in enumerate(raw)]
    for i in sorted(range(len(parallel.tensors)), key=lambda i: order.get(i, -1)):
        t = parallel.tensors[i]
        if values[i] is None:
            continue
        piece = ref[(t.tid, t.lver)][_region(t.slices)]
        if t.is_whole():
            report.checked += 1
            if not _close(values[i], piece, rtol):
                name = parallel.logical[t.tid].name
                report.differences.append(Difference(name, [t], piece, values[i], "tensor"))
        else:
            partial[(t.tid, t.lver, t.slices, t.parts[2])].append(i)
    for (tid, lver, slices, n), members in partial.items():
        name = parallel.logical[tid].name
        by_range: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i in members:
            by_range[parallel.tensors[i].parts[:2]].append(i)
        for same in by_range.values():
            for i in same[1:]:
                if not _close(values[i], values[same[0]], rtol):
                    report.differences.append(Difference(
                        name, [parallel.tensors[same[0]], parallel.tensors[i]], values[same[0]],
                        values[i], "replica of one partial part"))
        reps = [(lo, hi, same[0]) for (lo, hi), same in by_range.items()]
        covers, _ = exact_covers(reps, abs(n))
        piece = ref[(tid, lver)][_region(slices)]
        for cover in covers:
            report.groups += 1
            if n < 0:
                total, what = np.max([values[i] for i in cover], axis=0), "partial-max group"
            else:
                total, what = sum(values[i] for i in cover), "partial-sum group"
            if not _close(total, piece, rtol):
                report.differences.append(Difference(
                    name, [parallel.tensors[i] for i in cover], piece, total, what))
    report.uncovered = final_state(single, parallel, ref_values, raw, rtol)
    return report


def _region(slices) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in slices)


def _updated(expected, got, box, held, rtol: float) -> bool:
    """Whether a rank's last update ``got``, of slice ``box``, covers every
    shard the rank holds and equals the updated tensor over all of ``box``
    (a whole parameter gathered after the step, or the shard itself)."""
    inside = all(a <= c and d <= b for s in held for (a, b), (c, d) in zip(box, s))
    return inside and _close(got, expected[_region(box)], rtol)


def final_state(single: Plan, parallel: Plan, ref_values: list, values: list,
                rtol: float) -> list[str]:
    """The per-rank contract of verdict/final.py, judged by value: every
    rank's last gradient buffer of each shard it holds equals the final
    single-device gradient there (and, with an optimizer step, its last
    parameter and optimizer state the updated ones), and each set of
    data-parallel replicas ends with the whole loss."""
    problems = []
    last = {t.tid: i for i, t in enumerate(single.tensors)
            if t.version == final_version(single, t.tid)}
    states = rank_states(single, parallel)
    opt_states = optimizer_states(single)
    for rank, st in states.items():
        for p, held in sorted(st.held.items()):
            name = single.logical[p].name
            expected = ref_values[last[single.grads[p]]]
            got = st.last_grad.get(p)
            if got is None:
                problems.append(f"rank {rank} holds a shard of {name} but ends with no gradient")
                continue
            for slices in held:
                if not _close(values[got], expected[_region(slices)], rtol):
                    problems.append(f"rank {rank} ends with a gradient of {name} that is not "
                                    f"the single-device gradient of its shard")
                    break
            if final_version(single, p) > 0:
                for tid in (p, *opt_states.get(p, ())):
                    got = (st.last_param if tid == p else st.last_state).get(tid)
                    if got is None or not _updated(ref_values[last[tid]], values[got],
                                                   parallel.tensors[got].slices, held, rtol):
                        problems.append(f"rank {rank} does not end with the updated "
                                        f"{single.logical[tid].name} of its shard")
    for p in single.grads:
        if not any(p in st.held for st in states.values()):
            problems.append(f"no rank holds {single.logical[p].name}")
    try:
        check_layout(parallel)
    except StructureError as e:
        return [*problems, str(e)]
    loss = ref_values[last[single.loss]]
    groups = loss_groups(single, parallel, states)
    if not groups:
        problems.append("no rank ends with the loss")
    for group in groups:
        total = sum(values[t] for t in group)
        mean = total / len(group)  # the mean convention: each rank's loss over its own data
        if not (_close(np.asarray(total, dtype=float), loss, rtol)
                or _close(np.asarray(mean, dtype=float), loss, rtol)):
            ranks = sorted({parallel.tensors[t].rank for t in group})
            problems.append(f"the loss on ranks {ranks} (data-parallel replicas) sums to "
                            f"{float(np.sum(total)):.6g}, not {float(np.sum(loss)):.6g}")
    return problems
