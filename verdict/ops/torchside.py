"""Operators that PyTorch's own kernels need and the model leaves do not:
broadcasting a tensor to a larger shape (``aten.expand``), the activations
of ``torch.nn`` (GELU, tanh, sigmoid, ReLU), concatenation and uneven
pieces (``aten.cat``, ``aten.split_with_sizes``), bounding values
(``aten.clamp``, as gradient clipping bounds its coefficient)."""

from __future__ import annotations

import math

import numpy as np

from verdict.ops.rule import Op, expect, norm_dim


def _expand_shape(in_shapes, shape):
    (x,) = in_shapes
    out = tuple(shape)
    expect(len(out) >= len(x), f"expand: cannot expand rank {len(x)} to rank {len(out)}")
    for k in range(1, len(x) + 1):
        expect(x[-k] == out[-k] or x[-k] == 1,
               f"expand: dim {len(x) - k} of size {x[-k]} cannot become {out[-k]}")
    return [out]


def _expand_backward(xp, s, g, shapes, shape):
    x = tuple(shapes[0])
    grad = g[0]
    lead = len(grad.shape) - len(x)
    if lead:
        grad = np.sum(grad, axis=tuple(range(lead)))
    dims = tuple(k for k, n in enumerate(x) if n == 1 and grad.shape[k] != 1)
    if dims:
        grad = np.sum(grad, axis=dims, keepdims=True)
    return (xp.asarray(grad),)


EXPAND = Op(
    "expand",
    shape=_expand_shape,
    forward=lambda xp, x, shape: (xp.copy(np.broadcast_to(x[0], tuple(shape))),),
    backward=_expand_backward,
    resize=lambda kw, ins, outs: {**kw, "shape": list(outs[0])} if outs[0] is not None else kw,
    doc="broadcast to shape (new leading dims, size-1 dims repeated)",
)



# -- activations of torch.nn (non-linear functions uninterpreted by Z3) --------

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715
SQRT_1_2 = math.sqrt(0.5)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _unary_shape(in_shapes, **_kw):
    expect(len(in_shapes) == 1, "expects one input")
    return [tuple(in_shapes[0])]


def _gelu_forward(xp, x, approximate="none"):
    v = x[0]
    if approximate == "tanh":
        t = xp.tanh(SQRT_2_OVER_PI * (v + GELU_TANH_CUBIC * v * v * v))
        return (0.5 * v * (1.0 + t),)
    return (0.5 * v * (1.0 + xp.erf(v * SQRT_1_2)),)


def _gelu_backward(xp, s, g, shapes, approximate="none"):
    v = s[0]
    if approximate == "tanh":
        t = xp.tanh(SQRT_2_OVER_PI * (v + GELU_TANH_CUBIC * v * v * v))
        inner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * v * v)
        return (g[0] * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * inner),)
    cdf = 0.5 * (1.0 + xp.erf(v * SQRT_1_2))
    pdf = xp.exp(-0.5 * v * v) * INV_SQRT_2PI
    return (g[0] * (cdf + v * pdf),)


def _check_approximate(in_shapes, approximate="none"):
    expect(approximate in ("none", "tanh"), f"gelu: approximate must be 'none' or 'tanh', "
                                            f"not {approximate!r}")
    return _unary_shape(in_shapes)


GELU = Op(
    "gelu",
    shape=_check_approximate,
    forward=_gelu_forward,
    backward=_gelu_backward,
    saves=(0,),
    doc="x * Phi(x) with erf (approximate='none') or torch's tanh form "
        "(approximate='tanh'); erf and tanh are uninterpreted in the symbolic backend",
)


def _tanh_backward(xp, s, g, shapes):
    t = xp.tanh(s[0])
    return (g[0] * (1.0 - t * t),)


TANH = Op(
    "tanh",
    shape=_unary_shape,
    forward=lambda xp, x: (xp.tanh(x[0]),),
    backward=_tanh_backward,
    saves=(0,),
    doc="hyperbolic tangent; uninterpreted in the symbolic backend",
)


def _sigmoid_backward(xp, s, g, shapes):
    y = xp.sigmoid(s[0])
    return (g[0] * y * (1.0 - y),)


SIGMOID = Op(
    "sigmoid",
    shape=_unary_shape,
    forward=lambda xp, x: (xp.sigmoid(x[0]),),
    backward=_sigmoid_backward,
    saves=(0,),
    doc="1 / (1 + exp(-x)); uninterpreted in the symbolic backend",
)

RELU = Op(
    "relu",
    shape=_unary_shape,
    forward=lambda xp, x: (x[0] * xp.step(x[0]),),
    backward=lambda xp, s, g, shapes: (g[0] * xp.step(s[0]),),
    saves=(0,),
    doc="max(x, 0) written x * step(x), step (1 where x > 0) uninterpreted in the "
        "symbolic backend",
)


