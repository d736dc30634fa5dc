"""Operators that PyTorch's own kernels need and the model leaves do not:
broadcasting a tensor to a larger shape (``aten.expand``), bounding values
(``aten.clamp``, as gradient clipping bounds its coefficient)."""

from __future__ import annotations

import numpy as np

from verdict.ops.rule import Op, expect


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

OPS = (EXPAND, CLAMP)
