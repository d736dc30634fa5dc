"""Operators that move or sum elements without arithmetic on their values:
transpose, unflatten/flatten, head repetition, sums and means."""

from __future__ import annotations

import math

import numpy as np

from verdict.ops.rule import Op, expect, norm_dim


def _transpose_shape(in_shapes, dim0, dim1):
    (x,) = in_shapes
    d0, d1 = norm_dim(dim0, len(x)), norm_dim(dim1, len(x))
    out = list(x)
    out[d0], out[d1] = out[d1], out[d0]
    return [tuple(out)]


TRANSPOSE = Op(
    "transpose",
    shape=_transpose_shape,
    forward=lambda xp, x, dim0, dim1: (np.swapaxes(x[0], dim0, dim1),),
    backward=lambda xp, s, g, shapes, dim0, dim1: (np.swapaxes(g[0], dim0, dim1),),
    doc="swap two dims",
)


def _unflatten_shape(in_shapes, dim, sizes):
    (x,) = in_shapes
    d = norm_dim(dim, len(x))
    expect(math.prod(sizes) == x[d], f"unflatten: {x}[{dim}] is not {tuple(sizes)}")
    return [tuple(x[:d]) + tuple(sizes) + tuple(x[d + 1 :])]


def _unflatten(x, dim, sizes):
    d = dim % x.ndim
    return x.reshape(x.shape[:d] + tuple(sizes) + x.shape[d + 1 :])


UNFLATTEN = Op(
    "unflatten",
    shape=_unflatten_shape,
    forward=lambda xp, x, dim, sizes: (_unflatten(x[0], dim, sizes),),
    backward=lambda xp, s, g, shapes, dim, sizes: (g[0].reshape(shapes[0]),),
    doc="split one dim into several (torch.Tensor.unflatten)",
)


def _flatten_shape(in_shapes, start, end):
    (x,) = in_shapes
    a, b = norm_dim(start, len(x)), norm_dim(end, len(x))
    expect(a <= b, f"flatten: start {start} after end {end}")
    return [tuple(x[:a]) + (math.prod(x[a : b + 1]),) + tuple(x[b + 1 :])]


FLATTEN = Op(
    "flatten",
    shape=_flatten_shape,
    forward=lambda xp, x, start, end: (
        x[0].reshape(_flatten_shape([x[0].shape], start, end)[0]),
    ),
    backward=lambda xp, s, g, shapes, start, end: (g[0].reshape(shapes[0]),),
    doc="merge dims start..end inclusive (torch.flatten)",
)


def _repeat_shape(in_shapes, repeats, dim):
    (x,) = in_shapes
    d = norm_dim(dim, len(x))
    return [tuple(x[:d]) + (x[d] * repeats,) + tuple(x[d + 1 :])]


def _repeat_backward(xp, s, g, shapes, repeats, dim):
    shape = shapes[0]
    d = dim % len(shape)
    split = g[0].reshape(tuple(shape[: d + 1]) + (repeats,) + tuple(shape[d + 1 :]))
    return (split.sum(axis=d + 1),)


REPEAT_INTERLEAVE = Op(
    "repeat_interleave",
    shape=_repeat_shape,
    forward=lambda xp, x, repeats, dim: (np.repeat(x[0], repeats, axis=dim),),
    backward=_repeat_backward,
    doc="repeat each entry along dim (grouped KV heads shared by query heads)",
)


def _dims(dim, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    return tuple(sorted(norm_dim(d, ndim) for d in dims))


def _reduce_shape(in_shapes, dim=None, keepdim=False):
    (x,) = in_shapes
    dims = _dims(dim, len(x))
    if keepdim:
        return [tuple(1 if i in dims else n for i, n in enumerate(x))]
    return [tuple(n for i, n in enumerate(x) if i not in dims)]


def _expand_back(g, shape, dim, keepdim):
    dims = _dims(dim, len(shape))
    if not keepdim:
        for d in dims:
            g = np.expand_dims(g, d)
    return np.broadcast_to(g, tuple(shape))


def _sum_forward(xp, x, dim=None, keepdim=False):
    return (xp.asarray(np.sum(x[0], axis=_dims(dim, x[0].ndim), keepdims=keepdim)),)


def _mean_forward(xp, x, dim=None, keepdim=False):
    dims = _dims(dim, x[0].ndim)
    count = math.prod(x[0].shape[d] for d in dims)
    return (xp.asarray(np.sum(x[0], axis=dims, keepdims=keepdim)) / count,)


def _mean_backward(xp, s, g, shapes, dim=None, keepdim=False):
    count = math.prod(shapes[0][d] for d in _dims(dim, len(shapes[0])))
    return (_expand_back(g[0], shapes[0], dim, keepdim) / count,)


SUM = Op(
    "sum",
    shape=_reduce_shape,
    forward=_sum_forward,
    backward=lambda xp, s, g, shapes, dim=None, keepdim=False: (
        xp.copy(_expand_back(g[0], shapes[0], dim, keepdim)),
    ),
    doc="sum over dims (all when dim is None)",
)

MEAN = Op(
    "mean",
    shape=_reduce_shape,
    forward=_mean_forward,
    backward=_mean_backward,
    doc="mean over dims",
)

OPS = (TRANSPOSE, UNFLATTEN, FLATTEN, REPEAT_INTERLEAVE, SUM, MEAN)
