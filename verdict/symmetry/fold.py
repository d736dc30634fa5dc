"""Folded plans: two replicas and two microbatches shown, the others by symmetry.

A folded parallel plan (world keys ``fold_dp``, ``fold_nm``, ``fold_gbs``) is
the plan at dp' = min(dp, 2) replicas and nm' = min(nm, 2) microbatches with
the real constants. Three steps make it comparable with the single-device
plan of the real batch (docs/soundness.md, "Folded plans"):

1. :func:`fold_sizes`: the world's side conditions (else :class:`FoldError`,
   exit 2);
2. :func:`restrict`: the single-device plan restricted to the shown rows
   (every dim of the batch class B -> B'); refused (:class:`FoldError`) when
   a node mixes rows or its meaning depends on the batch size;
3. :func:`verdict.symmetry.uniform.check_uniform`: every shown replica and
   microbatch of a class of ranks runs one program (else
   ``StructureError('fold')``, a finding).

Then the pair goes through the unchanged pipeline.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from verdict.lineage import StructureError
from verdict.ops import get_op
from verdict.plan import FOLD_KEYS, Node, Plan, Tensor
from verdict.reduce import RuleMemo, node_relations
from verdict.structure import check_structure, fw_shapes, node_label
from verdict.symmetry.rules import SHOWN

#: Operators whose reduction over a dim is a plain sum.
SUMS = ("sum", "linear", "matmul", "einsum")


class FoldError(ValueError):
    """A folded plan the argument does not cover: bad input, one line, exit 2."""


@dataclass(frozen=True)
class Fold:
    dp: int  # shown
    nm: int
    gbs: int
    real_dp: int
    real_nm: int
    real_gbs: int

    def describe(self) -> str:
        return (f"{self.dp} of {self.real_dp} replicas and {self.nm} of {self.real_nm} "
                f"microbatches shown and proved; the other blocks are assumed to run the same "
                f"program, not checked (docs/soundness.md)")


def fold_sizes(single: Plan, parallel: Plan) -> Fold:
    """The shown and real sizes of a folded plan, after its side conditions."""
    w = parallel.world
    if not all(isinstance(w.get(k), int) for k in (*FOLD_KEYS, "dp", "nm", "gbs")):
        raise FoldError("a folded plan needs int world keys dp, nm, gbs, "
                        + ", ".join(FOLD_KEYS))
    fold = Fold(w["dp"], w["nm"], w["gbs"], w["fold_dp"], w["fold_nm"], w["fold_gbs"])
    if single.world.get("gbs") != fold.real_gbs:
        raise FoldError(f"the folded plan stands for a global batch of {fold.real_gbs} "
                        f"(--gbs {fold.real_gbs}) but the single-device plan has a batch of "
                        f"{single.world.get('gbs')}: make the single-device plan with "
                        f"--gbs {fold.real_gbs}")
    blocks = fold.real_dp * fold.real_nm
    if fold.real_gbs % blocks:
        raise FoldError(f"fold_gbs {fold.real_gbs} does not split into fold_dp {fold.real_dp} x "
                        f"fold_nm {fold.real_nm} blocks")
    rows = fold.real_gbs // blocks
    if fold.gbs != fold.dp * fold.nm * rows:
        raise FoldError(f"gbs {fold.gbs} is not dp {fold.dp} x nm {fold.nm} x {rows} rows per "
                        f"block, as fold_gbs {fold.real_gbs} gives")
    ep = w.get("ep", 1)
    if not isinstance(ep, int) or ep < 1 or fold.dp % ep or fold.real_dp % ep:
        raise FoldError(f"ep {ep} must divide dp {fold.dp} and fold_dp {fold.real_dp}")
    if w.get("zero", 0):
        raise FoldError("a folded plan with ZeRO is not covered: replicas do not run one "
                        "program")
    orbit = orbit_units(fold, ep)
    for shown, real, name in ((orbit.dp, orbit.real_dp, "dp / ep" if ep > 1 else "dp"),
                              (fold.nm, fold.real_nm, "nm")):
        if shown not in (min(real, SHOWN), real):
            raise FoldError(f"{name} {shown} must be min(fold_{name}, {SHOWN}) = "
                            f"{min(real, SHOWN)} or fold_{name} {real}")
    return fold


def orbit_units(fold: Fold, ep: int) -> Fold:
    """The fold with replicas counted as expert-data-parallel indices: with
    expert parallelism (``ep`` > 1) a block is one edp index's ep ranks for
    one microbatch, and the orbit of a rank class is its edp replicas
    (docs/soundness.md, "Expert parallelism: the ep ranks inside a block")."""
    return Fold(fold.dp // ep, fold.nm, fold.gbs, fold.real_dp // ep, fold.real_nm,
                fold.real_gbs)


# -- restriction of the single-device plan ------------------------------------

class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b) -> None:
        self.parent[self.find(b)] = self.find(a)


def batch_dims(single: Plan) -> dict[int, tuple[int, ...]]:
    """Logical id -> its dims in the batch class: dim 0 of every data and
    tokens input, tied through every node's dims relation. Raises FoldError
    for a node that mixes rows or depends on the batch size."""
    memo = RuleMemo()
    uf = _UnionFind()
    rels = []
    for node in single.nodes:
        node_rels = [_logical(single, r) for r in node_relations(single, node, memo)]
        rels.append(node_rels)
        for rel in node_rels:
            if rel[0] == "eq":
                uf.union(rel[1], rel[2])
    seeds = [(t.tid, 0) for t in single.tensors
             if single.logical[t.tid].kind in ("data", "tokens") and t.shape]
    if not seeds:
        raise FoldError("the single-device plan has no data or tokens input to fold")
    for s in seeds[1:]:
        uf.union(seeds[0], s)
    root = uf.find(seeds[0])
    dims: dict[int, set[int]] = defaultdict(set)
    for tid, logical in enumerate(single.logical):
        for d in range(len(logical.shape)):
            if uf.find((tid, d)) == root:
                dims[tid].add(d)
    for i, (node, node_rels) in enumerate(zip(single.nodes, rels)):
        _check_rows(single, i, node, node_rels, dims)
    return {tid: tuple(sorted(ds)) for tid, ds in dims.items()}


def _logical(plan: Plan, rel: tuple) -> tuple:
    def ref(r):
        return (plan.tensors[r[0]].tid, r[1])

    if rel[0] == "eq":
        return ("eq", ref(rel[1]), ref(rel[2]))
    if rel[0] == "min":
        return ("min", ref(rel[1]), rel[2])
    return ("mul", ref(rel[1]), [ref(f) for f in rel[2]], rel[3])


def _check_rows(single: Plan, i: int, node: Node, rels: list[tuple], dims) -> None:
    """The node treats the batch class along it (tied to an output dim, no
    minimum) or sums over it (a sum or a contraction)."""
    def batch(ref) -> bool:
        return ref[1] in dims.get(ref[0], ())

    def refuse(why: str) -> None:
        raise FoldError(f"cannot fold: {node_label(single, i)} {why} along the batch dim")

    for rel in rels:
        if rel[0] == "mul" and any(batch(r) for r in (rel[1], *rel[2])):
            refuse("merges or splits rows")
        if rel[0] == "min" and batch(rel[1]) and node.op not in SUMS:
            refuse("mixes rows")
    if node.op in SUMS:
        return
    outs = {single.tensors[t].tid for t in _fw_outputs(node) if t >= 0}
    if not outs:
        return
    tied = set()
    for rel in rels:
        if rel[0] == "eq":
            (ta, da), (tb, db) = rel[1], rel[2]
            if tb in outs:
                tied.add((ta, da))
            if ta in outs:
                tied.add((tb, db))
    for t in _fw_inputs(node):
        if t < 0:
            continue
        tid = single.tensors[t].tid
        if any((tid, d) not in tied for d in dims.get(tid, ())):
            refuse("reduces")


def _fw_inputs(node: Node) -> list[int]:
    rule = get_op(node.op)
    if node.dir == "bw" and rule.backward is not None:
        n = len(node.outputs)
        return [s if s >= 0 else g for s, g in zip(node.inputs[:n], node.outputs)]
    return list(node.inputs)


def _fw_outputs(node: Node) -> list[int]:
    rule = get_op(node.op)
    if node.dir == "bw" and rule.backward is not None:
        return list(node.inputs[len(node.outputs):])
    return list(node.outputs)


def restrict(single: Plan, fold: Fold) -> Plan:
    """The single-device plan at the shown rows: every batch dim B -> B',
    size kwargs resized, constants unchanged (docs/soundness.md)."""
    dims = batch_dims(single)
    full, shown = fold.real_gbs, fold.gbs
    for tid, ds in dims.items():
        for d in ds:
            if single.logical[tid].shape[d] != full:
                raise FoldError(f"cannot fold: dim {d} of {single.logical[tid].name} is in the "
                                f"batch class but has size {single.logical[tid].shape[d]}, "
                                f"not gbs {full}")

    def shape(tid: int, old: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shown if d in dims.get(tid, ()) else n for d, n in enumerate(old))

    logical = [lg._replace(shape=shape(tid, lg.shape)) for tid, lg in enumerate(single.logical)]
    tensors = []
    for t in single.tensors:
        if t.slices != tuple((0, n) for n in single.logical[t.tid].shape) or not t.is_whole():
            raise FoldError("cannot fold: the single-device plan holds a tensor that is not whole")
        new = shape(t.tid, t.shape)
        tensors.append(Tensor(t.rank, t.mb, t.tid, t.version, new, t.lver,
                              tuple((0, n) for n in new), t.parts))
    out = Plan(world={**single.world, "gbs": shown}, logical=logical, tensors=tensors,
               nodes=[], loss=single.loss, grads=dict(single.grads))
    for node in single.nodes:
        ins, outs = fw_shapes(out, node)
        out.nodes.append(node._replace(kwargs=get_op(node.op).resized(node.kwargs, ins, outs)))
    try:
        check_structure(out, "the restricted single-device plan")
    except StructureError as e:
        raise FoldError(f"cannot fold: the single-device plan at {shown} rows breaks a shape "
                        f"rule: {e}") from None
    return out


def fold_pair(single: Plan, parallel: Plan) -> tuple[Plan, Fold | None]:
    """The single-device plan to compare a parallel plan with: restricted to
    the shown rows when the parallel plan is folded."""
    if not parallel.is_folded():
        return single, None
    fold = fold_sizes(single, parallel)
    return restrict(single, fold), fold


def fold_of(parallel: Plan) -> Fold:
    w = parallel.world
    return Fold(w["dp"], w["nm"], w["gbs"], w["fold_dp"], w["fold_nm"], w["fold_gbs"])
