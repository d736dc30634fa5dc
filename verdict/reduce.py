"""Shape reduction: the smallest shapes at which a stage means the same.

Each dim of each single-device tensor of a stage gets a reduced size. Dims
tied by the Gs node's ``dims`` relations share a size (or a product of
sizes, for unflatten/flatten/repeat); every reduced size is a multiple of
the number of pieces the parallel plan cuts that dim into, and at least the
minimum the operator asks for (a contracted dim of at least 2, so a missing
reduction shows). A parallel tensor's reduced slice is its full slice scaled
by reduced/full size, so every partition keeps its structure.

This is valid because every operator acts uniformly along its dims (the
causal mask and routing keep their structure at any size); docs/soundness.md
states the argument and its limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verdict.lineage import Lineage, StructureError
from verdict.ops import get_op
from verdict.plan import Plan, Slices
from verdict.stages import Stage
from verdict.structure import fw_shapes

Ref = tuple[int, int]  # (Gs tensor, dim)


@dataclass
class Reduction:
    gs_shape: dict[int, tuple[int, ...]]  # Gs tensor -> reduced shape
    gp_slices: dict[int, Slices]  # Gp tensor -> reduced slices (full coordinates)

    def gp_shape(self, t: int) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.gp_slices[t])


class _Classes:
    """Union-find over dims with sizes, piece counts and minimums."""

    def __init__(self):
        self.parent: dict[Ref, Ref] = {}
        self.count: dict[Ref, int] = {}
        self.minimum: dict[Ref, int] = {}
        self.full: dict[Ref, int] = {}

    def add(self, ref: Ref, full: int) -> None:
        if ref not in self.parent:
            self.parent[ref] = ref
            self.count[ref], self.minimum[ref], self.full[ref] = 1, 1, full

    def find(self, r: Ref) -> Ref:
        while self.parent[r] != r:
            self.parent[r] = self.parent[self.parent[r]]
            r = self.parent[r]
        return r

    def union(self, a: Ref, b: Ref) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.full[ra] != self.full[rb]:
            raise StructureError("shape", f"dims {a} and {b} are tied but sized "
                                          f"{self.full[ra]} and {self.full[rb]}")
        self.parent[rb] = ra
        self.count[ra] = math.lcm(self.count[ra], self.count[rb])
        self.minimum[ra] = max(self.minimum[ra], self.minimum[rb])

    def need(self, r: Ref, count: int = 1, minimum: int = 1) -> None:
        root = self.find(r)
        self.count[root] = math.lcm(self.count[root], count)
        self.minimum[root] = max(self.minimum[root], minimum)

    def size(self, r: Ref) -> int:
        root = self.find(r)
        full, count = self.full[root], self.count[root]
        return min(full, count * math.ceil(self.minimum[root] / count))


def _pieces(full: int, slices: list[tuple[int, int]]) -> int:
    """How many equal pieces a dim must keep so every boundary stays one."""
    g = full
    for a, b in slices:
        g = math.gcd(g, a, b)
    return full // g if g else 1


def reduce_stage(single: Plan, parallel: Plan, stage: Stage, lineages: list[Lineage],
                 of_gp: list[int], gp_tensors: list[int]) -> Reduction:
    classes = _Classes()
    own = single.nodes[stage.gs_node] if stage.gs_node >= 0 else None
    ts_list = sorted({lineages[lid].ts for lid in (*stage.inputs, *stage.outputs)}
                     | {lineages[of_gp[t]].ts for t in gp_tensors}
                     | ({t for t in (*own.inputs, *own.outputs) if t >= 0} if own else set()))
    for ts in ts_list:
        for d, n in enumerate(single.tensors[ts].shape):
            classes.add((ts, d), n)
    products: list[tuple[Ref, list[Ref], int]] = []
    if stage.gs_node >= 0:
        products = _relate(single, stage.gs_node, classes)
    by_ts: dict[int, list[int]] = {}
    for t in gp_tensors:
        by_ts.setdefault(lineages[of_gp[t]].ts, []).append(t)
    for ts, members in by_ts.items():
        for d, n in enumerate(single.tensors[ts].shape):
            classes.need((ts, d), _pieces(n, [parallel.tensors[t].slices[d] for t in members]))
    size = _sizes(classes, products)
    gs_shape = {ts: tuple(size((ts, d)) for d in range(len(single.tensors[ts].shape)))
                for ts in ts_list}
    gp_slices = {}
    for t in gp_tensors:
        ts = lineages[of_gp[t]].ts
        full, red = single.tensors[ts].shape, gs_shape[ts]
        gp_slices[t] = tuple((a * r // n, b * r // n) if n else (0, 0)
                             for (a, b), n, r in zip(parallel.tensors[t].slices, full, red))
    return Reduction(gs_shape, gp_slices)


def _relate(single: Plan, index: int, classes: _Classes) -> list[tuple[Ref, list[Ref], int]]:
    """Apply the Gs node's dim relations; return its product relations."""
    node = single.nodes[index]
    rule = get_op(node.op)
    ins, outs = fw_shapes(single, node)
    refs = _fw_refs(single, index)
    products = []
    if node.dir == "bw" and rule.backward is not None:
        n = len(node.outputs)
        for s, g in zip(node.inputs[:n], node.outputs):
            if s >= 0 and g >= 0:
                for d in range(len(single.tensors[s].shape)):
                    classes.union((s, d), (g, d))
    for rel in rule.relations(ins, outs, node.kwargs):
        if rel[0] == "eq":
            a, b = refs(rel[1]), refs(rel[2])
            if a and b:
                classes.union(a, b)
        elif rel[0] == "min":
            a = refs(rel[1])
            if a:
                classes.need(a, minimum=rel[2])
        elif rel[0] == "mul":
            target, factors = refs(rel[1]), [refs(f) for f in rel[2]]
            if target and all(factors):
                products.append((target, factors, rel[3]))
    return products


def _fw_refs(single: Plan, index: int):
    """Map a relation's ('i'|'o', position, dim) to a (Gs tensor, dim)."""
    node = single.nodes[index]
    rule = get_op(node.op)
    if node.dir == "bw" and rule.backward is not None:
        n = len(node.outputs)
        ins = [s if s >= 0 else g for s, g in zip(node.inputs[:n], node.outputs)]
        outs = list(node.inputs[n:])
    else:
        ins, outs = list(node.inputs), list(node.outputs)

    def ref(r) -> Ref | None:
        side, pos, dim = r
        t = (ins if side == "i" else outs)[pos]
        return (t, dim) if t >= 0 else None

    return ref


def _sizes(classes: _Classes, products: list[tuple[Ref, list[Ref], int]]):
    """Reduced size of each dim: its class's size, products computed from
    their factors (and the first factor grown until the product splits into
    the pieces the target needs)."""
    extra: dict[Ref, int] = {}

    def base(r: Ref) -> int:
        root = classes.find(r)
        return extra.get(root, classes.size(root))

    derived: dict[Ref, int] = {}
    for target, factors, k in products:
        root = classes.find(target)
        value = k * math.prod(base(f) for f in factors)
        count = classes.count[root]
        if value % count:
            first = classes.find(factors[0])
            grow = count // math.gcd(count, value)
            extra[first] = base(first) * grow
            value *= grow
        if value > classes.full[root]:
            value = classes.full[root]
        derived[root] = value

    def size(r: Ref) -> int:
        root = classes.find(r)
        return derived.get(root, base(root))

    return size
