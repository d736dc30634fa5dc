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
3. :func:`check_uniform`: every shown replica and microbatch of a class of
   ranks runs one program (else ``StructureError('fold')``, a finding).

Then the pair goes through the unchanged pipeline.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from verdict.layout import Layout
from verdict.lineage import StructureError
from verdict.ops import get_op
from verdict.plan import FOLD_KEYS, INPUT_KINDS, Node, Plan, Tensor
from verdict.reduce import RuleMemo, node_relations
from verdict.structure import check_structure, fw_shapes, node_label

#: Replicas and microbatches a folded plan shows on an axis it folds.
SHOWN = 2
#: Operators whose reduction over a dim is a plain sum.
SUMS = ("sum", "linear", "matmul", "einsum")
#: The op that adds a microbatch's gradient into the running buffer.
ACCUMULATE = "local_grad_accumulation"
#: Collectives that may cross replicas: sums of gradient buffers' chain ends.
ORBIT_SUMS = ("reducer", "all_reduce")
#: Input-less nodes whose outputs a block may read outside microbatches.
CONSTANTS = ("zeros", "ones")


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


def inner_size(world: dict) -> int:
    """The ranks of one replica between its replica index and tp, as the
    symmetry counts them: the ep ranks of the block times the cp ranks.
    The mesh puts replica d = edp * ep + e, so a rank's (edp, e, c) is
    (replica, inner index) of a mesh with edp replicas and ep * cp inner
    ranks."""
    return int(world.get("ep", 1)) * int(world.get("cp", 1))


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


# -- uniformity of the shown replicas and microbatches -------------------------

