"""Lowering of integer ids replaced where a mask holds: labels masked before
the loss ignores them (``labels.masked_fill(labels == pad, -100)``,
``torch.where(mask, -100, labels)``, ``labels[mask] = -100``), by any mask
of the batch's ids or constant mask (an ``ir.Flag``).

Ids are one-hot rows in a plan. Where the mask ``m`` holds, the new id is
the fill ``c``: a zero row when ``c`` lies outside the vocabulary (the
loss's ignore index), the one-hot row of ``c`` otherwise; elsewhere the row
is unchanged. So the new one-hot rows are ``onehot * (1 - m) + m e_c``
(``e_c`` the one-hot row of ``c``, or 0), exact for every one-hot input,
and the new recorded ids ``where(m, c, ids)`` give the count of kept labels
a mean divides by (``ir.IdRows``; docs/soundness.md, "Plans traced from
PyTorch", 31).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input
from backends.torch.lowering.ir import Flag, IdRows, Ids
from backends.torch.lowering.onehot import flag_of, label_values, one_hot
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

MASKED_FILLS = ("aten.masked_fill.Scalar", "aten.masked_fill_.Scalar", "aten.masked_fill.Tensor")


def _is_ids(lw: Lowerer, a: Any) -> bool:
    return isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        and isinstance(lw.env.get(a[1]), (Ids, IdRows))


def _fill(lw: Lowerer, a: Any) -> int | None:
    """The fill as an integer id, or None when it is no integer number."""
    c = lw.const(a)
    return int(c) if c is not None and float(c).is_integer() else None


def replaced(lw: Lowerer, ids: Any, flag: Flag, c: int) -> IdRows:
    """``ids`` with ``c`` where ``flag`` holds, as one-hot rows and values."""
    x = one_hot(lw, ids)
    values = label_values(lw, ids)
    shape = lw.shapes[x]
    if tuple(flag.value.shape) != tuple(values.shape) or lw.shapes[flag.x] != tuple(values.shape):
        raise LoweringError(f"{lw.name}: ids of shape {list(values.shape)} replaced where a mask "
                            f"of shape {list(flag.value.shape)} holds (a broadcast mask is not "
                            f"lowered)")
    m = lw.reshape(flag.x, (*values.shape, 1))
    m = lw.emit("expand", [m], [shape], {"shape": list(shape)})[0]
    kept = lw.emit("sub", [x, lw.emit("mul", [x, m], [shape])[0]], [shape])[0]
    if 0 <= c < lw.vocab:
        row = np.zeros(lw.vocab)
        row[c] = 1.0
        kept = lw.emit("add", [kept, lw.emit("mul", [m, constant_input(lw, row)], [shape])[0]],
                       [shape])[0]
    return IdRows(kept, np.where(flag.value, c, values))


def masked_fill(op: str):
    """``ids.masked_fill(mask, c)`` (``op``) of the batch's ids."""
    def refine(plain: Handler) -> Handler:
        def lower(lw: Lowerer, args, kwargs, shapes, group):
            if not _is_ids(lw, args[0]):
                return plain(lw, args, kwargs, shapes, group)
            flag, c = flag_of(lw, args[1]), _fill(lw, args[2])
            if flag is None or c is None:
                raise LoweringError(f"{lw.name}: {op} of the batch's ids where the mask is not "
                                    f"one of their comparisons or a constant, or the fill is not "
                                    f"an integer")
            return replaced(lw, args[0], flag, c)
        return lower
    return refine


for _op in MASKED_FILLS:
    refines(_op)(masked_fill(_op))


@refines("aten.where.self")
def where(plain: Handler) -> Handler:
    """``where(mask, c, ids)`` and ``where(mask, ids, c)``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        cond, a, b = args[0], args[1], args[2]
        if not (_is_ids(lw, a) or _is_ids(lw, b)):
            return plain(lw, args, kwargs, shapes, group)
        flag = flag_of(lw, cond)
        if flag is not None and _is_ids(lw, b) and _fill(lw, a) is not None:
            return replaced(lw, b, flag, _fill(lw, a))
        if flag is not None and _is_ids(lw, a) and _fill(lw, b) is not None:
            keep = Flag(lw.emit("mul_scalar", [lw.emit("add_scalar", [flag.x], [lw.shapes[flag.x]],
                                                       {"value": -1.0})[0]],
                                [lw.shapes[flag.x]], {"value": -1.0})[0], ~flag.value)
            return replaced(lw, a, keep, _fill(lw, b))
        return plain(lw, args, kwargs, shapes, group)  # the loss-parallel pattern, or refused
    return lower


def index_put(op: str):
    """``ids[mask] = c`` (``op``) of the batch's ids."""
    def refine(plain: Handler | None) -> Handler:
        def lower(lw: Lowerer, args, kwargs, shapes, group):
            if not _is_ids(lw, args[0]):
                if plain is None:
                    raise LoweringError(f"{lw.name}: {op} is not lowered")
                return plain(lw, args, kwargs, shapes, group)
            index = args[1] if isinstance(args[1], (list, tuple)) else []
            flag = flag_of(lw, index[0]) if len(index) == 1 and index[0] is not None else None
            c = _fill(lw, args[2])
            if flag is None or c is None or (len(args) > 3 and args[3]):
                raise LoweringError(f"{lw.name}: {op} into the batch's ids other than an integer "
                                    f"written where a mask of them (or a constant mask) holds")
            return replaced(lw, args[0], flag, c)
        return lower
    return refine


for _op in ("aten.index_put_.default", "aten.index_put.default"):
    refines(_op)(index_put(_op))
