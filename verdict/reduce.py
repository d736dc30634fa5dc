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
from dataclasses import dataclass, field

from verdict.lineage import Lineage, StructureError
from verdict.ops import ShapeError, get_op
from verdict.plan import Node, Plan, Slices
from verdict.stages import Stage
from verdict.structure import fw_shapes, node_label

Ref = tuple[int, int]  # (Gs tensor, dim)


@dataclass
class Reduction:
    gs_shape: dict[int, tuple[int, ...]]  # Gs tensor -> reduced shape
    gp_slices: dict[int, Slices]  # Gp tensor -> reduced slices (full coordinates)
    gp_shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self):
        self.gp_shapes = {t: tuple(b - a for a, b in s) for t, s in self.gp_slices.items()}

    def gp_shape(self, t: int) -> tuple[int, ...]:
        return self.gp_shapes[t]


class RuleMemo:
    """Operator rule results by (op, direction, kwargs, shapes). A plan's
    layers, ranks and microbatches repeat the same few, so one preparation
    pass asks each rule once per distinct case."""

    def __init__(self):
        self.relations: dict[tuple, list[tuple]] = {}
        self.reduced: dict[tuple, str] = {}

    @staticmethod
    def key(node: Node, ins, outs) -> tuple:
        return (node.op, node.dir, repr(node.kwargs), tuple(ins), tuple(outs))


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
                 of_gp: list[int], gp_tensors: list[int], memo: RuleMemo | None = None) -> Reduction:
    memo = memo or RuleMemo()
    classes = _Classes()
    own = single.nodes[stage.gs_node] if stage.gs_node >= 0 else None
    own_ts = {t for t in (*own.inputs, *own.outputs) if t >= 0} if own else set()
    ts_of = {t: lineages[of_gp[t]].ts for t in gp_tensors}
    ts_list = sorted({lineages[lid].ts for lid in (*stage.inputs, *stage.outputs)}
                     | set(ts_of.values()) | own_ts)
    for ts in ts_list:
        for d, n in enumerate(single.tensors[ts].shape):
            classes.add((ts, d), n)
    products: list[tuple[Ref, list[Ref], int]] = []
    if own is not None:
        products = _apply(classes, node_relations(single, own, memo), lambda r: r)
    distinct = _distinct_nodes(parallel, stage.gp_nodes, ts_of)
    for i in distinct:
        _check_parallel(single, parallel, i, classes, ts_of, own_ts, memo)
    by_ts: dict[int, list[int]] = {}
    for t in gp_tensors:
        by_ts.setdefault(ts_of[t], []).append(t)
    for ts, members in by_ts.items():
        for d, n in enumerate(single.tensors[ts].shape):
            classes.need((ts, d), _pieces(n, [parallel.tensors[t].slices[d] for t in members]))
    _keep_square_pieces(single, classes, ts_list)
    kept: set[int] = set()  # parallel nodes whose products are kept at full size
    while True:
        reduction = _reduction(single, parallel, classes, products, ts_list, gp_tensors, ts_of)
        try:
            for i in distinct:
                _check_reduced_shapes(parallel, i, reduction, memo)
            return reduction
        except StructureError:
            bad = next(i for i in distinct if _reduced_problem(parallel, i, reduction, memo))
            if bad in kept or not _keep_products(parallel, bad, classes, ts_of, memo):
                raise
            kept.add(bad)


