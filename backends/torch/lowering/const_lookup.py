"""Lowering of a table sharded by rows and looked up at constant ids.

DTensor's ``RowwiseParallel`` on an ``nn.Embedding`` looks the ids up in the
rank's rows ``[lo, hi)``: the ids shifted by ``lo``, those outside the rows
set to 0, the lookup, then the looked-up rows of the ids outside zeroed
(``index_put_`` of 0 at the mask); its backward zeroes the same rows of the
gradient before the table's gradient is summed. When the ids are computed
from constants (``torch.arange`` positions, as a position embedding reads
them), the mask and the shifted ids are constants, and the lookup with its
zeroed rows is one product with a constant matrix: the one-hot rows of the
shifted ids with the masked rows zeroed, ``M[i, j] = keep[i] * (ids[i] == j)``.
That matrix is the single-device one-hot rows' columns ``[lo, hi)`` (every
kept id lies in the rank's rows), which ``build`` checks by value like every
constant; the lookup then aligns with the single-device one as a partial sum
over the rows' mesh axis (docs/soundness.md, "Plans traced from PyTorch",
30). Each rewrite is exact: ``x[mask] = 0`` of a lookup's output is the
lookup with those one-hot rows zeroed, and of a gradient read by the
table's backward ``M^T g`` the same zeroed rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.context import LNode
from backends.torch.lowering.ir import Const, Pending
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

INDEX_PUTS = ("aten.index_put_.default", "aten.index_put.default")


@dataclass(frozen=True)
class RowsZeroed(Pending):
    """A computed value with the rows at a constant mask set to 0, not yet
    emitted: read by an embedding backward at constant ids."""
    g: int
    keep: Any  # numpy bool array, the ids' shape: True where the row is kept

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: index_put_ zeroing rows of a computed value at a "
                            f"constant mask is read other than by the backward of a lookup at "
                            f"constant ids (not lowered)")


@dataclass
class ConstLookup(Pending):
    """A lookup of table ``w`` at constant ids, not yet emitted (so that a
    masked lookup's shifted ids, outside the rank's rows, never become a
    plan input): ``lookup`` emits it as an ordinary lookup when read."""
    w: int
    ids: Any  # numpy int array
    lookup: Any  # () -> the emitted lookup's value
    name: str = ""  # the module that looks up
    out: int = -1

    def materialize(self, lw: Lowerer) -> int:
        if self.out < 0:
            self.out = self.lookup()
        return self.out


def _one_hot_kept(lw: Lowerer, ids: np.ndarray, keep: np.ndarray, rows: int) -> int:
    """The one-hot rows of constant ``ids`` over ``rows`` columns, zero where
    ``keep`` is False (an id there may lie outside the rows)."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise LoweringError(f"{lw.name}: a lookup at constant ids of type {ids.dtype}")
    inside = (ids >= 0) & (ids < rows)
    if np.any(keep & ~inside):
        raise LoweringError(f"{lw.name}: constant ids outside [0, {rows}) index an embedding")
    m = np.where((keep & inside)[..., None], np.eye(rows)[np.where(inside, ids, 0)], 0.0)
    return constant_input(lw, m)


def _mask_of(lw: Lowerer, args) -> np.ndarray | None:
    """The constant boolean mask ``x[mask] = 0`` writes at, or None."""
    if not isinstance(args[1], (list, tuple)) or len(args[1]) != 1 or args[1][0] is None:
        return None
    if (bool(args[3]) if len(args) > 3 else False) or lw.const(args[2]) != 0:
        return None
    mask = constant_value(lw, args[1][0]) if isinstance(lw.env.get(args[1][0][1]), Const) \
        else None
    return None if mask is None or mask.dtype != bool else np.asarray(mask)


def _constant_ids(lw: Lowerer, a: Any) -> np.ndarray | None:
    return constant_value(lw, a) if isinstance(lw.env.get(a[1]), Const) else None


@refines("aten.embedding.default")
def embedding(plain: Handler) -> Handler:
    """A lookup at constant ids stays pending (``ConstLookup``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        ids = _constant_ids(lw, args[1])
        if ids is None:
            return plain(lw, args, kwargs, shapes, group)
        name, mb = lw.name, lw.mb

        def lookup() -> int:
            saved = lw.name, lw.mb
            lw.name, lw.mb = name, mb
            try:
                return plain(lw, args, kwargs, shapes, group)
            finally:
                lw.name, lw.mb = saved
        return ConstLookup(lw.val(args[0]), np.asarray(ids), lookup, name)
    return lower


def refuse(lw: Lowerer, args, kwargs, shapes, group):
    raise LoweringError(f"{lw.name}: index_put of other than 0 at a constant mask is not "
                        f"lowered")


@refines(*INDEX_PUTS, absent=lambda op: refuse)
def index_put(plain: Handler) -> Handler:
    """``x[mask] = 0`` at a constant mask: of a lookup at constant ids, the
    lookup with those one-hot rows zeroed; of a computed value, pending for
    the lookup's backward (``RowsZeroed``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        mask = _mask_of(lw, args)
        x = lw.env.get(args[0][1])
        if mask is None or not isinstance(x, (int, ConstLookup)):
            return plain(lw, args, kwargs, shapes, group)
        if isinstance(x, ConstLookup) and x.ids.shape == mask.shape:
            m = _one_hot_kept(lw, x.ids, ~mask, lw.shapes[x.w][0])
            saved, lw.name = lw.name, x.name or lw.name
            try:
                return lw.emit("embedding", [m, x.w], [tuple(shapes[0])])[0]
            finally:
                lw.name = saved
        x = lw.val(args[0])
        if mask.shape != tuple(lw.shapes[x][:mask.ndim]):
            raise LoweringError(f"{lw.name}: index_put_ of 0 at a constant mask of shape "
                                f"{list(mask.shape)} on a value of shape "
                                f"{list(lw.shapes[x])} is not lowered")
        return RowsZeroed(x, ~mask)
    return lower


@refines("aten.embedding_dense_backward.default")
def embedding_bw(plain: Handler) -> Handler:
    """The backward of a lookup at constant ids whose gradient rows were
    zeroed at a mask: the one-hot rows kept, transposed, times the gradient."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        g = lw.env.get(args[0][1])
        ids = _constant_ids(lw, args[1])
        if not isinstance(g, RowsZeroed) or ids is None:
            return plain(lw, args, kwargs, shapes, group)
        padding = args[3] if len(args) > 3 else kwargs.get("padding_idx", -1)
        rows = int(args[2])
        if (len(args) > 4 and args[4]) or (padding is not None and 0 <= int(padding) < rows) \
                or np.asarray(ids).shape != g.keep.shape:
            raise LoweringError(f"{lw.name}: the backward of a masked lookup at constant ids "
                                f"with a padding_idx, scale_grad_by_freq or another mask is "
                                f"not lowered")
        tokens = _one_hot_kept(lw, np.asarray(ids), g.keep, rows)
        out = lw.new(shapes[0])
        lw.nodes.append(LNode("embedding", "bw", [tokens, -1, g.g], [-1, out], {}, lw.name, None,
                              lw.mb))
        return out
    return lower
