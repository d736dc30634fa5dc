"""Lowerings of what models do with the batch's integer ids besides an
embedding lookup: a table indexed by them (``targets[labels]``), a value
picked at them (``logits.gather(-1, labels.unsqueeze(-1))``), and the
backward kernels of both (``index_put`` with ``accumulate`` into zeros,
``scatter_add`` into zeros).

In a plan, ids are one-hot rows ``[..., vocab]`` (docs/soundness.md, "Plans
traced from PyTorch", 18): indexing a table of ``vocab`` rows by ids is the
one-hot rows times the table (the ``embedding`` rule), and picking along
the last dim of a ``[..., vocab]`` tensor is the row sum of the tensor times
the one-hot rows. Both are exact for ids in ``[0, vocab)``, the only ids
the backend draws. Registered by ``lowering/`` over its own table (the
vocabulary-parallel patterns of ``lowering/vocab_parallel.py`` keep their
cases: a handler here takes only plain ids and hands everything else on).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.context import LNode
from backends.torch.lowering.emit import cat, narrow, put_region, region_dims
from backends.torch.lowering.ir import Const, IdRows, Ids, NewZeros
from backends.torch.lowering.onehot import id_rows, ids_value, label_values, one_hot_of
from backends.torch.lowering.registry import Handler, lowers, not_lowered, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: how the ids' refinements end the line of an op they do not lower
OTHER_THAN_IDS = " other than at the batch's ids"


def _ids(lw: Lowerer, a: Any) -> Ids | None:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v":
        found = lw.env.get(a[1])
        return found if isinstance(found, Ids) else None
    return None


def _without_trailing_one(lw: Lowerer, ids: Ids) -> Ids:
    """Ids ``[..., 1]`` (``labels.unsqueeze(-1)``) seen without the last dim."""
    shape = ids.shape
    if shape is None or not shape or shape[-1] != 1:
        raise LoweringError(f"{lw.name}: a gather index of ids without a trailing dim of 1")
    return replace(ids, shape=tuple(shape[:-1]))


def _table_rows(lw: Lowerer, onehot: int, table: int) -> int:
    """The one-hot rows cut to the table's row count (ids index a table of
    at most ``vocab`` rows; any id the run used is below its row count)."""
    rows, width = lw.shapes[table][0], lw.shapes[onehot][-1]
    if rows == width:
        return onehot
    if rows > width:
        raise LoweringError(f"{lw.name}: ids index a table of {rows} rows, more than the "
                            f"vocabulary's {width}")
    shape = [*lw.shapes[onehot][:-1], rows]
    return lw.emit("narrow", [onehot], [shape], {"dim": len(shape) - 1, "start": 0,
                                                  "length": rows})[0]


@refines("aten.index.Tensor", absent=lambda op: not_lowered(op, OTHER_THAN_IDS))
def index(base: Handler) -> Handler:
    """``table[ids]``: the ``embedding`` of the one-hot rows."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        src = lw.env.get(indices[0][1]) if len(indices) == 1 and indices[0] is not None else None
        if not isinstance(src, (Ids, IdRows)):
            return base(lw, args, kwargs, shapes, group)
        table = lw.val(args[0])
        rank = len(lw.shapes[table])
        if rank not in (1, 2):
            raise LoweringError(f"{lw.name}: ids index a table of {rank} dims (only [rows] and "
                                f"[rows, width] are lowered)")
        if rank == 1:  # a column of one number per id
            table = lw.reshape(table, (lw.shapes[table][0], 1))
        onehot = _table_rows(lw, src.x if isinstance(src, IdRows) else one_hot_of(lw, src), table)
        out = lw.emit("embedding", [onehot, table], [(*lw.shapes[onehot][:-1], lw.shapes[table][1])])[0]
        return lw.reshape(out, tuple(shapes[0]))
    return lower


@lowers("aten.new_zeros.default")
def new_zeros(lw: Lowerer, args, kwargs, shapes, group):
    return NewZeros(tuple(shapes[0]))


