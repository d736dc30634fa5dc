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


def _transpose_dims(ins, outs, dim0, dim1):
    x, out = ins[0], outs[0]
    if x is None or out is None:
        return []
    nd = len(x)
    perm = list(range(nd))
    a, b = dim0 % nd, dim1 % nd
    perm[a], perm[b] = perm[b], perm[a]
    return [("eq", ("o", 0, k), ("i", 0, perm[k])) for k in range(nd)]


TRANSPOSE = Op(
    "transpose",
    dims=_transpose_dims,
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


def _unflatten_dims(ins, outs, dim, sizes):
    x, out = ins[0], outs[0]
    if x is None or out is None:
        return []
    d, k = dim % len(x), len(sizes)
    rel = [("eq", ("i", 0, j), ("o", 0, j)) for j in range(d)]
    rel += [("eq", ("i", 0, j), ("o", 0, j + k - 1)) for j in range(d + 1, len(x))]
    rel.append(("mul", ("i", 0, d), [("o", 0, d + j) for j in range(k)], 1))
    return rel


def _resize_unflatten(kw, ins, outs):
    out = outs[0]
    d = kw["dim"] % (len(out) - len(kw["sizes"]) + 1)
    kw["sizes"] = list(out[d : d + len(kw["sizes"])])
    return kw


UNFLATTEN = Op(
    "unflatten",
    dims=_unflatten_dims,
    resize=_resize_unflatten,
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


def _flatten_dims(ins, outs, start, end):
    x, out = ins[0], outs[0]
    if x is None or out is None:
        return []
    a, b = start % len(x), end % len(x)
    rel = [("eq", ("i", 0, j), ("o", 0, j)) for j in range(a)]
    rel += [("eq", ("i", 0, j), ("o", 0, j - (b - a))) for j in range(b + 1, len(x))]
    rel.append(("mul", ("o", 0, a), [("i", 0, j) for j in range(a, b + 1)], 1))
    return rel


FLATTEN = Op(
    "flatten",
    dims=_flatten_dims,
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


def _repeat_dims(ins, outs, repeats, dim):
    x, out = ins[0], outs[0]
    if x is None or out is None:
        return []
    d = dim % len(x)
    rel = [("eq", ("i", 0, j), ("o", 0, j)) for j in range(len(x)) if j != d]
    rel.append(("mul", ("o", 0, d), [("i", 0, d)], repeats))
    return rel


REPEAT_INTERLEAVE = Op(
    "repeat_interleave",
    dims=_repeat_dims,
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


def _reduce_dims(ins, outs, dim=None, keepdim=False):
    x, out = ins[0], outs[0]
    if x is None:
        return []
    dims = _dims(dim, len(x))
    rel = [("min", ("i", 0, d), 2) for d in dims]
    if out is None:
        return rel
    kept = [j for j in range(len(x)) if keepdim or j not in dims]
    for k, j in enumerate(kept):
        if j not in dims:
            rel.append(("eq", ("i", 0, j), ("o", 0, k)))
    return rel


SUM = Op(
    "sum",
    dims=_reduce_dims,
    shape=_reduce_shape,
    forward=_sum_forward,
    backward=lambda xp, s, g, shapes, dim=None, keepdim=False: (
        xp.copy(_expand_back(g[0], shapes[0], dim, keepdim)),
    ),
    doc="sum over dims (all when dim is None)",
)

MEAN = Op(
    "mean",
    dims=_reduce_dims,
    shape=_reduce_shape,
    forward=_mean_forward,
    backward=_mean_backward,
    doc="mean over dims",
)



def fold_max(xp, xs):
    """Elementwise maximum of a non-empty sequence of arrays, left to right."""
    out = xs[0]
    for x in xs[1:]:
        out = xp.maximum(out, x)
    return out


def _max_forward(xp, x, dim=None, keepdim=False):
    dims = _dims(dim, x[0].ndim)
    out = np.asarray(x[0], dtype=x[0].dtype)
    for d in reversed(dims):
        out = fold_max(xp, [np.take(out, [i], axis=d) for i in range(out.shape[d])])
    if not keepdim:
        out = out.reshape(tuple(n for i, n in enumerate(out.shape) if i not in dims))
    return (xp.asarray(out),)


def _max_backward(xp, s, g, shapes, dim=None, keepdim=False):
    """Ties share the gradient evenly, as torch.amax's backward does."""
    (top,) = _max_forward(xp, (s[0],), dim, keepdim=True)
    hit = xp.equal(s[0], np.broadcast_to(top, s[0].shape))
    count = np.broadcast_to(np.sum(hit, axis=_dims(dim, s[0].ndim), keepdims=True), hit.shape)
    return (_expand_back(g[0], shapes[0], dim, keepdim) * hit / count,)


MAX = Op(
    "max",
    dims=_reduce_dims,
    shape=_reduce_shape,
    forward=_max_forward,
    backward=_max_backward,
    saves=(0,),
    doc="maximum over dims (torch.amax); ties share the gradient evenly",
)

OPS = (TRANSPOSE, UNFLATTEN, FLATTEN, REPEAT_INTERLEAVE, SUM, MEAN, MAX)
