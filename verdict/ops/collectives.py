"""Communication operators. A collective node runs on one rank; its inputs are
the tensors of every rank of its group, in group order, and ``index`` is the
position of its own rank in that group. Collectives have no backward rule:
a parallelizer emits the conjugate collective as the backward node."""

from __future__ import annotations

import numpy as np

from verdict.ops.layout import fold_max
from verdict.ops.rule import Op, expect, norm_dim


def _same_shapes(in_shapes) -> tuple[int, ...]:
    expect(len(in_shapes) >= 1, "collective without inputs")
    first = tuple(in_shapes[0])
    expect(all(tuple(s) == first for s in in_shapes), f"group shapes differ: {in_shapes}")
    return first


def _total(xs):
    """Elementwise sum; object arrays of any rank, 0-d included, stay arrays."""
    flat = [np.ravel(np.asarray(x, dtype=object if x.dtype == object else float)) for x in xs]
    out = flat[0].copy()
    for f in flat[1:]:
        out = out + f
    return out.reshape(np.shape(xs[0]))


def _chunk(x, n: int, dim: int, index: int):
    size = x.shape[dim] // n
    return np.take(x, range(index * size, (index + 1) * size), axis=dim)


def _all_reduce_shape(in_shapes, index):
    return [_same_shapes(in_shapes)]


ALL_REDUCE = Op(
    "all_reduce",
    shape=_all_reduce_shape,
    forward=lambda xp, x, index: (_total(x),),
    group=True,
    doc="sum of the group's tensors",
)

ALL_REDUCE_AVG = Op(
    "all_reduce_avg",
    shape=_all_reduce_shape,
    forward=lambda xp, x, index: (_total(x) / len(x),),
    group=True,
    doc="mean of the group's tensors: their sum divided by the group's size (ReduceOp.AVG)",
)

REDUCER = Op(
    "reducer",
    shape=_all_reduce_shape,
    forward=lambda xp, x, index: (_total(x),),
    group=True,
    doc="cross-replica gradient reduction: an all-reduce of gradient buffers",
)


def _maximum(xp, xs):
    return fold_max(xp, [np.asarray(x, dtype=x.dtype) for x in xs])


ALL_REDUCE_MAX = Op(
    "all_reduce_max",
    shape=_all_reduce_shape,
    forward=lambda xp, x, index: (xp.asarray(_maximum(xp, x)),),
    group=True,
    doc="elementwise maximum of the group's tensors",
)


def _gather_shape(in_shapes, index, dim):
    s = list(_same_shapes(in_shapes))
    d = norm_dim(dim, len(s))
    s[d] *= len(in_shapes)
    return [tuple(s)]


ALL_GATHER = Op(
    "all_gather",
    shape=_gather_shape,
    forward=lambda xp, x, index, dim: (np.concatenate(x, axis=dim),),
    group=True,
    doc="the group's tensors concatenated along dim",
)


def _scatter_shape(in_shapes, index, dim):
    s = list(_same_shapes(in_shapes))
    d = norm_dim(dim, len(s))
    expect(s[d] % len(in_shapes) == 0, f"dim {d} of {tuple(s)} does not split {len(in_shapes)} ways")
    s[d] //= len(in_shapes)
    return [tuple(s)]


REDUCE_SCATTER = Op(
    "reduce_scatter",
    shape=_scatter_shape,
    forward=lambda xp, x, index, dim: (_chunk(_total(x), len(x), dim, index),),
    group=True,
    doc="this rank's chunk along dim of the group's sum",
)


REDUCE_SCATTER_AVG = Op(
    "reduce_scatter_avg",
    shape=_scatter_shape,
    forward=lambda xp, x, index, dim: (_chunk(_total(x), len(x), dim, index) / len(x),),
    group=True,
    doc="this rank's chunk along dim of the group's mean (ReduceOp.AVG)",
)


def _a2a_shape(in_shapes, index, split_dim, concat_dim):
    n = len(in_shapes)
    s = list(_same_shapes(in_shapes))
    a, c = norm_dim(split_dim, len(s)), norm_dim(concat_dim, len(s))
    expect(a != c, "all_to_all: split and concat dims are the same")
    expect(s[a] % n == 0, f"all_to_all: dim {a} of {tuple(s)} does not split {n} ways")
    s[a] //= n
    s[c] *= n
    return [tuple(s)]


ALL_TO_ALL = Op(
    "all_to_all",
    shape=_a2a_shape,
    forward=lambda xp, x, index, split_dim, concat_dim: (
        np.concatenate([_chunk(t, len(x), split_dim, index) for t in x], axis=concat_dim),
    ),
    group=True,
    doc="chunk 'index' along split_dim of every rank's tensor, concatenated along concat_dim",
)


def _split_shape(in_shapes, dim, parts, index):
    expect(len(in_shapes) == 1, "split takes one input")
    s = list(in_shapes[0])
    d = norm_dim(dim, len(s))
    expect(0 <= index < parts and s[d] % parts == 0, f"dim {d} of {tuple(s)} does not split {parts} ways")
    s[d] //= parts
    return [tuple(s)]


def _split_dims(ins, outs, dim, parts, index):
    """Other dims tie input and output; the split dim is ``parts`` times the piece."""
    x, out = ins[0], outs[0]
    shape = x if x is not None else out
    if shape is None:
        return []
    d = dim % len(shape)
    if x is None or out is None:
        return []
    rel = [("eq", ("i", 0, k), ("o", 0, k)) for k in range(len(shape)) if k != d]
    return rel + [("mul", ("i", 0, d), [("o", 0, d)], parts)]


SPLIT = Op(
    "split",
    dims=_split_dims,
    shape=_split_shape,
    forward=lambda xp, x, dim, parts, index: (xp.copy(_chunk(x[0], parts, dim, index)),),
    doc="local chunk 'index' of 'parts' along dim (no communication)",
)


def _move_shape(in_shapes, src, dst):
    expect(len(in_shapes) == 1, "send_recv moves one tensor")
    return [tuple(in_shapes[0])]


SEND_RECV = Op(
    "send_recv",
    shape=_move_shape,
    forward=lambda xp, x, src, dst: (xp.copy(x[0]),),
    group=True,
    doc="a tensor sent by rank src and received by rank dst (the node runs on dst)",
)


def _broadcast_shape(in_shapes, src):
    expect(len(in_shapes) == 1, "broadcast reads the source rank's tensor")
    return [tuple(in_shapes[0])]


BROADCAST = Op(
    "broadcast",
    shape=_broadcast_shape,
    forward=lambda xp, x, src: (xp.copy(x[0]),),
    group=True,
    doc="the source rank's tensor, received by every rank of the group",
)

OPS = (ALL_REDUCE, ALL_REDUCE_AVG, ALL_REDUCE_MAX, REDUCER, ALL_GATHER, REDUCE_SCATTER,
       REDUCE_SCATTER_AVG, ALL_TO_ALL, SPLIT, SEND_RECV, BROADCAST)