def _reduction(single: Plan, parallel: Plan, classes: _Classes, products: list,
               ts_list: list[int], gp_tensors: list[int], ts_of: dict[int, int]) -> Reduction:
    """The reduced shapes of the stage's tensors from the classes' sizes."""
    size = _sizes(classes, products)
    gs_shape = {ts: tuple(size((ts, d)) for d in range(len(single.tensors[ts].shape)))
                for ts in ts_list}
    gp_slices = {}
    for t in gp_tensors:
        ts = ts_of[t]
        full, red = single.tensors[ts].shape, gs_shape[ts]
        gp_slices[t] = tuple((a * r // n, b * r // n) if n else (0, 0)
                             for (a, b), n, r in zip(parallel.tensors[t].slices, full, red))
    return Reduction(gs_shape, gp_slices)


def _reduced_problem(parallel: Plan, index: int, red: Reduction, memo: RuleMemo) -> str:
    node = parallel.nodes[index]
    ins, outs = fw_shapes(parallel, node, red.gp_shapes.get)
    if any(s is None for s in ins):
        return ""
    key = memo.key(node, ins, outs)
    if key not in memo.reduced:
        memo.reduced[key] = _reduced_shape_problem(node, ins, outs)
    return memo.reduced[key]


def _keep_products(parallel: Plan, index: int, classes: _Classes, ts_of: dict[int, int],
                   memo: RuleMemo) -> bool:
    """The dims a parallel node relates by a product (a ``cat`` of equal
    pieces, a ``flatten``) kept at full size, when the reduction broke the
    node's shapes: a value no piece names (a loose value of a strided
    shard, docs/soundness.md, "Plans traced from PyTorch", 87) ties its
    dims to others only through such nodes. Less reduction is the same
    problem at more sizes, never a weaker one. False when the node relates
    no dims by a product (its shapes then stay a finding)."""
    refs = [r for rel in node_relations(parallel, parallel.nodes[index], memo) if rel[0] == "mul"
            for r in (rel[1], *rel[2])]
    for t, d in refs:
        ts = (ts_of[t], d)
        classes.need(ts, count=classes.full[classes.find(ts)])
    return bool(refs)


def _distinct_nodes(parallel: Plan, nodes: list[int], ts_of: dict[int, int]) -> list[int]:
    """One node per distinct (operator, direction, kwargs, and per slot the
    single-device tensor and local shape): the copies of one operator on
    other ranks and microbatches relate the same dims of the same tensors,
    so checking one of them checks them all."""
    seen: dict[tuple, int] = {}
    for i in nodes:
        n = parallel.nodes[i]
        slots = tuple((ts_of[t], parallel.tensors[t].shape) if t >= 0 else None
                      for t in (*n.inputs, *n.outputs))
        seen.setdefault((n.op, n.dir, repr(n.kwargs), slots), i)
    return list(seen.values())


def node_relations(plan: Plan, node: Node, memo: RuleMemo) -> list[tuple]:
    """The node's dims relations over (plan tensor, dim) refs: its operator's
    ``dims`` rule, and for a backward node each gradient tied to its primal."""
    rule = get_op(node.op)
    ins, outs = fw_shapes(plan, node)
    if node.dir == "bw" and rule.backward is not None:
        n = len(node.outputs)
        fw_ins = [s if s >= 0 else g for s, g in zip(node.inputs[:n], node.outputs)]
        fw_outs = list(node.inputs[n:])
    else:
        fw_ins, fw_outs = list(node.inputs), list(node.outputs)

    def ref(r) -> Ref | None:
        side, pos, dim = r
        t = (fw_ins if side == "i" else fw_outs)[pos]
        return (t, dim) if t >= 0 else None

    rels: list[tuple] = []
    if node.dir == "bw" and rule.backward is not None:
        n = len(node.outputs)
        for s, g in zip(node.inputs[:n], node.outputs):
            if s >= 0 and g >= 0:
                rels += [("eq", (s, d), (g, d)) for d in range(len(plan.tensors[s].shape))]
    key = memo.key(node, ins, outs)
    if key not in memo.relations:
        memo.relations[key] = rule.relations(ins, outs, node.kwargs)
    for rel in memo.relations[key]:
        if rel[0] == "eq":
            a, b = ref(rel[1]), ref(rel[2])
            if a and b:
                rels.append(("eq", a, b))
        elif rel[0] == "min":
            a = ref(rel[1])
            if a:
                rels.append(("min", a, rel[2]))
        elif rel[0] == "mul":
            target, factors = ref(rel[1]), [ref(f) for f in rel[2]]
            if target and all(factors):
                rels.append(("mul", target, factors, rel[3]))
    return rels


def _apply(classes: _Classes, rels: list[tuple], to_ref) -> list[tuple[Ref, list[Ref], int]]:
    """Tie and bound the classes by relations (refs mapped by ``to_ref``);
    return the product relations."""
    products = []
    for rel in rels:
        if rel[0] == "eq":
            classes.union(to_ref(rel[1]), to_ref(rel[2]))
        elif rel[0] == "min":
            classes.need(to_ref(rel[1]), minimum=rel[2])
        else:
            products.append((to_ref(rel[1]), [to_ref(f) for f in rel[2]], rel[3]))
    return products


def _check_parallel(single: Plan, parallel: Plan, index: int, classes: _Classes,
                    ts_of: dict[int, int], own_ts: set[int], memo: RuleMemo) -> None:
    """Read a parallel node's dims relations through the lineage mapping.

    A tie between two dims of one single-device tensor, or between dims of
    the single-device node's own tensors, that the single-device node does
    not make means the parallel node mixes dims of different roles (a
    transpose, swapped operands): a finding. Other ties (tensors the
    single-device node does not touch) join the classes. A minimum on a
    local dim bounds the reduced size so that the local piece keeps it.
    """
    node = parallel.nodes[index]
    for rel in node_relations(parallel, node, memo):
        if rel[0] == "eq":
            (ta, da), (tb, db) = rel[1], rel[2]
            a, b = (ts_of[ta], da), (ts_of[tb], db)
            if classes.find(a) == classes.find(b):
                continue
            if parallel.tensors[ta].shape[da] == 1 and parallel.tensors[tb].shape[db] == 1:
                continue  # dims of size one carry no order to confuse
            if a[0] == b[0] or (a[0] in own_ts and b[0] in own_ts):
                raise StructureError("dims", (
                    f"{node_label(parallel, index)} ties dim {da} of "
                    f"{_tp_name(parallel, ta)} to dim {db} of {_tp_name(parallel, tb)}; in the "
                    f"single-device plan dim {a[1]} of {_ts_name(single, a[0])} and dim {b[1]} of "
                    f"{_ts_name(single, b[0])} have different roles (dims confused: a transpose, "
                    f"a permute or swapped operands)"))
            if classes.full[classes.find(a)] != classes.full[classes.find(b)]:
                raise StructureError("shape", (
                    f"{node_label(parallel, index)} ties dim {da} of {_tp_name(parallel, ta)} "
                    f"to dim {db} of {_tp_name(parallel, tb)}, which in the single-device plan "
                    f"are dim {a[1]} of {_ts_name(single, a[0])} (size "
                    f"{classes.full[classes.find(a)]}) and dim {b[1]} of "
                    f"{_ts_name(single, b[0])} (size {classes.full[classes.find(b)]}): the rank "
                    f"runs it over other entries than the single-device step (some dropped "
                    f"or added)"))
            classes.union(a, b)
        elif rel[0] == "min":
            t, d = rel[1]
            local, full = parallel.tensors[t].shape[d], single.tensors[ts_of[t]].shape[d]
            if local:
                classes.need((ts_of[t], d), minimum=-(-rel[2] * full // local))


def _keep_square_pieces(single: Plan, classes: _Classes, ts_list: list[int]) -> None:
    """Two dims of one tensor in one class share a reduced size: keep each of
    their pieces at least 2 long, so a transpose of a piece is never the
    identity of a 1x1 piece."""
    for ts in ts_list:
        roots: dict[Ref, int] = {}
        for d, n in enumerate(single.tensors[ts].shape):
            if n < 2:
                continue
            root = classes.find((ts, d))
            roots[root] = roots.get(root, 0) + 1
        for root, dims in roots.items():
            if dims > 1:
                classes.need(root, minimum=2 * classes.count[root])


def _check_reduced_shapes(parallel: Plan, index: int, red: Reduction, memo: RuleMemo) -> None:
    """The parallel node's shape rule holds at the reduced shapes: reduction
    kept the relations the parallel program relies on."""
    node = parallel.nodes[index]
    ins, outs = fw_shapes(parallel, node, red.gp_shapes.get)
    if any(s is None for s in ins):
        return
    key = memo.key(node, ins, outs)
    if key not in memo.reduced:
        memo.reduced[key] = _reduced_shape_problem(node, ins, outs)
    if memo.reduced[key]:
        raise StructureError("dims", (
            f"{node_label(parallel, index)} does not keep its shapes when the stage is reduced "
            f"({memo.reduced[key]}): its dims relate in a way the single-device node's do not"))


def _reduced_shape_problem(node: Node, ins, outs) -> str:
    rule = get_op(node.op)
    try:
        got = rule.shape(ins, **rule.resized(node.kwargs, ins, outs))
    except (ShapeError, TypeError, ValueError, IndexError, KeyError) as e:
        return str(e) or type(e).__name__
    if any(o is not None and tuple(o) != tuple(g) for o, g in zip(outs, got)):
        return f"it makes {[tuple(g) for g in got]}, expected {list(outs)}"
    return ""


def _tp_name(parallel: Plan, t: int) -> str:
    x = parallel.tensors[t]
    return f"Tensor(rank={x.rank}, mb={x.mb}, tid={x.tid}, v={x.version})"


def _ts_name(single: Plan, t: int) -> str:
    return single.logical[single.tensors[t].tid].name


def _sizes(classes: _Classes, products: list[tuple[Ref, list[Ref], int]]):
    """Reduced size of each dim: its class's size, products computed from
    their factors (and the first factor with room grown until the product
    reaches the target's minimum and splits into the pieces it needs)."""
    extra: dict[Ref, int] = {}

    def base(r: Ref) -> int:
        root = classes.find(r)
        return extra.get(root, classes.size(root))

    derived: dict[Ref, int] = {}
    for target, factors, k in products:
        root = classes.find(target)
        value = k * math.prod(base(f) for f in factors)
        if 0 < value < classes.minimum[root]:
            # the target must keep a minimum size (a narrow of it keeps its
            # full size): grow a factor with room until the product does
            grow = -(-classes.minimum[root] // value)
            roots = [classes.find(f) for f in factors]
            first = next((f for f in roots if base(f) * grow <= classes.full[f]), None)
            if first is not None:
                extra[first] = base(first) * grow
                value *= grow
        count = classes.count[root]
        if value % count:
            grow = count // math.gcd(count, value)
            # grow a factor that has room (a dim of full size 1, such as a
            # kept reduced dim, never grows past 1)
            roots = [classes.find(f) for f in factors]
            first = next((f for f in roots if base(f) * grow <= classes.full[f]), roots[0])
            extra[first] = base(first) * grow
            value *= grow
        if value > classes.full[root]:
            value = classes.full[root]
        derived[root] = value

    def size(r: Ref) -> int:
        root = classes.find(r)
        return derived.get(root, base(root))

    return size
