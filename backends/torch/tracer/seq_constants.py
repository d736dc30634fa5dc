"""The constants a single-device step reads along the sequence, laid out in
a load balancer's order (docs/soundness.md, "Plans traced from PyTorch",
127).

``seq_order.reorder_single`` writes the single-device step in the
balancer's order of the positions: the batch is laid out in that order and
every node is checked to act on each position alone or to sum over all of
them. A constant read along the sequence (a document mask: the keep flag
of an attention's scores, [S, S], both dims positions) is no input the
batch's order moves; left as it is, the reordered step would mask the
wrong pairs. So before the plans are built every constant of the
single-device trace that a node ties to a sequence dim is laid out in the
order too, along each dim so tied, with its producers' and readers'
relations checked like any node's (``SequenceConstants``). The ranks'
constants are then matched, by value, as blocks of the reordered ones;
a rank's mask whose rows or columns are at other positions is no block
of it (gloo computes other values there)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import Lowered
from backends.torch.tracer.seq_order import SEQWISE, CarriedConstants, Place


class SequenceConstants(CarriedConstants):
    """``Reorder``'s node-by-node check on a single-device trace, seeded at
    the batch's sequence dims; a recorded constant tied to a sequence dim
    is marked to be laid out in the order along it (``relabel``), and a
    value computed from constants alone (a mask broadcast to the scores)
    carries the sequence back to them, its producer checked again."""

    allowed = SEQWISE
    fills_from_constants = False  # as item 127 was written: a fill is no constant here

    def __init__(self, plan: SimpleNamespace, seqlen: int, seeds: list[int],
                 constants: set[int]):
        super().__init__(plan, seqlen, seeds, 1, constants)


def _view(low: Lowered) -> SimpleNamespace:
    """The trace as ``Reorder`` reads a plan: tensors with shapes, nodes
    with op, inputs, outputs, kwargs and name."""
    tensors = {v: SimpleNamespace(shape=tuple(s)) for v, s in low.shapes.items()}
    nodes = [SimpleNamespace(op=n.op, dir=n.dir, inputs=list(n.ins), outputs=list(n.outs),
                             kwargs=n.kwargs, name=n.name) for n in low.nodes]
    return SimpleNamespace(tensors=tensors, nodes=nodes)


def _digest_name(array: np.ndarray) -> str:
    """A constant's plan name: its shape and a digest of its float64 value
    (as ``lowering.constants`` names constants)."""
    array = np.ascontiguousarray(np.asarray(array, dtype=np.float64))
    digest = hashlib.sha1(repr(array.shape).encode() + array.tobytes()).hexdigest()[:16]
    return f"const.{'x'.join(map(str, array.shape)) or 'scalar'}.{digest}"


def order_sequence_constants(low: Lowered, order: list[int]) -> dict[str, dict[int, Place]]:
    """Lay out in ``order`` (a load balancer's order of the positions) every
    constant of the single-device trace ``low`` that a node ties to a
    sequence dim, along each such dim, renamed by its new value. Returns
    the renamed constants' sequence dims and places, which
    ``seq_order.reorder_single`` starts from. Refused in one line (exit 2)
    where a node does not commute with the order, or a step's result
    carries the sequence."""
    seqlen = len(order)
    seeds = [v for v, (kind, _) in low.inputs.items() if kind == "tokens"]
    for v in seeds:
        if len(low.shapes[v]) < 2 or low.shapes[v][1] != seqlen:
            raise LoweringError(f"the batch's {low.inputs[v][1]} is not [batch, {seqlen}, ...]: "
                                f"no sequence to reorder")
    check = SequenceConstants(_view(low), seqlen, seeds, set(low.constants))
    found = -1
    while found != len(check.seq):  # a value found to carry it late is checked again
        found = len(check.seq)
        for index in range(len(low.nodes)):
            check.node(index)
    moved: dict[int, dict[int, Place]] = {}
    for (v, d), place in check.relabel.items():
        moved.setdefault(v, {})[d] = place
    pi = np.asarray(order)
    carried: dict[str, dict[int, Place]] = {}
    for v, dims in moved.items():
        value = np.asarray(low.constants[v])
        for d, (o, i) in dims.items():
            shape = value.shape
            grid = value.reshape(*shape[:d], o, seqlen, i, *shape[d + 1:])
            value = np.take(grid, pi, axis=d + 1).reshape(shape)
        low.constants[v] = value
        kind, _ = low.inputs[v]
        name = _digest_name(value)
        low.inputs[v] = (kind, name)
        carried[name] = dims
    return carried