@refines("aten.index_put.default", "aten.index_put_.default",
         absent=lambda op: not_lowered(op, OTHER_THAN_IDS))
def index_put(base: Handler) -> Handler:
    """``new_zeros(table).index_put([ids], g, accumulate=True)``: the
    ``embedding`` rule's backward (the one-hot rows' transpose times g)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        target = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        ids = _ids(lw, indices[0]) if len(indices) == 1 else None
        if not isinstance(target, NewZeros) or ids is None:
            return base(lw, args, kwargs, shapes, group)
        accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
        if not accumulate or len(target.shape) != 2:
            raise LoweringError(f"{lw.name}: index_put at ids into zeros other than the "
                                f"accumulating backward of a table lookup")
        onehot = one_hot_of(lw, ids)
        out = lw.new(shapes[0])
        if target.shape[0] != lw.shapes[onehot][-1]:
            raise LoweringError(f"{lw.name}: the backward of a lookup in a table of "
                                f"{target.shape[0]} rows is not lowered")
        lw.nodes.append(LNode("embedding", "bw", [onehot, -1, lw.val(args[2])], [-1, out], {},
                              lw.name, None, lw.mb))
        return out
    return lower


def _picked_width(lw: Lowerer, x_shape: tuple[int, ...], dim: int) -> None:
    if dim != len(x_shape) - 1 or x_shape[-1] != lw.vocab:
        raise LoweringError(f"{lw.name}: ids pick along a dim other than a last dim of the "
                            f"vocabulary's size")


@refines("aten.gather.default")
def gather(base: Handler) -> Handler:
    """``x.gather(-1, ids.unsqueeze(-1))``: ``sum(x * onehot, -1, keepdim)``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        ids = _ids(lw, args[2])
        if ids is None:
            return base(lw, args, kwargs, shapes, group)
        x = lw.val(args[0])
        dim = int(args[1]) % len(lw.shapes[x])
        _picked_width(lw, lw.shapes[x], dim)
        onehot = one_hot_of(lw, _without_trailing_one(lw, ids))
        picked = lw.emit("mul", [x, onehot], [lw.shapes[x]])[0]
        return lw.emit("sum", [picked], shapes, {"dim": dim, "keepdim": True})[0]
    return lower


@lowers("aten.scatter_add.default")
def scatter_add(lw: Lowerer, args, kwargs, shapes, group):
    """gather's backward, ``new_zeros(x).scatter_add(-1, ids[..., None], g)``:
    the one-hot rows times g (broadcast along the last dim)."""
    target = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
    ids = _ids(lw, args[2])
    if not isinstance(target, NewZeros) or ids is None:
        raise LoweringError(f"{lw.name}: scatter_add other than gather's backward at the "
                            f"batch's ids is not lowered")
    dim = int(args[1]) % len(target.shape)
    _picked_width(lw, target.shape, dim)
    onehot = one_hot_of(lw, _without_trailing_one(lw, ids))
    g = lw.emit("expand", [lw.val(args[3])], [target.shape], {"shape": list(target.shape)})[0]
    return lw.emit("mul", [g, onehot], [target.shape])[0]


@lowers("aten.scatter_.value")
def scatter_one(lw: Lowerer, args, kwargs, shapes, group):
    """``zeros(..., C).scatter_(-1, ids.unsqueeze(-1), 1)`` (``F.one_hot``):
    the one-hot rows, their first C columns (the recorded ids all lie below
    C, checked: the columns cut off are zero, item 18)."""
    zeros = constant_value(lw, args[0])
    ids = _ids(lw, args[2])
    value = lw.const(args[3]) if len(args) > 3 else None
    if zeros is None or np.any(zeros) or ids is None or value != 1 \
            or int(args[1]) % zeros.ndim != zeros.ndim - 1:
        raise LoweringError(f"{lw.name}: scatter_ other than F.one_hot of the batch's ids "
                            f"is not lowered")
    piece = _without_trailing_one(lw, ids)
    rows = IdRows(one_hot_of(lw, piece), label_values(lw, ("v", ids_value(lw, ids))))
    classes = zeros.shape[-1]
    if np.any(rows.ids >= classes) or classes > lw.vocab:
        raise LoweringError(f"{lw.name}: F.one_hot with {classes} classes of ids up to "
                            f"{int(rows.ids.max())}")
    if classes == lw.vocab:
        return rows.x
    shape = [*lw.shapes[rows.x][:-1], classes]
    return lw.emit("narrow", [rows.x], [shape], {"dim": len(shape) - 1, "start": 0,
                                                  "length": classes})[0]


