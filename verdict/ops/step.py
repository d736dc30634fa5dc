"""Graph plumbing and training-step operators: fan-out (multiref), constant
tensors, and local gradient accumulation."""

from __future__ import annotations

from verdict.ops.rule import Op, expect


def _multiref_shape(in_shapes, times):
    expect(len(in_shapes) == 1 and times >= 2, "multiref takes one input and >= 2 copies")
    return [tuple(in_shapes[0])] * times


def _multiref_backward(xp, s, g, shapes, times):
    total = g[0]
    for grad in g[1:]:
        total = total + grad
    return (total,)


MULTIREF = Op(
    "multiref",
    shape=_multiref_shape,
    forward=lambda xp, x, times: tuple(xp.copy(x[0]) for _ in range(times)),
    backward=_multiref_backward,
    doc="one tensor read by several consumers; its backward sums their gradients",
)


def _const_shape(in_shapes, shape):
    expect(not in_shapes, "takes no input")
    return [tuple(shape)]


def _resize_const(kw, ins, outs):
    kw["shape"] = list(outs[0])
    return kw


ZEROS = Op(
    "zeros",
    resize=_resize_const,
    shape=_const_shape,
    forward=lambda xp, x, shape: (xp.zeros(tuple(shape)),),
    doc="a tensor of zeros (gradient buffer before the first accumulation)",
)

ONES = Op(
    "ones",
    resize=_resize_const,
    shape=_const_shape,
    forward=lambda xp, x, shape: (xp.ones(tuple(shape)),),
    doc="a tensor of ones (the gradient of the loss with respect to itself)",
)


def _accumulate_shape(in_shapes):
    expect(len(in_shapes) == 2 and tuple(in_shapes[0]) == tuple(in_shapes[1]),
           f"accumulate: buffer and gradient differ {in_shapes}")
    return [tuple(in_shapes[0])]


ACCUMULATE = Op(
    "local_grad_accumulation",
    shape=_accumulate_shape,
    forward=lambda xp, x: (x[0] + x[1],),
    doc="grad buffer (version v) + a microbatch's gradient -> version v+1",
)

DETACH = Op(
    "detach",
    shape=lambda in_shapes: [tuple(in_shapes[0])],
    forward=lambda xp, x: (xp.copy(x[0]),),
    doc="the same values, with no gradient flowing back (torch's detach)",
)

OPS = (MULTIREF, ZEROS, ONES, ACCUMULATE, DETACH)
