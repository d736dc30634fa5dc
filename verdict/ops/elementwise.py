"""Elementwise operators: arithmetic with tensors or constants, activations."""

from __future__ import annotations

import numpy as np

from verdict.ops.rule import Op, Shape, aligned_dims, broadcast_shape, expect


def unbroadcast(g, shape: Shape):
    """Sum a broadcast gradient back down to ``shape`` (None: not wanted)."""
    if shape is None:
        return None
    shape = tuple(shape)
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and g.shape[axis] != 1:
            g = g.sum(axis=axis, keepdims=True)
    return g


def _unary(in_shapes, **_kw) -> list[Shape]:
    expect(len(in_shapes) == 1, "expects one input")
    return [tuple(in_shapes[0])]


def _binary(in_shapes, **_kw) -> list[Shape]:
    expect(len(in_shapes) == 2, "expects two inputs")
    return [broadcast_shape(in_shapes[0], in_shapes[1])]


ADD = Op(
    "add",
    shape=_binary,
    forward=lambda xp, x: (x[0] + x[1],),
    backward=lambda xp, s, g, shapes: (unbroadcast(g[0], shapes[0]), unbroadcast(g[0], shapes[1])),
    doc="a + b, with broadcasting",
)

MUL = Op(
    "mul",
    shape=_binary,
    forward=lambda xp, x: (x[0] * x[1],),
    backward=lambda xp, s, g, shapes: (
        unbroadcast(g[0] * s[1], shapes[0]),
        unbroadcast(g[0] * s[0], shapes[1]),
    ),
    saves=(0, 1),
    doc="a * b, with broadcasting",
)

SUB = Op(
    "sub",
    shape=_binary,
    forward=lambda xp, x: (x[0] - x[1],),
    backward=lambda xp, s, g, shapes: (unbroadcast(g[0], shapes[0]), unbroadcast(-g[0], shapes[1])),
    doc="a - b, with broadcasting",
)

ADD_SCALAR = Op(
    "add_scalar",
    shape=_unary,
    forward=lambda xp, x, value: (x[0] + value,),
    backward=lambda xp, s, g, shapes, value: (g[0],),
    doc="x + value (value a Python number)",
)

MUL_SCALAR = Op(
    "mul_scalar",
    shape=_unary,
    forward=lambda xp, x, value: (x[0] * value,),
    backward=lambda xp, s, g, shapes, value: (g[0] * value,),
    doc="x * value",
)

DIV_SCALAR = Op(
    "div",
    shape=_unary,
    forward=lambda xp, x, value: (x[0] / value,),
    backward=lambda xp, s, g, shapes, value: (g[0] / value,),
    doc="x / value (value a Python number)",
)

POW = Op(
    "pow",
    shape=_unary,
    forward=lambda xp, x, exponent: (xp.power(x[0], exponent),),
    backward=lambda xp, s, g, shapes, exponent: (
        g[0] * exponent * xp.power(s[0], exponent - 1),
    ),
    saves=(0,),
    doc="x ** exponent (exponent a Python number)",
)


def _rsqrt_backward(xp, s, g, shapes):
    r = xp.rsqrt(s[0])
    return (g[0] * (-0.5) * r * r * r,)


RSQRT = Op(
    "rsqrt",
    shape=_unary,
    forward=lambda xp, x: (xp.rsqrt(x[0]),),
    backward=_rsqrt_backward,
    saves=(0,),
    doc="1 / sqrt(x); uninterpreted in the symbolic backend",
)


EXP = Op(
    "exp",
    shape=_unary,
    forward=lambda xp, x: (xp.exp(x[0]),),
    backward=lambda xp, s, g, shapes: (g[0] * xp.exp(s[0]),),
    saves=(0,),
    doc="e ** x; uninterpreted in the symbolic backend",
)

LOG = Op(
    "log",
    shape=_unary,
    forward=lambda xp, x: (xp.log(x[0]),),
    backward=lambda xp, s, g, shapes: (g[0] / s[0],),
    saves=(0,),
    doc="natural logarithm; uninterpreted in the symbolic backend",
)


def _silu_backward(xp, s, g, shapes):
    sig = xp.sigmoid(s[0])
    return (g[0] * (sig * (1.0 + s[0] * (1.0 - sig))),)


SILU = Op(
    "silu",
    shape=_unary,
    forward=lambda xp, x: (x[0] * xp.sigmoid(x[0]),),
    backward=_silu_backward,
    saves=(0,),
    doc="x * sigmoid(x); sigmoid is uninterpreted in the symbolic backend",
)


def _softmax_forward(xp, x, dim):
    return (xp.softmax(x[0], dim),)


def _softmax_backward(xp, s, g, shapes, dim):
    y = xp.softmax(s[0], dim)
    return (y * (g[0] - np.sum(g[0] * y, axis=dim, keepdims=True)),)


def _softmax_dims(ins, outs, dim):
    rel = aligned_dims(ins, outs)
    shape = ins[0] if ins[0] is not None else outs[0]
    if ins[0] is not None:
        rel.append(("min", ("i", 0, dim % len(shape)), 2))
    return rel


SOFTMAX = Op(
    "softmax",
    dims=_softmax_dims,
    shape=_unary,
    forward=_softmax_forward,
    backward=_softmax_backward,
    saves=(0,),
    doc="exp(x) / sum(exp(x)) along dim; entries at -inf give exactly 0",
)

OPS = (ADD, SUB, MUL, ADD_SCALAR, MUL_SCALAR, DIV_SCALAR, POW, RSQRT, EXP, LOG, SILU, SOFTMAX)