@lowers("aten.addcmul.default")
def addcmul(lw: Lowerer, args, kwargs, shapes, group):
    """``x + value * a * b`` (``torch.addcmul``), broadcasting as torch does."""
    x, a, b = (lw.val(t) for t in args[:3])
    value = lw.const(args[3] if len(args) > 3 else kwargs.get("value", 1.0))
    if value is None:
        raise LoweringError(f"{lw.name}: addcmul with a value that is not a number")
    shape = tuple(shapes[0])
    x, a, b = (_broadcast(lw, t, shape) for t in (x, a, b))
    prod = lw.emit("mul", [a, b], [shape])[0]
    if value != 1.0:
        prod = lw.emit("mul_scalar", [prod], [shape], {"value": float(value)})[0]
    return lw.emit("add", [x, prod], [shape])[0]


def _broadcast(lw: Lowerer, x: int, shape: tuple[int, ...]) -> int:
    if tuple(lw.shapes[x]) == shape:
        return x
    return lw.emit("expand", [x], [shape], {"shape": list(shape)})[0]




# -- integer functions of the ids, ids as numbers ------------------------------------------------

def _mapped(lw: Lowerer, rows: IdRows, values: np.ndarray, ids: np.ndarray) -> IdRows:
    """Ids mapped by ``i -> values[i]`` (in ``[0, vocab)``): their one-hot rows
    are the old rows times the constant 0/1 matrix ``P[i, values[i]] = 1``."""
    table = np.zeros((lw.vocab, lw.vocab))
    table[np.arange(lw.vocab), values] = 1.0
    x = lw.emit("embedding", [rows.x, constant_input(lw, table)], [lw.shapes[rows.x]])[0]
    return IdRows(x, ids)


@refines("aten.remainder.Scalar", absent=lambda op: not_lowered(op, OTHER_THAN_IDS))
def remainder(base: Handler) -> Handler:
    """``ids % c`` for a positive integer c (floor modulo, as torch's)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        src = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        if not isinstance(src, (Ids, IdRows)):
            return base(lw, args, kwargs, shapes, group)
        c = lw.const(args[1])
        if c is None or c != int(c) or c <= 0:
            raise LoweringError(f"{lw.name}: the batch's ids modulo {args[1]!r} (only a positive "
                                f"integer is lowered)")
        rows = id_rows(lw, args[0])
        return _mapped(lw, rows, np.arange(lw.vocab) % int(c), rows.ids % int(c))
    return lower


@refines("aten.select.int")
def select(base: Handler) -> Handler:
    """``ids[:, k]``: a narrow of the one-hot rows, its dim dropped."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        src = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        if not isinstance(src, (Ids, IdRows)):
            return base(lw, args, kwargs, shapes, group)
        rows = id_rows(lw, args[0])
        dim = int(args[1]) % rows.ids.ndim
        index = int(args[2]) % rows.ids.shape[dim]
        shape = list(lw.shapes[rows.x])
        shape[dim] = 1
        x = lw.emit("narrow", [rows.x], [shape], {"dim": dim, "start": index, "length": 1})[0]
        ids = np.take(rows.ids, index, axis=dim)
        return IdRows(lw.reshape(x, (*ids.shape, lw.vocab)), ids)
    return lower


