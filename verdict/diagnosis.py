"""A FAIL in a few lines in the user's names: which tensor (a parameter's
gradient, the loss, a module's output), where (module, operator, ranks,
microbatches), and what relation fails, read off the counterexample's
values and the failing stage's nodes:

- a factor: the rank holds k times the single-device value (a gradient
  averaged where it should be summed, divided twice);
- another rank's rows: the rank holds the piece another group claims;
- a partial sum missing parts: the collective that writes the value reads
  fewer ranks than hold the parts of the sum;
- a value from the wrong peer: the value arrives by send/recv from a rank
  or microbatch whose piece it is not;
- otherwise the values, the single-device one and the rank's.

The full dump (``report.failure``) stays what ``main.py`` prints after
these lines and what ``--brief`` writes to a file.
"""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np

from verdict.engine import StageResult, Verdict
from verdict.plan import INPUT_KINDS, Plan
from verdict.report import stage_failure

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")


def diagnose(verdict: Verdict, single: Plan, parallel: Plan) -> list[str]:
    """The lead lines of a FAIL (no trailing ``❌ FAIL`` line): for a failing
    stage its ``❌ Stage N ...`` line, then what, where, why and the values,
    indented; for a structural finding its one line."""
    if verdict.success:
        return []
    if verdict.kind != "stage":
        return [f"❌ not equivalent: {verdict.message}", *mesh_lines(parallel, verdict.message)]
    lines: list[str] = []
    for r in verdict.failed:
        lines += stage_lines(r, single, parallel)
    return lines


def mesh_lines(parallel: Plan, text: str) -> list[str]:
    """The user's mesh coordinates of the ranks a line names."""
    mesh = getattr(parallel, "world", {}).get("mesh")
    ranks = sorted({int(x) for x in re.findall(r"\brank (\d+)", text)})
    if not mesh or not ranks:
        return []
    return [f"   ranks in your mesh ({mesh}): "
            + "; ".join(f"rank {r} = {coordinate(mesh, r)}" for r in ranks)]


def coordinate(mesh: str, rank: int) -> str:
    """Rank ``rank``'s coordinate in a mesh label ``"a=2,b=2"`` (row-major)."""
    dims = [(n, int(s)) for n, _, s in (d.partition("=") for d in mesh.split(","))]
    out = []
    for name, size in reversed(dims):
        out.append(f"{name} {rank % size}")
        rank //= size
    return ", ".join(reversed(out))


def tensor_name(single: Plan, ts: int) -> str:
    """A single-device tensor in the user's words."""
    t = single.tensors[ts]
    if ts == single.loss:
        return "the loss"
    for param, grad in single.grads.items():
        if grad == t.tid:
            return f"the gradient of {single.logical[param].name}"
    logical = single.logical[t.tid]
    words = {"param": "the parameter", "grad": "the gradient", "act": "the activation",
             "data": "the batch input", "tokens": "the batch input"}
    return f"{words.get(logical.kind, logical.kind)} {logical.name}"


def _ranks(items) -> str:
    items = sorted(set(items))
    return ", ".join(str(i) for i in items)


def stage_lines(r: StageResult, single: Plan, parallel: Plan) -> list[str]:
    out, stage, p = r.outcome, r.stage, r.problem
    if stage.gs_node >= 0:
        node = single.nodes[stage.gs_node]
        where = f"module {node.name or '(top)'}, operator {node.op} ({direction(node.dir)})"
    else:
        where = "the stage's inputs"
    head = stage_failure(r, None, single, parallel)[0]  # "❌ Stage N not equivalent: ..."
    if out.status != "counterexample":
        return [head, f"   where: {where}"]
    lines = [head]
    for c, g in out.bad:
        fact = p.claims[c]
        ts = p.ts_global[fact.ts]
        full = np.asarray(out.ts_values[fact.ts])
        if g >= 0:
            slices, members = fact.groups[g]
            expected = full[tuple(slice(a, b) for a, b in slices)]
        else:
            first, others = fact.aliases[-1 - g]
            members, expected = (first, *others), None
        tensors = [parallel.tensors[p.tp_global[m]] for m in members]
        ranks, mbs = _ranks(t.rank for t in tensors), _ranks(t.mb for t in tensors)
        when = "outside microbatches" if mbs == "-1" else f"microbatch {mbs}"
        lines.append(f"   what: {tensor_name(single, ts)} differs on rank"
                     f"{'s' if len(set(t.rank for t in tensors)) > 1 else ''} {ranks} ({when})")
        lines.append(f"   where: {where}")
        lines.append(f"   why: {relation(r, single, parallel, fact, g, members, expected)}")
        if expected is not None:
            got = " + ".join(_values(out.tp_values[m]) for m in members)
            lines.append(f"   counterexample: single-device {_values(expected)}, rank "
                         f"{'s' if len(members) > 1 else ''}{ranks} {got}")
        lines += mesh_lines(parallel, f"rank {' rank '.join(ranks.split(', '))}")
        break  # the first relation of a stage; the dump has the others
    return lines


