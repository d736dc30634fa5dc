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

from verdict.lineage import exact_covers
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
    """Compare every tensor of ``parallel`` with its lineage in ``single``."""
    ref_values = execute(single, seed)
    report = NumericReport()
    try:
        values = execute(parallel, seed)
    except ExecutionError as e:
        report.broken = str(e)
        return report
    ref = {(t.tid, t.version): ref_values[i] for i, t in enumerate(single.tensors)}
    order = {o: k for k, node in enumerate(parallel.nodes) for o in node.outputs if o >= 0}
    partial: dict[tuple, list[int]] = defaultdict(list)
    covered: dict[int, list] = defaultdict(list)
    for i in sorted(range(len(parallel.tensors)), key=lambda i: order.get(i, -1)):
        t = parallel.tensors[i]
        if values[i] is None:
            continue
        full = ref[(t.tid, t.lver)]
        piece = full[tuple(slice(a, b) for a, b in t.slices)]
        if t.is_whole():
            report.checked += 1
            covered[t.tid].append(t.slices)
            if not _close(values[i], piece, rtol):
                name = parallel.logical[t.tid].name
                report.differences.append(Difference(name, [t], piece, values[i], "tensor"))
        else:
            partial[(t.tid, t.lver, t.slices, t.parts[2])].append(i)
    for (tid, lver, slices, n), members in partial.items():
        covers, _ = exact_covers([(*parallel.tensors[i].parts[:2], i) for i in members], n)
        if not covers:
            continue
        cover = covers[0]
        report.groups += 1
        covered[tid].append(slices)
        total = sum(values[i] for i in cover)
        piece = ref[(tid, lver)][tuple(slice(a, b) for a, b in slices)]
        if not _close(total, piece, rtol):
            name = parallel.logical[tid].name
            report.differences.append(Difference(
                name, [parallel.tensors[i] for i in cover], piece, total, "partial-sum group"))
    report.uncovered = final_coverage(single, parallel, covered)
    return report


def final_coverage(single: Plan, parallel: Plan, covered: dict[int, list]) -> list[str]:
    """Logical results (loss, final gradients) the parallel plan does not
    fully produce: every rank's last gradient buffer must be a whole slice,
    and the slices together must cover the gradient; the loss must be
    covered by whole slices or complete partial-sum groups."""
    problems = []
    last = parallel.last_writes()
    for param, buf in parallel.grads.items():
        name = parallel.logical[param].name
        final = max(t.version for t in single.tensors if t.tid == buf)
        finals = [parallel.tensors[i] for (tid, _), i in last.items() if tid == buf]
        if not finals:
            problems.append(f"gradient of {name} is never produced")
            continue
        stale = [t for t in finals if t.lver != final or not t.is_whole()]
        if stale:
            t = stale[0]
            problems.append(f"gradient of {name} on rank {t.rank} ends incomplete "
                            f"(version {t.version}, parts {t.parts})")
        if not _covers(single.logical[buf].shape, [t.slices for t in finals]):
            problems.append(f"gradient of {name} is not covered by the ranks' final slices")
    if not covered.get(parallel.loss):
        problems.append("the loss is not covered by whole tensors or complete partial sums")
    return problems


def _covers(shape: tuple[int, ...], slices: list[tuple[tuple[int, int], ...]]) -> bool:
    mask = np.zeros(shape, dtype=bool)
    for s in slices:
        mask[tuple(slice(a, b) for a, b in s)] = True
    return bool(mask.all())