@refines("aten._to_copy.default")
def to_copy(base: Handler) -> Handler:
    """Ids converted to numbers: the one-hot rows times the column of the
    ids' values (``0 .. vocab - 1``, or the mapped values). Another integer
    type keeps them ids."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        src = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        if not isinstance(src, (Ids, IdRows)):
            return base(lw, args, kwargs, shapes, group)
        dtype = str(kwargs.get("dtype", ""))
        if not dtype:  # a copy to another device or layout: still the ids
            return src
        if "float" not in dtype and "double" not in dtype:
            if "int" in dtype or "long" in dtype:
                return src
            raise LoweringError(f"{lw.name}: the batch's integer ids converted to {dtype}")
        rows = id_rows(lw, args[0])
        column = constant_input(lw, np.arange(lw.vocab, dtype=np.float64).reshape(lw.vocab, 1))
        numbers = lw.emit("embedding", [rows.x, column], [(*rows.ids.shape, 1)])[0]
        return lw.reshape(numbers, tuple(shapes[0]))
    return lower


@refines("aten.t.default", "aten.transpose.int")
def transpose(base: Handler) -> Handler:
    """Ids with two dims swapped (``tokens.t()``, sequence-first models): the
    one-hot rows with the same dims swapped."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        src = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        if not isinstance(src, (Ids, IdRows)):
            return base(lw, args, kwargs, shapes, group)
        rows = id_rows(lw, args[0])
        nd = rows.ids.ndim
        d0, d1 = ((int(args[1]) % nd, int(args[2]) % nd) if len(args) > 2 else (0, 1 % nd))
        ids = np.swapaxes(rows.ids, d0, d1)
        if d0 == d1:
            return rows
        x = lw.emit("transpose", [rows.x], [(*ids.shape, lw.vocab)], {"dim0": d0, "dim1": d1})[0]
        return IdRows(x, ids)
    return lower


# -- ids moved and overwritten (a shifted copy of the labels) ------------------------------------

def _id_source(lw: Lowerer, a: Any) -> Ids | IdRows | None:
    found = lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        else None
    return found if isinstance(found, (Ids, IdRows)) else None


@refines("aten.roll.default")
def roll(base: Handler) -> Handler:
    """``torch.roll(ids, shifts, dims)``: every position a copy of one
    position of the ids, so the one-hot rows rolled along the same dims
    (the last ``s`` rows then the first ``n - s``, ``copies.roll``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if _id_source(lw, args[0]) is None:
            return base(lw, args, kwargs, shapes, group)
        rows = id_rows(lw, args[0])
        nd = rows.ids.ndim
        shifts = args[1] if len(args) > 1 else kwargs["shifts"]
        dims = args[2] if len(args) > 2 else kwargs.get("dims", [])
        shifts = [int(s) for s in (shifts if isinstance(shifts, (list, tuple)) else [shifts])]
        dims = [int(d) % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        if len(dims) != len(shifts) or not dims:
            raise LoweringError(f"{lw.name}: torch.roll of the batch's ids without a dim for "
                                f"each shift is not lowered")
        x = rows.x
        for shift, d in zip(shifts, dims):
            n = rows.ids.shape[d]
            s = shift % n if n else 0
            if s:
                x = cat(lw, [narrow(lw, x, d, n - s, s), narrow(lw, x, d, 0, n - s)], d)
        return IdRows(x, np.roll(rows.ids, shifts, axis=dims))
    return lower


@refines("aten.fill_.Scalar", "aten.fill.Scalar")
def fill(base: Handler) -> Handler:
    """Ids all set to one id ``c`` in ``[0, vocab)``: the constant one-hot
    rows of ``c`` (an id's value, not a number of the step)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if _id_source(lw, args[0]) is None:
            return base(lw, args, kwargs, shapes, group)
        c = lw.const(args[1])
        if c is None or c != int(c) or not 0 <= c < lw.vocab:
            raise LoweringError(f"{lw.name}: the batch's ids filled with {args[1]!r} (only an id "
                                f"of the vocabulary is lowered)")
        ids = np.full(tuple(shapes[0]), int(c))
        return IdRows(constant_input(lw, np.eye(lw.vocab)[ids]), ids)
    return lower


def _constant_ids(lw: Lowerer, a: Any) -> IdRows | None:
    """A constant integer tensor (``labels.new_zeros(...).fill_(-100)``) as
    ids: the one-hot rows of its values (a zero row where a value is outside
    the vocabulary, an ignored label), else None."""
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and isinstance(lw.env.get(a[1]), Const)):
        return None
    value = constant_value(lw, a)
    if value is None or value.dtype.kind not in "iu":
        return None
    value = np.asarray(value, dtype=np.int64)
    rows = np.zeros((*value.shape, lw.vocab))
    inside = (value >= 0) & (value < lw.vocab)
    rows[inside, value[inside]] = 1.0
    return IdRows(constant_input(lw, rows), value.copy())


