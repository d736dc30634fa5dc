"""Rows at recorded routing cut into blocks and put side by side again
(docs/soundness.md, "Plans traced from PyTorch", 47 c): Megatron-Core's
all-to-all dispatcher sorts the received rows by local expert
(``sort_chunks_by_idxs``: ``split`` then ``cat`` in another order) and its
``SequentialMLP`` runs each expert on its own block of rows (``split`` by
the tokens per expert, one MLP each, ``cat`` of the results).

- a block ``[a, b)`` of gathered rows (``Rows``, ``Experts``) along the
  rows is the rows ``index[a:b]`` of the same base (``split``,
  ``split_with_sizes``, ``slice``, ``narrow``);
- a ``cat`` along the rows of gathered rows of one base is the rows at the
  concatenated index (no row repeated, checked); of rows of several bases
  of one shape (each expert's result on all rows), the ``Experts`` of the
  bases stacked, each row of the group of its block; of blocks of one
  grouped result (``Experts`` of one ``y``: the unsort of the experts'
  output), ``y`` at the concatenated (group, index) pairs (no pair
  repeated, checked).

Each is the op's definition on the recorded index: exact for every value.
Anything else is handed on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.grouped_rows import Experts
from backends.torch.lowering.registry import refines
from backends.torch.lowering.routed_rows import Rows, value_of

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]


def _block(x: Rows | Experts, lo: int, hi: int) -> Rows | Experts:
    if isinstance(x, Rows):
        return Rows(x.base, x.index[lo:hi])
    return Experts(x.y, x.group[lo:hi], x.index[lo:hi])


def _rows_dim(dim: Any) -> bool:
    return dim is not None and int(dim) == 0


def split(base: Handler) -> Handler:
    """``split``/``split_with_sizes`` along the rows of gathered rows."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if not isinstance(x, (Rows, Experts)) or not _rows_dim(dim):
            return base(lw, args, kwargs, shapes, group)
        bounds = np.concatenate([[0], np.cumsum([s[0] for s in shapes])]).astype(int)
        if bounds[-1] != len(x.index):
            raise LoweringError(f"{lw.name}: a split of {len(x.index)} gathered rows into "
                                f"blocks of {bounds[-1]}")
        return [_block(x, int(bounds[i]), int(bounds[i + 1])) for i in range(len(shapes))]
    return lower


def slice_rows(base: Handler) -> Handler:
    """``x[a:b]`` along the rows of gathered rows (the backward of a ``cat``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        step = args[4] if len(args) > 4 else kwargs.get("step", 1)
        if not isinstance(x, (Rows, Experts)) or not _rows_dim(dim) or step != 1:
            return base(lw, args, kwargs, shapes, group)
        n = len(x.index)
        start = args[2] if len(args) > 2 else kwargs.get("start", 0)
        start = 0 if start is None else int(start)
        start = max(0, min(n, start + n if start < 0 else start))
        return _block(x, start, start + int(shapes[0][0]))
    return lower


def _stacked(lw: Lowerer, bases: list[int]) -> int:
    """The bases ``[N, ...]`` stacked into ``[G, N, ...]``."""
    shape = tuple(lw.shapes[bases[0]])
    parts = [lw.reshape(b, (1, *shape)) for b in bases]
    if len(parts) == 1:
        return parts[0]
    return lw.emit("cat", parts, [(len(parts), *shape)], {"dim": 0})[0]


def _empty(lw: Lowerer, ref: Any) -> bool:
    """A recorded value with no rows."""
    if not (isinstance(ref, (list, tuple)) and len(ref) == 2 and ref[0] == "v"):
        return False
    shapes = lw.trace["shapes"]
    return ref[1] < len(shapes) and len(shapes[ref[1]]) > 0 and shapes[ref[1]][0] == 0


def _experts_cat(lw: Lowerer, items: list[Experts]) -> Experts:
    """Blocks of one grouped result put side by side (the dispatcher's
    unsort of the experts' output): row i is ``y[group[i], index[i]]`` of
    the block it came from, so the whole is ``y`` at the concatenated
    (group, index) pairs. A pair taken twice is refused."""
    group = np.concatenate([i.group for i in items]).astype(np.int64)
    index = np.concatenate([i.index for i in items]).astype(np.int64)
    pairs = group * (int(index.max(initial=0)) + 1) + index
    if len(np.unique(pairs)) != len(pairs):
        raise LoweringError(f"{lw.name}: grouped rows put side by side that repeat a row")
    return Experts(items[0].y, group, index)


def cat(base: Handler) -> Handler:
    """``cat`` along the rows of gathered rows."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        refs = args[0] if isinstance(args[0], (list, tuple)) else []
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if _rows_dim(dim):
            # a block of no rows (an expert no row was routed to) adds nothing
            refs = [a for a in refs if not _empty(lw, a)] or refs[:1]
        items = [value_of(lw, a) for a in refs]
        if items and _rows_dim(dim) and all(isinstance(i, Experts) for i in items) \
                and len({i.y for i in items}) == 1:
            return _experts_cat(lw, items)
        if not items or not _rows_dim(dim) or not all(isinstance(i, Rows) for i in items):
            return base(lw, args, kwargs, shapes, group)
        index = np.concatenate([i.index for i in items]).astype(np.int64)
        if len({i.base for i in items}) == 1:
            if len(np.unique(index)) != len(index):
                raise LoweringError(f"{lw.name}: rows put side by side that repeat a row")
            return Rows(items[0].base, index)
        if len({tuple(lw.shapes[i.base]) for i in items}) != 1:
            return base(lw, args, kwargs, shapes, group)
        bases = list(dict.fromkeys(i.base for i in items))
        groups = np.concatenate([np.full(len(i.index), bases.index(i.base)) for i in items])
        return Experts(_stacked(lw, bases), groups.astype(np.int64), index)
    return lower


refines("aten.split.Tensor", "aten.split_with_sizes.default")(split)
refines("aten.slice.Tensor")(slice_rows)
refines("aten.cat.default")(cat)