# -- concatenation and uneven pieces --------------------------------------------

def _cat_shape(in_shapes, dim):
    expect(len(in_shapes) >= 1, "cat: expects at least one input")
    first = tuple(in_shapes[0])
    d = norm_dim(dim, len(first))
    for s in in_shapes[1:]:
        expect(len(s) == len(first) and all(a == b for k, (a, b) in enumerate(zip(s, first))
                                             if k != d),
               f"cat: {tuple(s)} does not fit {first} along dim {d}")
    out = list(first)
    out[d] = sum(s[d] for s in in_shapes)
    return [tuple(out)]


def _cat_backward(xp, s, g, shapes, dim):
    d = dim % g[0].ndim
    grads, at = [], 0
    for shape in shapes:
        n = shape[d]
        grads.append(xp.copy(np.take(g[0], range(at, at + n), axis=d)))
        at += n
    return tuple(grads)


def _cat_dims(ins, outs, dim):
    """Dims other than ``dim`` tie inputs and output. Along ``dim``, equal
    pieces tie each other and the output is their count times one; uneven
    pieces are kept at full size (no reduction can keep their boundaries)."""
    known = [(("i", i, None), s) for i, s in enumerate(ins) if s is not None]
    if outs[0] is not None:
        known.append((("o", 0, None), outs[0]))
    if not known:
        return []
    nd = len(known[0][1])
    d = dim % nd
    rel = []
    (side0, pos0, _), _ = known[0]
    for (side, pos, _), _ in known[1:]:
        rel += [("eq", (side0, pos0, k), (side, pos, k)) for k in range(nd) if k != d]
    if all(s is not None for s in ins) and len({s[d] for s in ins}) == 1:
        rel += [("eq", ("i", 0, d), ("i", i, d)) for i in range(1, len(ins))]
        if outs[0] is not None:
            rel.append(("mul", ("o", 0, d), [("i", 0, d)], len(ins)))
        return rel
    return rel + [("min", (side, pos, d), shape[d]) for (side, pos, _), shape in known]


CAT = Op(
    "cat",
    dims=_cat_dims,
    shape=_cat_shape,
    forward=lambda xp, x, dim: (np.concatenate(list(x), axis=dim),),
    backward=_cat_backward,
    doc="concatenate the inputs along dim (torch.cat)",
)


def _narrow_shape(in_shapes, dim, start, length):
    expect(len(in_shapes) == 1, "narrow: expects one input")
    s = list(in_shapes[0])
    d = norm_dim(dim, len(s))
    expect(start >= 0 and length >= 0 and start + length <= s[d],
           f"narrow: [{start}, {start + length}) is outside dim {d} of {tuple(s)}")
    s[d] = length
    return [tuple(s)]


def _narrow_backward(xp, s, g, shapes, dim, start, length):
    shape = tuple(shapes[0])
    d = dim % len(shape)
    out = xp.zeros(shape)
    index = [slice(None)] * len(shape)
    index[d] = slice(start, start + length)
    out[tuple(index)] = g[0]
    return (out,)


def _narrow_dims(ins, outs, dim, start, length):
    """Other dims tie input and output; ``dim`` keeps its full size on both
    sides (the piece's boundaries are fixed numbers)."""
    x, out = ins[0], outs[0]
    shape = x if x is not None else out
    if shape is None:
        return []
    d = dim % len(shape)
    rel = []
    if x is not None and out is not None:
        rel += [("eq", ("i", 0, k), ("o", 0, k)) for k in range(len(shape)) if k != d]
    if x is not None:
        rel.append(("min", ("i", 0, d), x[d]))
    if out is not None:
        rel.append(("min", ("o", 0, d), out[d]))
    return rel


NARROW = Op(
    "narrow",
    dims=_narrow_dims,
    shape=_narrow_shape,
    forward=lambda xp, x, dim, start, length: (
        xp.copy(np.take(x[0], range(start, start + length), axis=dim)),),
    backward=_narrow_backward,
    doc="elements [start, start + length) of dim (an uneven piece of torch.split)",
)

def _clamp_forward(xp, x, min=None, max=None):  # noqa: A002 (torch's names)
    out = x[0]
    if min is not None:
        out = xp.maximum(out, np.full(np.shape(out), float(min)))
    if max is not None:
        out = -xp.maximum(-out, np.full(np.shape(out), -float(max)))
    return (out,)


def _clamp_shape(in_shapes, min=None, max=None):  # noqa: A002
    expect(len(in_shapes) == 1, "clamp takes one input")
    return [tuple(in_shapes[0])]


CLAMP = Op(
    "clamp",
    shape=_clamp_shape,
    forward=_clamp_forward,
    doc="x bounded below by min and above by max (either may be None), elementwise; "
        "exact (if-terms) in the symbolic backend",
)

OPS = (EXPAND, GELU, TANH, SIGMOID, RELU, CAT, NARROW, CLAMP)