def _integer_tensor(lw: Lowerer, a: Any) -> bool:
    """Recorded tensor ``a`` holds integers: ids, an integer constant, or an
    integer value the step recorded."""
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
        return False
    if _id_source(lw, a) is not None or a[1] in lw.trace.get("int_values", {}):
        return True
    value = lw.trace.get("constvals", {}).get(a[1])
    return a[1] in lw.trace.get("constants", ()) and value is not None \
        and value.dtype.kind in "iu"


@refines("aten.copy_.default")
def copy_ids(base: Handler) -> Handler:
    """``block.copy_(ids)`` into a view of a constant integer tensor or of
    ids (the labels copied into each block of ProphetNet's n-gram targets):
    the written view holds the ids themselves (the tensor they were written
    into is the ``partial_write`` above)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if len(args) < 2 or _id_source(lw, args[1]) is None \
                or not _integer_tensor(lw, args[0]):
            return base(lw, args, kwargs, shapes, group)
        rows = id_rows(lw, args[1])
        if tuple(rows.ids.shape) != tuple(shapes[0]):
            raise LoweringError(f"{lw.name}: ids of shape {list(rows.ids.shape)} copied into a "
                                f"view of shape {list(shapes[0])} (a broadcast) is not lowered")
        return rows
    return lower


@refines("partial_write")
def partial_write(base: Handler) -> Handler:
    """Ids with a block of them overwritten by other ids (``rolled.select(-1,
    -1).fill_(0)``): the one-hot rows with that block replaced by the new
    ids' rows (``emit.put_region`` along the ids' dims; the vocabulary
    dim whole), and the recorded ids likewise."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        region = args[2] if len(args) > 2 else None
        written = args[3] if len(args) > 3 else None
        if _id_source(lw, args[0]) is None:
            held = _constant_ids(lw, args[0])
            if held is None or written is None or _id_source(lw, written) is None:
                return base(lw, args, kwargs, shapes, group)
            rows = held
        elif region is None or written is None or _id_source(lw, written) is None:
            raise LoweringError(f"{lw.name}: the batch's ids written in place with values other "
                                f"than ids, or through a view that is no block of them")
        else:
            rows = id_rows(lw, args[0])
        if region is None:
            raise LoweringError(f"{lw.name}: the batch's ids written through a view that is no "
                                f"block of the tensor")
        new = id_rows(lw, written)
        sizes, blocks = region[0], region_dims(region[1])
        kept = [at for _, _, at, _ in blocks if at >= 0]
        if tuple(sizes) != rows.ids.shape or kept != sorted(kept):
            raise LoweringError(f"{lw.name}: the batch's ids written through a reshaped or "
                                f"permuted view are not lowered")
        block = tuple(length for _, length, _, _ in blocks)
        starts = [start for start, _, _, _ in blocks]
        steps = [step for _, _, _, step in blocks]
        x = put_region(lw, rows.x, [*starts, 0], [*steps, 1],
                       lw.reshape(new.x, (*block, lw.vocab)))
        ids = rows.ids.copy()
        ids[tuple(slice(s, s + n * k, k) for s, n, k in zip(starts, block, steps))] = \
            new.ids.reshape(block)
        return IdRows(x, ids)
    return lower
