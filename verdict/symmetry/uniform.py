"""The uniformity rules node by node: a folded plan's shown replicas and
microbatches run one program (docs/soundness.md, "Folded plans", step 3).

:func:`check_uniform` raises ``StructureError('fold')`` at the first node
that breaks a rule of verdict/symmetry/rules.py or differs from replica 0's
and microbatch 0's program.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from verdict.layout import Layout
from verdict.lineage import StructureError
from verdict.ops import get_op
from verdict.plan import INPUT_KINDS, Node, Plan
from verdict.structure import node_label
from verdict.symmetry.fold import Fold, batch_dims, fold_of, orbit_units
from verdict.symmetry.rules import (
    ACCUMULATE,
    CONSTANTS,
    NOT_A_SUM_OF_ENDS,
    NOT_LAST_BUFFER,
    NOT_OWN_INDEX,
    NOT_RUNNING_BUFFER,
    NOT_WHOLE_ORBIT,
    ORBIT_SUMS,
    READS_OUTSIDE,
    accumulation_chains,
    block_offsets,
    ends_with_chains,
    index_kwarg,
    inner_size,
    last_writes,
    own_index,
    reads_outside,
    sum_of_ends,
    whole_orbit,
)


class Uniformity:
    """The rules and comparisons over a folded plan's nodes."""

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
        """Rule (c), :func:`~verdict.symmetry.rules.block_offsets`, over the
        first row each class loads in each block (with expert parallelism
        the ep ranks of a block load consecutive rows of it); ``offset``
        then holds each block's start for each of its classes."""
        self.offset, found = block_offsets(self.offset, self.rows, self.fold.dp * self.fold.nm)
        if found is not None:
            want = [k * self.rows for k in range(self.fold.dp * self.fold.nm)]
            raise StructureError("fold", (
                f"the folded plan's blocks start at batch rows {found}, "
                f"not {want}: its replicas and microbatches do not split the batch into "
                f"blocks of {self.rows} rows"))

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
            else:
                made = self.producer[t] >= 0
                constant = made and self.p.nodes[self.producer[t]].op in CONSTANTS
                if reads_outside(node.mb, x.mb, made, constant):
                    self.fail(i, None, READS_OUTSIDE)
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
            if not sum_of_ends(node.op in ORBIT_SUMS, node.mb, self.sums_chain_ends(node)):
                self.fail(i, None, NOT_A_SUM_OF_ENDS)
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
        """Rule (a), :func:`~verdict.symmetry.rules.whole_orbit` and
        :func:`~verdict.symmetry.rules.own_index`: a collective across
        replicas spans the whole orbit, its own rank at ``index``. Its
        members are its inputs, every one present (rule (d), checked
        before, makes them chain ends)."""
        node = self.p.nodes[i]
        ranks = [self.p.tensors[t].rank for t in node.inputs if t >= 0]
        parts = [self.mesh.split(r) for r in ranks]
        numbered: dict[tuple, int] = {}  # a class -> a number, for the rule's arrays
        cls = np.array([numbered.setdefault(c, len(numbered)) for c, _ in parts], dtype=np.int64)
        if not whole_orbit(cls, np.array([d for _, d in parts], dtype=np.int64), self.fold.dp):
            self.fail(i, None, NOT_WHOLE_ORBIT)
        # Python ints (dtype object): an index of any size is compared as it is
        index = np.array([index_kwarg(node.kwargs, bool_is_int=True)], dtype=object)
        if not own_index(index, np.array([len(ranks)]),
                         lambda valid, k: np.array([ranks[int(k[0])] if valid[0] else -1]),
                         np.array([node.rank]))[0]:
            self.fail(i, None, NOT_OWN_INDEX)

    def check_chains(self) -> None:
        """Rule (b), :func:`~verdict.symmetry.rules.accumulation_chains`,
        per rank and gradient buffer; fails at the first accumulation (in
        node order) that breaks it. ``chain_end`` then holds each chain's
        last output."""
        nodes, tensors = self.p.nodes, self.p.tensors
        acc = [i for i, node in enumerate(nodes) if node.op == ACCUMULATE and node.mb >= 0]
        keys: dict[tuple[int, int], int] = {}  # (rank, gradient buffer tid) -> its number
        key, buf, out, from_zeros = [], [], [], []
        for i in acc:
            node = nodes[i]
            b = node.inputs[0] if node.inputs else -1
            key.append(keys.setdefault((node.rank, tensors[b].tid if b >= 0 else -1), len(keys)))
            buf.append(b)
            out.append(node.outputs[0])
            start = self.producer[b] if b >= 0 else -1
            from_zeros.append(start >= 0 and nodes[start].op == "zeros" and tensors[b].mb == -1)
        order, ok, first, last = accumulation_chains(
            np.array(acc, dtype=np.int64), np.array(key, dtype=np.int64),
            np.array(buf, dtype=np.int64), np.array(out, dtype=np.int64),
            np.array(from_zeros, dtype=bool))
        at = [acc[k] for k in order.tolist()]
        bad = np.flatnonzero(~ok)
        if bad.size:
            k = int(bad[np.argmin([at[b] for b in bad.tolist()])])  # the first in node order
            self.fail(at[k], None if first[k] else at[k - 1], NOT_RUNNING_BUFFER)
        named = list(keys)
        self.chain_end = {named[key[a]]: out[a] for a, end in zip(order.tolist(), last) if end}

    def sums_chain_ends(self, node: Node) -> bool:
        return all(t >= 0 and self.chain_end.get((self.p.tensors[t].rank, self.p.tensors[t].tid))
                   == t for t in node.inputs)

    def check_final_buffers(self) -> None:
        """Rule (f), :func:`~verdict.symmetry.rules.last_writes` and
        :func:`~verdict.symmetry.rules.ends_with_chains`: the gradient buffer
        a rank ends with is its chain's end, or a sum of chain ends (the
        reducer); fails at the first buffer (in the order of first writes)
        that breaks it."""
        keys: dict[tuple[int, int], int] = {}  # (rank, gradient buffer tid) -> its number
        key, writer = [], []
        for i, node in enumerate(self.p.nodes):
            for o in node.outputs:
                if o >= 0 and self.p.logical[self.p.tensors[o].tid].kind == "gradbuf":
                    x = self.p.tensors[o]
                    key.append(keys.setdefault((x.rank, x.tid), len(keys)))
                    writer.append(i)
        named = list(keys)
        for at in last_writes(np.array(key, dtype=np.int64),
                              np.array(writer, dtype=np.int64)).tolist():
            i = writer[at]
            node = self.p.nodes[i]
            chain_end = node.op == ACCUMULATE and node.mb >= 0 and \
                self.chain_end.get(named[key[at]]) in node.outputs
            sums = node.op in ORBIT_SUMS and self.sums_chain_ends(node)
            if not ends_with_chains(chain_end, sums):
                self.fail(i, None, NOT_LAST_BUFFER)


def check_uniform(single: Plan, parallel: Plan, compare: bool = True) -> None:
    """Raises StructureError('fold') unless every shown replica and
    microbatch of each class of ranks runs one program (docs/soundness.md).
    ``single`` is the restricted single-device plan (for the batch dims).
    ``compare=False``: the rules only (a mixed cut of classes of blocks,
    verdict/symmetry/cut.py, whose programs differ by construction)."""
    fold = orbit_units(fold_of(parallel), int(parallel.world.get("ep", 1)))
    Uniformity(single, parallel, fold).run(compare)
