"""Ids as one-hot rows: the one-hot input of (a piece of) the batch's ids,
the values of recorded labels, and ids the model cut or padded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input
from backends.torch.lowering.ir import Flag, IdRows, Ids, IdsTest, as_flag, pending_of
from backends.torch.lowering.shapes import view_to

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def label_values(lw: Lowerer, target: Any) -> np.ndarray:
    """The recorded integer ids an op reads (the rank's rows of the batch,
    its microbatch piece, seen with the op's shape)."""
    piece = lw.env.get(target[1])
    if isinstance(piece, IdRows):
        return piece.ids
    ids = lw.trace.get("batch_ids", {}).get(getattr(piece, "source", None))
    if not isinstance(piece, Ids) or ids is None:
        raise LoweringError(f"{lw.name}: the values of the labels a loss reads are not recorded")
    ids = np.split(np.asarray(ids), piece.parts, axis=0)[piece.index]
    return ids.reshape(piece.shape) if piece.shape is not None else ids


def one_hot(lw: Lowerer, ids: Any) -> int:
    """The one-hot rows of the ids an op reads: the input, or a microbatch
    of it (one ``split`` per piece), reshaped as the ids were."""
    piece = lw.env.get(ids[1]) if isinstance(ids, (list, tuple)) and ids[0] == "v" else None
    if isinstance(piece, IdRows):
        return piece.x
    if not isinstance(piece, Ids):
        raise LoweringError(f"{lw.name}: integer ids other than the batch's are not lowered")
    return one_hot_of(lw, piece)


def one_hot_of(lw: Lowerer, piece: Ids) -> int:
    """The one-hot rows of a piece of the batch's ids, shaped as the piece."""
    base = Ids(piece.source, piece.index, piece.parts)
    if base not in lw.id_pieces:
        x = lw.one_hot[piece.source]
        if piece.parts > 1:
            shape = list(lw.shapes[x])
            shape[0] //= piece.parts
            x = lw.emit("split", [x], [shape],
                        {"dim": 0, "parts": piece.parts, "index": piece.index})[0]
        lw.id_pieces[base] = x
    x = lw.id_pieces[base]
    if piece.shape is not None and piece.shape != lw.shapes[x][:-1]:
        if piece not in lw.id_pieces:
            lw.id_pieces[piece] = lw.materialize(view_to(lw, x, (*piece.shape, lw.vocab)))
        x = lw.id_pieces[piece]
    return x


def ids_value(lw: Lowerer, ids: Ids) -> int:
    """A recorded value holding these ids (for ``one_hot``)."""
    for v, x in lw.env.items():
        if x == ids:
            return v
    raise LoweringError(f"{lw.name}: ids no recorded op produced")


def id_rows(lw: Lowerer, a: Any) -> IdRows:
    """Ids (the batch's, or already cut) as their one-hot rows and values."""
    src = lw.env.get(a[1])
    if isinstance(src, IdRows):
        return src
    return IdRows(one_hot(lw, a), label_values(lw, a))


def slice_ids(lw: Lowerer, args, shapes) -> IdRows:
    """A slice of integer ids along any dim (a shifted ``labels[:, 1:]``):
    a narrow of their one-hot rows."""
    rows = id_rows(lw, args[0])
    nd = rows.ids.ndim
    dim = int(args[1]) % nd if len(args) > 1 else 0
    total = rows.ids.shape[dim]
    start, end = (args[2] if len(args) > 2 else 0) or 0, args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    start, stop, _ = slice(start, end, step).indices(total)
    if step != 1:
        raise LoweringError(f"{lw.name}: a strided slice of the integer ids is not lowered")
    length = max(stop - start, 0)
    shape = list(lw.shapes[rows.x])
    shape[dim] = length
    x = lw.emit("narrow", [rows.x], [shape], {"dim": dim, "start": start, "length": length})[0]
    return IdRows(x, np.take(rows.ids, range(start, start + length), axis=dim))


_TESTS = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
          "eq": np.equal, "ne": np.not_equal}


def ids_test_flag(lw: Lowerer, test: IdsTest) -> Flag:
    """``ids op c`` as a 0/1 tensor of the one-hot rows: the sum of the
    columns whose id passes the test (each one-hot row has a single 1), plus
    ``1 - (row sum)`` when the ids outside the vocabulary (zero rows) pass
    it, which must then hold for every one of them (docs/soundness.md,
    "Plans traced from PyTorch", 39c)."""
    onehot = one_hot_of(lw, test.ids)
    values = label_values(lw, ("v", ids_value(lw, test.ids)))
    held = _TESTS[test.op](values, test.value)
    outside = (values < 0) | (values >= lw.vocab)
    if np.any(held[outside]) and not np.all(held[outside]):
        raise LoweringError(f"{lw.name}: a comparison of ids with {test.value} that holds for "
                            f"some ids outside the vocabulary and not others is not lowered")
    shape = lw.shapes[onehot]
    columns = _TESTS[test.op](np.arange(lw.vocab), test.value).astype(np.float64)
    picked = lw.emit("mul", [onehot, constant_input(lw, columns)], [shape])[0]
    x = lw.emit("sum", [picked], [shape[:-1]], {"dim": [len(shape) - 1], "keepdim": False})[0]
    if np.any(held[outside]):
        rows = lw.emit("sum", [onehot], [shape[:-1]], {"dim": [len(shape) - 1],
                                                       "keepdim": False})[0]
        zero_rows = lw.emit("add_scalar", [lw.emit("mul_scalar", [rows], [shape[:-1]],
                                                   {"value": -1.0})[0]],
                            [shape[:-1]], {"value": 1.0})[0]
        x = lw.emit("add", [x, zero_rows], [shape[:-1]])[0]
    return Flag(x, held)


def flag_of(lw: Lowerer, a: Any) -> Flag | None:
    """The argument as a flag: a flag, a constant boolean mask, or a
    comparison of the batch's ids with a number (``IdsTest``)."""
    x = pending_of(lw, a)
    if isinstance(x, IdsTest):
        return ids_test_flag(lw, x)
    return as_flag(lw, a)
