"""An experts loop on the (token, slot) rows an expert-parallel dispatch
received, and the combine of their results back per token
(docs/soundness.md, "Plans traced from PyTorch", 54); the pending
values and the sums they meet are in ``pair_rows``.

- rows of rows of the C-fold copy of x (``recv[token_idx]``, the dispatch's
  ``x[order // C]`` moved by an all-to-all) whose tokens are distinct: the
  rows of x at those tokens (row ``p`` of the copy is row ``p // C`` of x);
- a product with a constant all of whose entries are 1, of the other
  operand's shape: the other operand;
- rows added into zeros at other rows than they were gathered from
  (``index_add_``, an accumulating ``index_put``): ``Assembled``; two such
  values at disjoint rows, added: their union; put at a permutation of the
  rows (``out[perm] = rows``): the rows permuted; seen as ``[T, K, ...]``:
  the picks reshaped;
- ``Assembled * w`` with w ``[T, K, 1...]`` (a lowered value, or rows of
  one at a recorded index, materialized once: the backward reads the same
  value), then summed over the slots:
  ``pair_rows.combine``; ``Assembled * g`` expanded over the slots, summed
  over the last dim: ``pair_rows.gate_grad``; added back into zeros at
  the pairs' tokens: ``pair_rows.gathered_back``;
- ``g`` expanded over the slots times a combine's weights w: ``Pairs``,
  viewed, permuted and moved like rows; the rows of one expert picked
  from them: ``pair_rows.expert_rows``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.lowering.constants import constant_value
from backends.torch.lowering.grouped_rows import producer
from backends.torch.lowering.ir import Const, NewZeros, Pending, Zeros
from backends.torch.lowering.pair_rows import (
    Assembled,
    Dotted,
    Pairs,
    Viewed,
    Weighted,
    add_assembled,
    combine,
    expert_rows,
    gate_grad,
    gathered_back,
    written,
)
from backends.torch.lowering.registry import refines
from backends.torch.lowering.routed_rows import Rows, index_of, value_of

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]

_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


def _copy_of(lw: Lowerer, base: int) -> tuple[int, int] | None:
    """(x, C) when ``base`` is the C-fold copy of x made by ``grouped_rows``."""
    for (x, c), made in lw.grouped_copies.items():
        if made == base:
            return x, c
    return None


def _one_index(lw: Lowerer, args: Any) -> np.ndarray | None:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
    if len(indices) != 1 or indices[0] is None:
        return None
    at = index_of(lw, indices[0])
    return at if at is not None and at.ndim == 1 else None


def _token_rows(lw: Lowerer, x: Rows, at: np.ndarray) -> Rows | None:
    """Rows ``at`` of rows of a C-fold copy, as rows of the copied value
    when their tokens are distinct."""
    found = _copy_of(lw, x.base)
    if found is None:
        return None
    n = len(x.index)
    at = np.where(at < 0, at + n, at)
    if len(at) and (at.min() < 0 or at.max() >= n):
        return None
    src, c = found
    tokens = x.index[at] // c
    if len(np.unique(tokens)) != len(tokens):
        return None
    return Rows(src, tokens)


@refines("aten.index.Tensor")
def index(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        if isinstance(x, (Rows, Pairs, Assembled)):
            at = _one_index(lw, args)
            if at is not None:
                if isinstance(x, Rows):
                    rows = _token_rows(lw, x, at)
                    if rows is not None:
                        return rows
                elif isinstance(x, Pairs) and x.pair.ndim == 1:
                    return Pairs(x.g, x.w, x.k, x.pair[at])
                elif x.group.ndim == 1:
                    return Assembled(x.values, x.group[at], x.index[at])
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.index_select.default")
def index_select(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        at = index_of(lw, args[2]) if int(args[1]) == 0 else None
        if at is not None and at.ndim == 1:
            if isinstance(x, Pairs) and x.pair.ndim == 1:
                return expert_rows(lw, x, at)
            if isinstance(x, Rows):
                rows = _token_rows(lw, x, at)
                if rows is not None:
                    return rows
        return base(lw, args, kwargs, shapes, group)
    return lower


def _all_ones(lw: Lowerer, a: Any) -> bool:
    if not isinstance(value_of(lw, a), Const):
        return False
    value = constant_value(lw, a)
    return value is not None and value.size > 0 and bool(np.all(value == 1))


def _spread_of(lw: Lowerer, a: Any, k: int) -> int | None:
    """g (lowered, ``[T, ...]``) when the recorded ``a`` is
    ``g.unsqueeze(1).expand(T, k, ...)``; g pending (a rank's chunk of the
    rows, ``ir.Piece``) is materialized, its own value."""
    ev = producer(lw, a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 else None
    if ev is None or ev[0] != "aten.expand.default":
        return None
    inner = ev[1][0][0]
    ev2 = producer(lw, inner[1])
    if ev2 is None or ev2[0] != "aten.unsqueeze.default" or int(ev2[1][0][1]) != 1:
        return None
    src = ev2[1][0][0]
    shape = tuple(lw.trace["shapes"][a[1]])
    if len(shape) < 2 or shape[1] != k or not isinstance(value_of(lw, src), (int, Pending)):
        return None
    return lw.val(src)


@refines("aten.mul.Tensor")
def mul(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if len(args) == 2 and all(isinstance(a, (list, tuple)) for a in args):
            out = tuple(shapes[0])
            for one, other in ((args[0], args[1]), (args[1], args[0])):
                if _all_ones(lw, one) and tuple(lw.trace["shapes"][other[1]]) == out:
                    return lw.env[other[1]]  # x * 1 = x
            for a, b in ((args[0], args[1]), (args[1], args[0])):
                x = value_of(lw, a)
                if isinstance(x, Assembled) and x.group.ndim == 2:
                    t, k = x.group.shape
                    shape_b = tuple(lw.trace["shapes"][b[1]])
                    if len(shape_b) == len(out) and shape_b[:2] == (t, k) \
                            and all(n == 1 for n in shape_b[2:]) \
                            and isinstance(value_of(lw, b), (int, Rows)):
                        w = lw.val(b)
                        lw.env[b[1]] = w  # gates at other rows, read once: the backward reads w
                        lw.pair_weights.add(w)
                        return Weighted(x, w)
                    g = _spread_of(lw, b, k)
                    if g is not None and lw.shapes[g][0] == t:
                        return Dotted(x, g)
            for a, b in ((args[0], args[1]), (args[1], args[0])):
                w = value_of(lw, b)
                if isinstance(w, int) and w in lw.pair_weights and len(out) >= 2:
                    t, k = out[0], out[1]
                    g = _spread_of(lw, a, k)
                    if g is not None and lw.shapes[g][0] == t:
                        return Pairs(g, w, k, np.arange(t * k).reshape(t, k))
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.sum.dim_IntList")
def sum_(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        if isinstance(x, (Weighted, Dotted)):
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            dims = [int(d) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            keep = bool(args[2]) if len(args) > 2 else bool(kwargs.get("keepdim", False))
            nd = len(lw.trace["shapes"][args[0][1]])
            dims = [d % nd for d in dims]
            if isinstance(x, Weighted) and dims == [1] and not keep:
                return combine(lw, x, tuple(shapes[0]))
            if isinstance(x, Dotted) and dims == [nd - 1] and nd == 3 and keep:
                return gate_grad(lw, x, tuple(shapes[0]))
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.squeeze.dim", "aten.squeeze.dims", "aten.unsqueeze.default", "aten._to_copy.default")
def seen_again(base: Handler) -> Handler:
    """A value not yet seen with its shape (``Viewed``), seen with another:
    still pending; with its own: itself. ``_to_copy`` between floating
    types is the identity."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        if isinstance(x, Viewed) and len(shapes) == 1:
            dtype = str((kwargs or {}).get("dtype", "torch.float"))
            if "float" not in dtype and "double" not in dtype:
                return base(lw, args, kwargs, shapes, group)
            out = tuple(shapes[0])
            return x.v if out == tuple(lw.shapes[x.v]) else Viewed(x.v, out)
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines(*_VIEWS)
def view(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        out = tuple(shapes[0])
        if isinstance(x, Viewed):
            return x.v if out == tuple(lw.shapes[x.v]) else Viewed(x.v, out)
        if isinstance(x, Assembled):
            inner = tuple(lw.shapes[x.values[0]][1:])
            for lead in (1, 2):
                if len(out) == lead + len(inner) and out[lead:] == inner \
                        and int(np.prod(out[:lead])) == x.group.size:
                    return Assembled(x.values, x.group.reshape(out[:lead]),
                                     x.index.reshape(out[:lead]))
        if isinstance(x, Pairs):
            inner = tuple(lw.shapes[x.g][1:])
            for lead in (1, 2):
                if len(out) == lead + len(inner) and out[lead:] == inner \
                        and int(np.prod(out[:lead])) == x.pair.size:
                    return Pairs(x.g, x.w, x.k, x.pair.reshape(out[:lead]))
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.add.Tensor")
def add(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = (value_of(lw, x) for x in args[:2])
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        if isinstance(a, Assembled) and isinstance(b, Assembled) and alpha == 1:
            return add_assembled(lw, a, b)
        return base(lw, args, kwargs, shapes, group)
    return lower


def _into_pairs(lw: Lowerer, dest: Any, at: np.ndarray, src: Rows, rows: int) -> Assembled | None:
    """Rows added into zeros (or into such rows) where the token-space rule
    does not apply: at other rows than they were gathered from, or into a
    value of another number of rows."""
    if not isinstance(dest, (Zeros, NewZeros, Assembled)):
        return None
    same = lw.shapes[src.base][0] == rows and np.array_equal(np.where(at < 0, at + rows, at),
                                                             src.index)
    if same and not isinstance(dest, Assembled):
        return None
    flat = np.where(at < 0, at + rows, at)
    if flat.ndim != 1 or len(np.unique(flat)) != len(flat):
        return None  # rows summed at one row (a repeating gather's backward): not pair rows
    return written(lw, dest if isinstance(dest, Assembled) else None, at, src, rows)


@refines("aten.index_add_.default", "aten.index_add.default")
def index_add(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        at = index_of(lw, args[2])
        src = value_of(lw, args[3])
        alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
        if at is not None and isinstance(src, Rows) and int(args[1]) == 0 and alpha == 1 \
                and at.ndim == 1:
            got = _into_pairs(lw, value_of(lw, args[0]), at, src, shapes[0][0])
            if got is not None:
                return got
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.index_put.default", "aten.index_put_.default")
def index_put(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        at = _one_index(lw, args)
        src = value_of(lw, args[2])
        dest = value_of(lw, args[0])
        accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
        rows = shapes[0][0] if shapes and shapes[0] else -1
        if at is not None and isinstance(src, Rows) and accumulate:
            got = _into_pairs(lw, dest, at, src, rows)
            if got is not None:
                return got
        if at is not None and isinstance(src, Assembled) and src.group.ndim == 1:
            if accumulate and isinstance(dest, (Zeros, NewZeros)):
                return gathered_back(lw, src, at, tuple(shapes[0]))
            perm = np.where(at < 0, at + rows, at)
            if len(perm) == rows == len(src.group) \
                    and np.array_equal(np.sort(perm), np.arange(rows)) \
                    and (not accumulate or isinstance(dest, (Zeros, NewZeros))):
                inverse = np.empty(rows, dtype=np.int64)
                inverse[perm] = np.arange(rows)
                return Assembled(src.values, src.group[inverse], src.index[inverse])
        return base(lw, args, kwargs, shapes, group)
    return lower