def direction(d: str) -> str:
    return {"fw": "forward", "bw": "backward"}.get(d, "optimizer step" if d == "none" else d)


def _values(a) -> str:
    text = np.array2string(np.asarray(a, dtype=float), precision=4, threshold=6, edgeitems=2)
    return " ".join(text.split())


def factor(got: np.ndarray, expected: np.ndarray) -> Fraction | None:
    """k when ``got`` is k x ``expected`` (k not 1), else None."""
    if got.shape != expected.shape or not np.any(expected):
        return None
    nz = expected != 0
    ratios = got[nz] / expected[nz]
    k = ratios.flat[0]
    if not np.allclose(ratios, k) or np.any(got[~nz]) or np.isclose(k, 1.0) or np.isclose(k, 0.0):
        return None
    return Fraction(float(k)).limit_denominator(1024)


#: operators that scale a value: a factor found at their output is theirs
SCALING = ("div", "mul", "truediv", "scale", "mean", "avg")


def relation(r: StageResult, single: Plan, parallel: Plan, fact, g: int, members, expected) -> str:
    """What relation fails, from the stage's nodes first, then the values."""
    out, p = r.outcome, r.problem
    if expected is None:
        return "replicas of one piece hold different values"
    writer = writer_node(r, parallel, p.tp_global[members[0]])
    node = parallel.nodes[writer] if writer is not None else None
    if node is not None and node.op == "send_recv":
        src = parallel.tensors[node.inputs[0]]
        if _unread_input(single, parallel, src.tid) and writer_of(parallel, node.inputs[0]) < 0:
            return (f"a message of no single-device value: rank {node.rank} reads here "
                    f"{parallel.logical[src.tid].name}, of which nothing is known")
        return (f"a value from the wrong peer: rank {node.rank} receives it by send_recv "
                f"from rank {src.rank} (microbatch {src.mb}), whose piece it is not")
    if node is not None and node.op.startswith(COLLECTIVES):
        read = {parallel.tensors[t].rank for t in node.inputs if t >= 0}
        parts = partial_ranks(r, parallel, node)
        if parts and read < parts:
            return (f"a partial sum missing the parts of ranks {_ranks(parts - read)}: "
                    f"{node.op} ({node.name or 'step'}) on rank {node.rank} reads ranks "
                    f"{_ranks(read)} only; the parts of the sum are on ranks {_ranks(parts)}")
    total = np.asarray(sum(np.asarray(out.tp_values[m]) for m in members))
    expected = np.asarray(expected)
    k = factor(total, expected)
    scaled = node is not None and any(w in node.op for w in SCALING)
    if k is not None and (scaled or np.count_nonzero(expected) > 1):
        by = f", applied by {node.op} ({node.name or 'step'}) on rank {node.rank}" if scaled else ""
        return f"a factor of {k}: the rank holds {k} x the single-device value{by}"
    full = np.asarray(out.ts_values[fact.ts])
    if total.size > 1 and np.any(total):
        for h, (slices, _) in enumerate(fact.groups):
            other = full[tuple(slice(a, b) for a, b in slices)]
            if h != g and other.shape == total.shape and np.allclose(other, total) \
                    and not np.allclose(other, expected):
                return "another rank's piece: the rank holds the values of another group's slice"
    if node is not None:
        read = _ranks(parallel.tensors[t].rank for t in node.inputs if t >= 0)
        return (f"{node.op} ({node.name or 'step'}) on rank {node.rank}, reading ranks {read}, "
                f"does not compute the single-device value")
    return "the values differ"


def _unread_input(single: Plan, parallel: Plan, tid: int) -> bool:
    """Logical tensor ``tid`` is an input that no single-device node reads
    (a value of the ranks only: a message of which nothing is known)."""
    if parallel.logical[tid].kind not in INPUT_KINDS:
        return False
    mine = {i for i, t in enumerate(single.tensors) if t.tid == tid}
    return not any(i in mine for n in single.nodes for i in n.inputs)


def writer_of(parallel: Plan, tensor: int) -> int:
    """The node of the whole plan that writes ``tensor``; -1 for an input."""
    return next((i for i, n in enumerate(parallel.nodes) if tensor in n.outputs), -1)


def writer_node(r: StageResult, parallel: Plan, tensor: int) -> int | None:
    for i in r.stage.gp_nodes:
        if tensor in parallel.nodes[i].outputs:
            return i
    return None


def partial_ranks(r: StageResult, parallel: Plan, node) -> set[int]:
    """The ranks holding the parts of the partial sum the collective's inputs
    are members of (from the stage's lineages), or empty."""
    p = r.problem
    inputs = {t for t in node.inputs if t >= 0}
    for fact in (*p.given, *p.claims):
        for _, members in fact.groups:
            tensors = [p.tp_global[m] for m in members]
            if len(tensors) > 1 and inputs & set(tensors):
                return {parallel.tensors[t].rank for t in tensors}
    return set()
