"""A load balancer's order of the sequence, and the single-device step
written in that order (docs/soundness.md, "Plans traced from PyTorch",
64-67).

Under a context-parallel load balancer (PyTorch's head-tail one) rank c
holds chunks c and 2 cp - 1 - c of the sequence: two blocks of each
single-device activation, a piece of no one interval. Laid out in the
balancer's order, the sequence is cut into cp contiguous pieces, one per
rank, in rank order. So the single-device step is written in that order:
the same operators on the sequence laid out in the balancer's order, and
the masks that compare positions told which positions their rows and
columns hold (the rule table's ``order`` of ``attention``). Each rank's
values are then contiguous pieces of that step's, claimed as any cut by
"cp". That step computes the single-device loss and gradients exactly,
when every operator on a sequence dim acts on each position alone or sums
over all of them; ``reorder_single`` checks that node by node and refuses
anything else in one line."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from backends.torch.errors import LoweringError
from verdict.plan import Plan
from verdict.reduce import RuleMemo, node_relations

#: operators that act on each position of a sequence dim alone when the dim
#: is tied to an output dim by the rule's "eq" or "mul" relations, and that
#: sum (or take the maximum) over it when it is tied to no output dim
#: (a contraction): both commute with any order of the positions
POSITIONWISE = frozenset({
    "add", "add_scalar", "sub", "mul", "mul_scalar", "div", "pow", "exp", "log", "rsqrt",
    "sigmoid", "silu", "gelu", "relu", "tanh", "clamp", "detach", "multiref", "softmax",
    "linear", "matmul", "einsum", "embedding", "sum", "mean", "max", "transpose", "flatten",
    "unflatten", "local_grad_accumulation",
})
#: on a sequence dim of a single-device step: the positionwise operators
#: and a broadcast (``expand`` keeps each position's values along a dim it
#: does not widen; a constant mask broadcast to the scores)
SEQWISE = POSITIONWISE | {"expand"}
#: operators that cut, join or repeat along their ``dim``: on each position
#: alone along every other dim
ALONG_DIM = frozenset({"split", "narrow", "cat", "repeat_interleave"})
#: operators that read whole sequences and compare positions: told the order
ORDERED = frozenset({"attention", "attention_grad"})


def chunk_order(order: list[int]) -> tuple[int, ...]:
    """The coarsest chunk order a permutation of the positions is: the
    sequence cut into m equal chunks (m the fewest that works), slot k
    holding chunk ``result[k]`` in its own order."""
    s = len(order)
    for m in range(1, s + 1):
        if s % m:
            continue
        n = s // m
        chunks = [order[k * n] for k in range(m)]
        if all(c % n == 0 for c in chunks) and all(
                order[k * n + i] == chunks[k] + i for k in range(m) for i in range(n)):
            return tuple(c // n for c in chunks)
    raise AssertionError("a permutation is always a chunk order of chunks of one")


#: a sequence dim's place inside a dim: (outer, inner), the dim's size being
#: outer * S * inner and its index (o * S + s) * inner + i
Place = tuple[int, int]


class Reorder:
    """Which dims of the single-device plan's tensors carry the sequence
    (``seq``: (tensor, dim) -> place), found node by node from the batch's
    ids, and the check that every node on them commutes with an order of
    the positions."""

    #: the operators accepted on a tracked dim (besides those along
    #: another dim) and those told the order
    allowed: frozenset[str] = SEQWISE
    ordered: frozenset[str] = ORDERED

    def __init__(self, plan: Plan, seqlen: int):
        self.plan, self.s = plan, seqlen
        self.seq: dict[tuple[int, int], Place] = {}
        self.memo = RuleMemo()
        produced = {t for node in plan.nodes for t in node.outputs}
        for t, x in enumerate(plan.tensors):
            if t not in produced and plan.logical[x.tid].kind == "tokens":
                if len(x.shape) < 2 or x.shape[1] != seqlen:
                    raise LoweringError(f"the batch's {plan.logical[x.tid].name} is not "
                                        f"[batch, {seqlen}, ...]: no sequence to reorder")
                self.seq[(t, 1)] = (1, 1)

    def refuse(self, index: int, why: str) -> None:
        node = self.plan.nodes[index]
        raise LoweringError(f"a load balancer's order of the sequence: the single-device "
                            f"step's {node.op} at {node.name or 'step'} {why}; not verified "
                            f"(docs/soundness.md, \"Plans traced from PyTorch\", 65)")

    def size(self, ref: tuple[int, int]) -> int:
        return self.plan.tensors[ref[0]].shape[ref[1]]

    def node(self, index: int) -> None:
        node = self.plan.nodes[index]
        rels = node_relations(self.plan, node, self.memo)
        refs = {r for rel in rels for r in ([rel[1], rel[2]] if rel[0] == "eq" else
                                           [rel[1], *rel[2]] if rel[0] == "mul" else [rel[1]])}
        own = set(node.outputs)
        if not any(r in self.seq for r in refs) and not any(
                (t, d) in self.seq for t in node.inputs if t >= 0
                for d in range(len(self.plan.tensors[t].shape))):
            return
        if node.op in ALONG_DIM:
            for t in node.inputs:
                if t >= 0 and (t, node.kwargs["dim"] % len(self.plan.tensors[t].shape)) \
                        in self.seq:
                    self.refuse(index, "cuts, joins or repeats along the sequence")
        elif node.op not in self.allowed and node.op not in self.ordered:
            self.refuse(index, "reads the sequence and is not known to act on each position "
                               "alone")
        changed = True
        while changed:
            changed = False
            for rel in rels:
                if rel[0] == "eq":
                    changed |= self.tie(index, rel[1], rel[2], own)
                elif rel[0] == "mul":
                    changed |= self.product(index, rel[1], list(rel[2]), rel[3], own)
        for t in node.inputs:
            if t >= 0:
                for d in range(len(self.plan.tensors[t].shape)):
                    if (t, d) in self.seq and self.size((t, d)) > 1 and (t, d) not in refs:
                        self.refuse(index, "reads a sequence dim its rule does not relate")

    def tie(self, index: int, a: tuple[int, int], b: tuple[int, int], own: set[int]) -> bool:
        if self.size(a) == 1 and self.size(b) == 1:
            return False
        pa, pb = self.seq.get(a), self.seq.get(b)
        if pa == pb:
            return False
        if pa is not None and pb is not None:
            self.refuse(index, "ties two sequence dims of different layouts")
        src, dst = (a, b) if pa is not None else (b, a)
        if dst[0] not in own:
            return self.carry(index, dst, self.seq[src],
                              "ties a sequence dim to a dim of a value that does not carry "
                              "the sequence (a table of positions, a value of one rank)")
        self.seq[dst] = self.seq[src]
        return True

    def carry(self, index: int, ref: tuple[int, int], place: Place, why: str) -> bool:
        """Node ``index`` ties the sequence at ``place`` to dim ``ref`` of a
        value it does not make and that does not carry it: refused here (a
        subclass may carry the sequence back to that value's producer)."""
        self.refuse(index, why)
        return False

    def product(self, index: int, target: tuple[int, int], factors: list[tuple[int, int]],
                times: int, own: set[int]) -> bool:
        """``target`` is the product of ``factors`` (flatten; unflatten the
        other way)."""
        inner = [f for f in factors if f in self.seq]
        if target not in self.seq and not inner:
            return False
        if times != 1:
            self.refuse(index, "repeats a sequence dim")
        sizes = [self.size(f) for f in factors]
        if target not in self.seq:
            if len(inner) != 1:
                self.refuse(index, "merges a sequence dim with another")
            j = factors.index(inner[0])
            o, i = self.seq[inner[0]]
            place = (o * math.prod(sizes[:j]), i * math.prod(sizes[j + 1:]))
            if target[0] not in own:
                return self.carry(index, target, place, "merges a sequence dim with another")
            self.seq[target] = place
            return True
        o, i = self.seq[target]
        found = None
        for j in range(len(factors)):
            before, after = math.prod(sizes[:j]), math.prod(sizes[j + 1:])
            if o % before == 0 and i % after == 0 and (o // before) * self.s * (i // after) \
                    == sizes[j]:
                found = (j, (o // before, i // after))
        if found is None:
            self.refuse(index, "cuts a sequence dim across dims")
        j, place = found
        if factors[j] in self.seq:
            if self.seq[factors[j]] != place:
                self.refuse(index, "ties two sequence dims of different layouts")
            return False
        if factors[j][0] not in own:
            return self.carry(index, factors[j], place,
                              "ties a sequence dim to a dim of a value that does not carry it")
        self.seq[factors[j]] = place
        return True


class CarriedConstants(Reorder):
    """``Reorder`` seeded at given values along ``dim``, on a plan whose
    recorded constants (``inputs``) may be tied to the order: such a
    constant is marked to be laid out in it (``relabel``), and a value
    computed from constants alone (a mask broadcast to the scores) carries
    the order back to them, its producer checked again. Shared by the
    sequence's constants (``seq_constants``) and the token rows
    (``token_rows``)."""

    #: whether a node that reads no value (a fill) counts as computed from
    #: the constants
    fills_from_constants = True

    def __init__(self, plan, size: int, seeds: list[int], dim: int, constants: set[int]):
        self.plan, self.s = plan, size
        self.seq: dict[tuple[int, int], Place] = {(v, dim): (1, 1) for v in seeds}
        self.memo = RuleMemo()
        self.inputs = constants
        #: values computed from constants alone -> their producing node
        self.derived: dict[int, int] = {}
        known = set(constants)
        for index, node in enumerate(plan.nodes):
            if ((node.inputs or self.fills_from_constants)
                    and all(t in known for t in node.inputs if t >= 0)):
                for t in node.outputs:
                    self.derived[t] = index
                    known.add(t)
        self.relabel: dict[tuple[int, int], Place] = {}

    def tie(self, index: int, a: tuple[int, int], b: tuple[int, int], own: set[int]) -> bool:
        pa, pb = self.seq.get(a), self.seq.get(b)
        for ref, place, other in ((b, pa, pb), (a, pb, pa)):
            if place is None or other is not None or ref[0] in own or self.size(ref) == 1:
                continue
            if ref[0] in self.inputs:
                self.seq[ref] = self.relabel[ref] = place
                return True
            if ref[0] in self.derived:
                # computed from constants alone: the order is carried back
                # to the constants it is computed from, whose relabelling
                # moves it, its producer checked again with them
                self.seq[ref] = place
                self.node(self.derived[ref[0]])
                return True
        return super().tie(index, a, b, own)


def reorder_single(plan: Plan, order: list[int],
                   carried: dict[str, dict[int, Place]] | None = None) -> Plan:
    """The single-device plan written in a load balancer's ``order`` of the
    positions: the same nodes, each checked to act on every position of a
    sequence dim alone or to sum over them all, and every causal
    ``attention`` and ``attention_grad`` over the whole sequence told the
    chunk order its rows and columns are laid out in (``chunk_order``).
    Anything else on a sequence dim is refused in one line (exit 2).
    ``carried``: the constants already laid out in the order
    (``seq_constants.order_sequence_constants``), by name, and their
    sequence dims (docs/soundness.md, "Plans traced from PyTorch", 127)."""
    chunks = chunk_order(order)
    seqlen = len(order)
    check = Reorder(plan, seqlen)
    produced = {t for node in plan.nodes for t in node.outputs}
    for t, x in enumerate(plan.tensors):
        dims = (carried or {}).get(plan.logical[x.tid].name)
        if dims and t not in produced:
            check.seq.update({(t, d): place for d, place in dims.items()})
    nodes = list(plan.nodes)
    for index, node in enumerate(plan.nodes):
        check.node(index)
        if node.op not in ORDERED:
            continue
        q, k = (node.inputs[0], node.inputs[1]) if node.op == "attention" else \
            (node.inputs[1], node.inputs[2])
        rows, cols = (q, len(plan.tensors[q].shape) - 2), (k, len(plan.tensors[k].shape) - 2)
        seq_rows, seq_cols = check.seq.get(rows), check.seq.get(cols)
        if seq_rows is None and seq_cols is None:
            continue
        if seq_rows != (1, 1) or seq_cols != (1, 1):
            check.refuse(index, "reads queries or keys that are not the whole sequence")
        if node.kwargs.get("row_chunk") or node.kwargs.get("col_chunk"):
            check.refuse(index, "places its rows at a chunk")
        if node.kwargs.get("causal"):
            nodes[index] = node._replace(kwargs={**node.kwargs, "order": list(chunks)})
    return replace(plan, nodes=nodes)


def reorder_loaded(single: dict, order: list[int]) -> dict:
    """The single-device run's batch laid out in ``order``: what the
    reordered step loads, to compare the ranks' loads with."""
    ids = {name: np.ascontiguousarray(v[:, order]) for name, v in single["batch_ids"].items()}
    return {**single, "batch_ids": ids}


def sequence_order_of(traces: list[dict]) -> list[int] | None:
    """The order of the positions every rank's batch was laid out in (a
    load balancer's), or None when the ranks cut the sequence as it is.
    Ranks that laid it out differently are refused in one line."""
    orders = {tuple(t.get("sequence_order") or ()) for t in traces}
    if len(orders) > 1:
        raise LoweringError("the ranks laid out the sequence in different orders")
    order = list(orders.pop()) if orders else []
    return order if order and order != sorted(order) else None
