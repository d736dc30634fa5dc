"""Rows at a recorded index reordered by a recorded permutation
(docs/soundness.md, "Plans traced from PyTorch", 37 c): torchtitan's
expert-parallel ``_permute`` (``x[perm]``) and ``_unpermute``
(``out[perm] = x`` into a fresh tensor, every row written once), and their
backwards.

- ``x[idx]`` of grouped rows (``grouped_rows.Experts``) at a recorded
  index without repeats: the same rows at the picked positions
  (``routed_rows`` does this for ``Rows``).
- ``out[perm] = x`` with perm a permutation of out's rows: row q of the
  result is row ``inv[q]`` of x (``inv`` perm's inverse), whatever out
  held before; so the result is x's rows at ``index[inv]``. Accumulated
  into zeros, the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.lowering.grouped_rows import Experts
from backends.torch.lowering.ir import NewZeros, Zeros
from backends.torch.lowering.registry import refines
from backends.torch.lowering.routed_rows import Rows, index_of, value_of

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]


def _picked(lw: Lowerer, x: Rows | Experts, at: np.ndarray) -> Rows | Experts | int:
    """x's rows at ``at``; every row of a base in its order is the base."""
    if isinstance(x, Rows):
        index = x.index[at]
        if np.array_equal(index, np.arange(lw.shapes[x.base][0])):
            return x.base
        return Rows(x.base, index)
    return Experts(x.y, x.group[at], x.index[at])


def _put_back(lw: Lowerer, target: Any, src: Rows | Experts, perm: np.ndarray,
              accumulate: bool) -> bool:
    """Rows gathered at ``perm`` accumulated back into zeros at ``perm``
    (the backward of a gather at an index that names every row, once):
    routed rows' ``mask * base``, as at an index naming fewer rows
    (``routed_rows.index_put``), so that a rank whose rows all go to one
    expert writes the node the single-device step writes for it
    (docs/soundness.md, "Plans traced from PyTorch", 121 a)."""
    return (accumulate and isinstance(src, Rows) and isinstance(value_of(lw, target), NewZeros)
            and np.array_equal(perm, src.index))


@refines("aten.index.Tensor")
def index(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        if not isinstance(x, Experts) or len(indices) != 1 or indices[0] is None:
            return base(lw, args, kwargs, shapes, group)
        at = index_of(lw, indices[0])
        n = len(x.index)
        if at is None or at.ndim != 1:
            return base(lw, args, kwargs, shapes, group)
        at = np.where(at < 0, at + n, at)
        if len(np.unique(at)) != len(at) or (len(at) and (at.min() < 0 or at.max() >= n)):
            return base(lw, args, kwargs, shapes, group)
        return _picked(lw, x, at)
    return lower


@refines("aten.index_put.default", "aten.index_put_.default")
def index_put(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        src = value_of(lw, args[2])
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        if isinstance(src, int) and len(lw.shapes[src]) and lw.shapes[src][0] == shapes[0][0]:
            src = Rows(src, np.arange(lw.shapes[src][0]))  # a lowered value: all its rows
        if not isinstance(src, (Rows, Experts)) or len(indices) != 1 or indices[0] is None:
            return base(lw, args, kwargs, shapes, group)
        perm = index_of(lw, indices[0])
        rows = shapes[0][0] if shapes and shapes[0] else -1
        if perm is None or perm.ndim != 1 or len(perm) != rows or len(src.index) != rows:
            return base(lw, args, kwargs, shapes, group)
        perm = np.where(perm < 0, perm + rows, perm)
        if not np.array_equal(np.sort(perm), np.arange(rows)):
            return base(lw, args, kwargs, shapes, group)  # not every row written once
        accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
        if accumulate and not isinstance(value_of(lw, args[0]), (Zeros, NewZeros)):
            return base(lw, args, kwargs, shapes, group)
        if _put_back(lw, args[0], src, perm, accumulate):
            return base(lw, args, kwargs, shapes, group)
        inverse = np.empty(rows, dtype=np.int64)
        inverse[perm] = np.arange(rows)
        return _picked(lw, src, inverse)
    return lower