class _Uniformity:
    def __init__(self, single: Plan, parallel: Plan, fold: Fold):
        self.p, self.fold = parallel, fold
        w = parallel.world
        self.mesh = Layout(fold.dp, inner_size(w), int(w.get("tp", 1)))
        self.batch = batch_dims(single)
        self.rows = fold.real_gbs // (fold.real_dp * fold.real_nm)
        self.producer = parallel.producers()
        self.offset: dict[tuple, int] = {}
        #: (rank, gradient buffer tid) -> the tensor its last accumulation writes
        self.chain_end: dict[tuple[int, int], int] = {}

    def fail(self, i: int, j: int | None, why: str) -> None:
        other = f" and {node_label(self.p, j)}" if j is not None else ""
        raise StructureError("fold", f"the folded plan is not uniform: {node_label(self.p, i)}"
                                     f"{other}: {why}; a folded plan's shown replicas and "
                                     f"microbatches must run one program (docs/soundness.md)")

    def run(self, compare: bool = True) -> None:
        """The rules, and with ``compare`` every block and step program
        against replica 0's and microbatch 0's."""
        programs: dict[tuple, list[int]] = defaultdict(list)
        for i, node in enumerate(self.p.nodes):
            cls, d = self.mesh.split(node.rank)
            programs[(cls, d, node.mb)].append(i)
        for (cls, d, mb), nodes in programs.items():
            if mb >= 0:
                self.offset[(cls, d, mb)] = self.first_row(nodes)
        self.check_offsets()
        self.check_blocks(programs)
        self.check_chains()
        self.check_final_buffers()
        seen: dict[int, tuple] = {}
        for (cls, _, mb), nodes in sorted(programs.items()):
            base = (cls, 0, 0) if mb >= 0 else (cls, 0, -1)
            if base not in programs:
                self.fail(nodes[0], None, "its class has no block of replica 0, microbatch 0")
            ref = programs[base]
            if not compare:
                for i in nodes:
                    self.normal(i)  # checks what is checked, not compared
                continue
            if len(ref) != len(nodes):
                self.fail(nodes[0], ref[0], f"{len(nodes)} nodes against {len(ref)}")
            for i, j in zip(nodes, ref):
                if j not in seen:
                    seen[j] = self.normal(j)  # also checks what is checked, not compared
                if i != j and self.normal(i) != seen[j]:
                    self.fail(i, j, "a different operator, kwargs, shape or dataflow")

    def check_blocks(self, programs: dict[tuple, list[int]]) -> None:
        """Every class with a block program has one for each shown (d, m),
        and nothing else: no replica or microbatch beyond the shown ones."""
        want = {(d, m) for d in range(self.fold.dp) for m in range(self.fold.nm)}
        have: dict[tuple, set] = defaultdict(set)
        for cls, d, mb in programs:
            if mb >= 0:
                have[cls].add((d, mb))
        for cls, blocks in have.items():
            if blocks != want:
                extra, missing = sorted(blocks - want), sorted(want - blocks)
                raise StructureError("fold", (
                    f"the folded plan's rank class {cls} runs blocks (replica, microbatch) "
                    f"{extra} beyond, or lacks {missing} of, the shown dp {self.fold.dp} x "
                    f"nm {self.fold.nm}"))

    def first_row(self, nodes: list[int]) -> int:
        """The first batch row the block's data and tokens inputs hold."""
        starts = [self.p.tensors[t].slices[d][0] for i in nodes for t in self.p.nodes[i].inputs
                  if t >= 0 and self.producer[t] < 0 and self.is_data(t)
                  for d in self.batch.get(self.p.tensors[t].tid, ())]
        return min(starts, default=-1)

    def is_data(self, t: int) -> bool:
        return self.p.logical[self.p.tensors[t].tid].kind in ("data", "tokens")

    def check_offsets(self) -> None:
        """The blocks that load data start b rows apart and cover [0, B')
        once, a block's start being the first row any of its ranks loads;
        ``offset`` then holds each block's start for each of its classes,
        which the input slices are compared relative to (with expert
        parallelism the ep ranks of a block load consecutive rows of it)."""
        starts = block_starts(self.offset)
        want = [k * self.rows for k in range(self.fold.dp * self.fold.nm)]
        if sorted(starts.values()) != want:
            raise StructureError("fold", (
                f"the folded plan's blocks start at batch rows {sorted(starts.values())}, "
                f"not {want}: its replicas and microbatches do not split the batch into "
                f"blocks of {self.rows} rows"))
        self.offset = {(cls, d, m): starts[(d, m)] if row >= 0 else -1
                       for (cls, d, m), row in self.offset.items()}

    def tensor(self, i: int, t: int, orbit: bool, chain: bool):
        """A tensor as the program of node i sees it, without the block."""
        if t < 0:
            return None
        node, x = self.p.nodes[i], self.p.tensors[t]
        cls, d = self.mesh.split(x.rank)
        if d != self.mesh.split(node.rank)[1] and not orbit:
            self.fail(i, None, f"it reads replica {d}'s tensor outside a collective over "
                               f"the replicas")
        mb: object = x.mb
        version: object = x.version
        lver: object = x.lver
        if node.mb >= 0:
            if chain:
                mb = version = lver = "chain"
            elif x.mb == node.mb:
                mb = "own"
            elif x.mb != -1:
                self.fail(i, None, f"it reads microbatch {x.mb}'s tensor")
            elif self.producer[t] >= 0 and self.p.nodes[self.producer[t]].op not in CONSTANTS:
                self.fail(i, None, "it reads a value computed outside microbatches, which "
                                   "may depend on every block")
        desc = (cls, mb, x.tid, version, lver, x.shape)
        if self.producer[t] < 0 and self.p.logical[x.tid].kind in INPUT_KINDS:
            row = self.offset.get((self.mesh.split(node.rank)[0], d, x.mb), -1)
            slices = list(x.slices)
            for k in self.batch.get(x.tid, ()):
                if row < 0:
                    continue
                a, b = slices[k][0] - row, slices[k][1] - row
                if not (0 <= a < b <= self.rows):
                    self.fail(i, None, f"its input {self.p.logical[x.tid].name} holds rows "
                                       f"outside its block")
                slices[k] = (a, b)
            desc += (tuple(slices), x.parts)
        return desc

    def normal(self, i: int) -> tuple:
        """Node i without its block: what must equal across blocks (its name,
        a label, is not part of it)."""
        node = self.p.nodes[i]
        kwargs = dict(node.kwargs)
        own_d = self.mesh.split(node.rank)[1]
        orbit = get_op(node.op).group and any(
            t >= 0 and self.mesh.split(self.p.tensors[t].rank)[1] != own_d for t in node.inputs)
        if orbit:
            if node.op not in ORBIT_SUMS or node.mb != -1 or not self.sums_chain_ends(node):
                self.fail(i, None, "only a sum of gradient buffers, after every microbatch, "
                                   "may cross replicas")
            self.check_orbit(i)
            kwargs.pop("index", None)
        for key in ("src", "dst"):
            if node.op == "send_recv" and key in kwargs:
                cls, d = self.mesh.split(kwargs[key])
                if d != own_d:
                    self.fail(i, None, f"its {key} rank {kwargs[key]} is in replica {d}")
                kwargs[key] = cls
        chain = node.op == ACCUMULATE and node.mb >= 0
        ins = tuple(self.tensor(i, t, orbit, chain and k == 0) for k, t in enumerate(node.inputs))
        outs = tuple(self.tensor(i, t, False, chain) for t in node.outputs)
        return (node.op, node.dir, repr(sorted(kwargs.items())), ins, outs)

    def check_orbit(self, i: int) -> None:
        """A collective across replicas spans the whole orbit: every replica
        d' the same number of times, with the same other coordinates, in
        replica-major or replica-minor order, its own rank at ``index``."""
        node = self.p.nodes[i]
        ranks = [self.p.tensors[t].rank for t in node.inputs if t >= 0]
        parts = [self.mesh.split(r) for r in ranks]
        dp = self.fold.dp
        per = len(parts) // dp
        by_d = [[c for c, d in parts if d == k] for k in range(dp)]
        major = [d for d in range(dp) for _ in range(per)]
        minor = [d for _ in range(per) for d in range(dp)]
        if len(parts) % dp or any(g != by_d[0] for g in by_d) or \
                [d for _, d in parts] not in (major, minor):
            self.fail(i, None, "its group is not the whole orbit of replicas")
        index = node.kwargs.get("index")
        if not isinstance(index, int) or not 0 <= index < len(ranks) or ranks[index] != node.rank:
            self.fail(i, None, "its index is not its own position in the group")

    def check_chains(self) -> None:
        """Per rank and gradient buffer, the microbatches' accumulations form
        one chain: each reads the previous one's output, the first a buffer
        made outside microbatches."""
        last: dict[tuple[int, int], int] = {}
        for i, node in enumerate(self.p.nodes):
            if node.op != ACCUMULATE or node.mb < 0:
                continue
            buf = node.inputs[0] if node.inputs else -1
            key = (node.rank, self.p.tensors[buf].tid if buf >= 0 else -1)
            if key in last:
                ok = buf == self.p.nodes[last[key]].outputs[0]
            else:
                start = self.producer[buf] if buf >= 0 else -1
                ok = start >= 0 and self.p.nodes[start].op == "zeros" and \
                    self.p.tensors[buf].mb == -1
            if not ok:
                self.fail(i, last.get(key), "its gradient buffer is not the running one "
                                            "(zeros, then each microbatch's accumulation)")
            last[key] = i
        self.chain_end = {key: self.p.nodes[i].outputs[0] for key, i in last.items()}

    def sums_chain_ends(self, node: Node) -> bool:
        return all(t >= 0 and self.chain_end.get((self.p.tensors[t].rank, self.p.tensors[t].tid))
                   == t for t in node.inputs)

    def check_final_buffers(self) -> None:
        """The gradient buffer a rank ends with is its chain's end, or a sum
        of chain ends (the reducer): the glue between the blocks and what a
        rank ends with is a plain sum, which repeats to any number of
        replicas and microbatches (docs/soundness.md)."""
        last: dict[tuple[int, int], int] = {}
        for i, node in enumerate(self.p.nodes):
            for o in node.outputs:
                if o >= 0 and self.p.logical[self.p.tensors[o].tid].kind == "gradbuf":
                    last[(self.p.tensors[o].rank, self.p.tensors[o].tid)] = i
        for key, i in last.items():
            node = self.p.nodes[i]
            if node.op == ACCUMULATE and node.mb >= 0 and self.chain_end.get(key) in node.outputs:
                continue
            if node.op in ORBIT_SUMS and self.sums_chain_ends(node):
                continue
            self.fail(i, None, "the gradient buffer a rank ends with must be its accumulation's "
                               "last output or a sum of those (a reducer)")


def block_starts(first: dict[tuple, int]) -> dict[tuple[int, int], int]:
    """(replica, microbatch) -> the first batch row any rank class loads in
    that block, from (class, replica, microbatch) -> the class's first row
    there (-1: it loads none)."""
    out: dict[tuple[int, int], int] = {}
    for (_, d, m), row in first.items():
        if row >= 0:
            out[(d, m)] = min(out.get((d, m), row), row)
    return out


def check_uniform(single: Plan, parallel: Plan, compare: bool = True) -> None:
    """Raises StructureError('fold') unless every shown replica and
    microbatch of each class of ranks runs one program (docs/soundness.md).
    ``single`` is the restricted single-device plan (for the batch dims).
    ``compare=False``: the rules only (a mixed cut of classes of blocks,
    verdict/symmetry.py, whose programs differ by construction)."""
    fold = orbit_units(fold_of(parallel), int(parallel.world.get("ep", 1)))
    _Uniformity(single, parallel, fold).run(compare)


def fold_of(parallel: Plan) -> Fold:
    w = parallel.world
    return Fold(w["dp"], w["nm"], w["gbs"], w["fold_dp"], w["fold_nm"], w["fold_gbs"])
