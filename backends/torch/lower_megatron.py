"""Lowering of Megatron-Core's vocabulary-parallel cross-entropy
(``megatron/core/tensor_parallel/cross_entropy.py``) and of the MAX
all-reduce of row maxima.

Megatron computes the loss of logits ``x`` ``[S, B, V/t]`` (the rank's
vocabulary rows ``[lo, hi)``) against labels ``[S, B]`` (the batch's
labels transposed: one-hot rows in the plan) with c10d's in-place
collectives and in-place tensor writes:

- ``m = x.max(-1)[0]`` all-reduced with MAX: lowered as the maximum along
  the vocabulary of ``x`` all-gathered along it (the same value for every
  input: max is associative and commutative), as lower_vocab_parallel's
  ``amax`` pattern, and one the verifier proves equal to the single-device
  ``max`` (the gathered pieces must be the logits' columns in order);
- ``mask = (labels < lo) | (labels >= hi)``, ``local = labels - lo``,
  ``local[mask] = 0``; ``x.view(-1, w)[arange(n), local.view(-1)]``, the
  picks then zeroed where ``mask`` holds: the row sum of ``x`` times the
  one-hot labels' columns ``[lo, hi)`` (in-range rows pick the same entry,
  the others are 0 both ways);
- the backward's ``g2d[arange(n), local] -= 1 - mask.float()`` (an
  ``index`` at the same places, ``sub_``, ``index_put_`` back): ``g2d``
  minus the one-hot columns ``[lo, hi)`` (an in-range row loses 1 at its
  label, an out-of-range row 0 at column 0).

Every helper (a comparison, the mask, the local labels, a pick) is a
pending object only the next op of these patterns may read; any other
reader stops the run with one line. Registered last by ``lower.py``
(``megatron_handlers``): every other case is handed to the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lower import (
    LNode,
    _IdRows,
    _ids_value,
    _one_hot,
    _pg,
    _Shifted,
    _VocabMask,
    one_hot_of,
)
from backends.torch.lower_buckets import Bucket, bucket_view
from backends.torch.lower_nn import constant_value

Handler = Callable[..., Any]

#: c10d's ReduceOp.MAX
REDOP_MAX = 4


class _Pending:
    def emit_into(self, lw: Any) -> int:
        raise LoweringError(f"{lw.name}: a vocabulary-parallel label mask, local labels or "
                            f"pick ({type(self).__name__}) is read outside Megatron's "
                            f"cross-entropy (backends/torch/lower_megatron.py)")


@dataclass(frozen=True)
class Compare(_Pending):
    """``labels < value`` (op "lt") or ``labels >= value`` (op "ge")."""
    src: int  # the recorded value holding the labels (one-hot rows in the plan)
    op: str
    value: int


@dataclass(frozen=True)
class OutOfRange(_Pending):
    """``(labels < lo) | (labels >= hi)``, seen with ``shape``."""
    src: int
    lo: int
    hi: int
    shape: tuple[int, ...]

    def key(self) -> tuple[int, int, int]:
        return (self.src, self.lo, self.hi)


@dataclass(frozen=True)
class AsNumbers(_Pending):
    """``mask.float()``."""
    mask: OutOfRange


@dataclass(frozen=True)
class Inside(_Pending):
    """``1 - mask.float()``: 1 for the labels in ``[lo, hi)``."""
    mask: OutOfRange


@dataclass(frozen=True)
class Local(_Pending):
    """``labels - lo`` (then 0 where ``mask`` holds), seen with ``shape``."""
    src: int
    lo: int
    mask: OutOfRange | None
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Pick(_Pending):
    """``x2d[arange(n), local]``: ``value`` is the row sum of ``x2d`` times the
    one-hot columns of the local labels' range (seen with ``shape``), equal
    to the pick once the out-of-range picks are zeroed."""
    x: int
    local: Local
    value: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PickMinusInside(_Pending):
    """``x2d[arange(n), local] - (1 - mask.float())``."""
    x: int
    local: Local


def _env(lw: Any, a: Any) -> Any:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v":
        return lw.env.get(a[1])
    return None


def _refuse_pending(lw: Any, args: Any, what: str) -> None:
    for a in args if isinstance(args, (list, tuple)) else [args]:
        if isinstance(_env(lw, a), _Pending):
            raise LoweringError(f"{lw.name}: {what} reads a vocabulary-parallel label mask, "
                                f"local labels or pick outside Megatron's cross-entropy "
                                f"(backends/torch/lower_megatron.py)")


def _columns(lw: Any, local: Local, width: int, shape: tuple[int, ...]) -> int:
    """The one-hot rows of the labels ``local`` shifts, seen with ``shape``
    (without the vocabulary), columns ``[lo, lo + width)``."""
    src = lw.env.get(local.src)
    onehot = src.x if isinstance(src, _IdRows) else one_hot_of(lw, src)
    if math.prod(lw.shapes[onehot][:-1]) != math.prod(shape):
        raise LoweringError(f"{lw.name}: the labels do not match the logits' rows")
    onehot = lw.reshape(onehot, (*shape, lw.vocab))
    if width <= 0 or lw.vocab % width or local.lo % width:
        raise LoweringError(f"{lw.name}: a pick of the vocabulary rows [{local.lo}, "
                            f"{local.lo + width}) is not one of equal vocabulary shards")
    if width == lw.vocab:
        return onehot
    return lw.emit("split", [onehot], [[*shape, width]], {
        "dim": len(shape), "parts": lw.vocab // width, "index": local.lo // width})[0]


# -- the MAX all-reduce ---------------------------------------------------------

@dataclass(frozen=True)
class RowMax:
    """``x.max(dim)``'s values read only by a MAX all-reduce, not yet emitted
    (any other reader gets the local maximum)."""
    x: int
    dim: int
    keepdim: bool

    def emit_into(self, lw: Any) -> int:
        shape = list(lw.shapes[self.x])
        if self.keepdim:
            shape[self.dim] = 1
        else:
            del shape[self.dim]
        return lw.emit("max", [self.x], [shape], {"dim": self.dim, "keepdim": self.keepdim})[0]


class Unread(_Pending):
    """An output no later op reads."""


def _readers(lw: Any, value: int) -> list[tuple]:
    """The events after the current one that read ``value``."""
    from backends.torch.lower import _tensor_args
    return [e for e in lw.trace["events"][lw.event + 1:] if value in _tensor_args(e[1])]


def max_dim(base: Handler) -> Handler:
    """``x.max(dim)`` whose values only a MAX all-reduce reads and whose
    indices nothing reads: a pending row maximum (``RowMax``); else the
    table's."""
    def lower(lw: Any, args, kwargs, shapes, group):
        outs = lw.trace["events"][lw.event][2]
        if len(outs) == 2 and not _readers(lw, outs[1]):
            readers = _readers(lw, outs[0])
            if readers and all(e[0] == "c10d.allreduce_.default"
                               and tuple(e[1][0][2]) == ("redop", REDOP_MAX) for e in readers):
                x = lw.val(args[0])
                dim = int(args[1] if len(args) > 1 else kwargs["dim"]) % len(lw.shapes[x])
                keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
                return [RowMax(x, dim, keepdim), Unread()]
        return base(lw, args, kwargs, shapes, group)
    return lower


def all_reduce_inplace(base: Handler) -> Handler:
    """c10d's in-place MAX all-reduce of ``x.max(dim)``'s values: the maximum
    along ``dim`` of ``x`` all-gathered along it. Over a group of one rank
    (Megatron's at tensor-parallel size 1) any all-reduce of a computed
    value is the identity."""
    def lower(lw: Any, args, kwargs, shapes, group):
        tensors, op = args[0], args[2]
        if len(tensors) == 1 and len(_pg(lw, args[1])) == 1:
            x = _env(lw, tensors[0])
            if isinstance(x, Bucket):
                return [x]  # over a group of one rank: the identity
            if isinstance(x, int):
                return [lw.val(tensors[0])]
        if not (isinstance(op, (list, tuple)) and op[0] == "redop" and op[1] == REDOP_MAX):
            _refuse_pending(lw, tensors, "an all-reduce")
            return base(lw, args, kwargs, shapes, group)
        top = _env(lw, tensors[0]) if len(tensors) == 1 else None
        if not isinstance(top, RowMax):
            raise LoweringError(f"{lw.name}: a MAX all-reduce of anything but the values of "
                                f"x.max(dim) is not lowered")
        ranks = _pg(lw, args[1])
        shape = list(lw.shapes[top.x])
        shape[top.dim] *= len(ranks)
        rows = top.x if len(ranks) == 1 else lw.emit(  # a group of one rank: the identity
            "all_gather", [top.x], [shape], {"dim": top.dim}, group=ranks)[0]
        return [lw.emit("max", [rows], shapes[:1], {"dim": top.dim, "keepdim": top.keepdim})[0]]
    return lower


# -- the label mask and the local labels -----------------------------------------

def compare(op: str, base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        value = lw.const(args[1])
        if isinstance(_env(lw, args[0]), _IdRows) and value is not None:
            return Compare(args[0][1], op, int(value))
        _refuse_pending(lw, args, f"a comparison '{op}'")
        return base(lw, args, kwargs, shapes, group)
    return lower


def bitwise_or(base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        if isinstance(a, Compare) and isinstance(b, Compare) and a.src == b.src:
            low, high = (a, b) if a.op == "lt" else (b, a)
            if (low.op, high.op) == ("lt", "ge"):
                return OutOfRange(a.src, low.value, high.value, tuple(shapes[0]))
        _refuse_pending(lw, args, "an 'or'")
        return base(lw, args, kwargs, shapes, group)
    return lower


def sub(base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        value = lw.const(args[1]) if len(args) > 1 else None
        if isinstance(_env(lw, args[0]), _IdRows) and value is not None \
                and kwargs.get("alpha", 1) == 1:
            return Local(args[0][1], int(value), None, tuple(shapes[0]))
        _refuse_pending(lw, args, "a subtraction")
        return base(lw, args, kwargs, shapes, group)
    return lower


def view(base: Handler) -> Handler:
    """A mask, local labels or pick seen with another shape."""
    def lower(lw: Any, args, kwargs, shapes, group):
        x, shape = _env(lw, args[0]), tuple(shapes[0])
        if isinstance(x, (OutOfRange, Local)):
            return type(x)(**{**x.__dict__, "shape": shape})
        if isinstance(x, Pick):
            value = x.value if tuple(lw.shapes[x.value]) == shape else lw.reshape(x.value, shape)
            return Pick(x.x, x.local, value, shape)
        _refuse_pending(lw, args[:1], "a view")
        return base(lw, args, kwargs, shapes, group)
    return lower


def to_copy(base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, OutOfRange):
            return AsNumbers(x)
        _refuse_pending(lw, args[:1], "a conversion")
        return base(lw, args, kwargs, shapes, group)
    return lower


def rsub(base: Handler) -> Handler:
    """``1 - mask.float()``."""
    def lower(lw: Any, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, AsNumbers) and lw.const(args[1]) == 1 and kwargs.get("alpha", 1) == 1:
            return Inside(x.mask)
        _refuse_pending(lw, args, "a subtraction")
        return base(lw, args, kwargs, shapes, group)
    return lower


# -- the picks ----------------------------------------------------------------------

def _logits(lw: Any, a: Any) -> tuple[int, tuple[int, ...]] | None:
    """The logits a pick reads: a 2-d value ``[n, w]``, or a 3-d one
    ``[s, b, w]`` merged to ``[s * b, w]`` (``Merged``); and its rows' shape."""
    x = _env(lw, a)
    if isinstance(x, Merged) and not x.transposed:
        return x.x, tuple(lw.shapes[x.x][:2])
    if isinstance(x, int) and len(lw.shapes[x]) == 2:
        return x, (lw.shapes[x][0],)
    return None


def _rows_and_local(lw: Any, x: int, rows_shape: tuple[int, ...], indices: Any) -> Local | None:
    """The local labels of ``x2d[arange(n), local]``, or None."""
    if not isinstance(indices, (list, tuple)) or len(indices) != 2:
        return None
    local = _env(lw, indices[1])
    rows = constant_value(lw, indices[0])
    n = math.prod(rows_shape)
    if not isinstance(local, Local) or rows is None or not np.array_equal(rows, np.arange(n)):
        return None
    if local.mask is None or local.mask.lo != local.lo or local.mask.src != local.src \
            or local.mask.hi - local.lo != lw.shapes[x][-1] or local.shape != (n,):
        raise LoweringError(f"{lw.name}: a pick at local labels not masked to the logits' "
                            f"vocabulary rows is not lowered")
    return local


def _label_columns(lw: Any, local: Local, x: int, rows_shape: tuple[int, ...]) -> int:
    """The one-hot columns of ``local``'s range shaped as ``x``'s rows: the
    labels' one-hot rows as they are when their shape is ``rows_shape``."""
    src = lw.env.get(local.src)
    onehot = src.x if isinstance(src, _IdRows) else one_hot_of(lw, src)
    shape = tuple(lw.shapes[onehot][:-1]) if tuple(lw.shapes[onehot][:-1]) == rows_shape \
        else rows_shape
    return _columns(lw, local, lw.shapes[x][-1], shape)


def index(base: Handler) -> Handler:
    """``x2d[arange(n), local]`` (``Pick``)."""
    def lower(lw: Any, args, kwargs, shapes, group):
        found = _logits(lw, args[0])
        local = _rows_and_local(lw, found[0], found[1], args[1]) if found else None
        if local is None:
            _refuse_pending(lw, [args[0], *(args[1] if isinstance(args[1], (list, tuple))
                                            else [])], "an index")
            return base(lw, args, kwargs, shapes, group)
        x, rows_shape = found
        columns = _label_columns(lw, local, x, rows_shape)
        picked = lw.emit("mul", [x, columns], [lw.shapes[x]])[0]
        value = lw.emit("sum", [picked], [rows_shape], {"dim": len(rows_shape),
                                                        "keepdim": False})[0]
        return Pick(x, local, value, rows_shape)
    return lower


def sub_inplace(base: Handler) -> Handler:
    """``pick -= 1 - mask.float()`` (the backward's update)."""
    def lower(lw: Any, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        if isinstance(a, Pick) and isinstance(b, Inside) and kwargs.get("alpha", 1) == 1:
            if a.local.mask is None or a.local.mask.key() != b.mask.key():
                raise LoweringError(f"{lw.name}: a pick updated by another range's mask")
            return PickMinusInside(a.x, a.local)
        _refuse_pending(lw, args, "an in-place subtraction")
        return base(lw, args, kwargs, shapes, group)
    return lower


def index_put(base: Handler) -> Handler:
    """``local[mask] = 0``; ``pick[mask] = 0``; ``x2d[arange(n), local] =
    pick - (1 - mask.float())``."""
    def lower(lw: Any, args, kwargs, shapes, group):
        target, value = _env(lw, args[0]), _env(lw, args[2])
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        accumulate = bool(args[3]) if len(args) > 3 else False
        mask = _env(lw, indices[0]) if len(indices) == 1 else None
        zero = lw.const(args[2]) == 0
        if isinstance(target, Local) and isinstance(mask, OutOfRange) and zero \
                and not accumulate and target.mask is None \
                and (target.src, target.lo) == (mask.src, mask.lo):
            return Local(target.src, target.lo, mask, target.shape)
        if isinstance(target, Pick):
            if not (isinstance(mask, OutOfRange) and zero and not accumulate
                    and target.local.mask is not None and mask.key() == target.local.mask.key()):
                raise LoweringError(f"{lw.name}: picked logits not zeroed outside the "
                                    f"vocabulary rows by their mask")
            return target.value
        if isinstance(value, PickMinusInside):
            found = _logits(lw, args[0])
            local = _rows_and_local(lw, found[0], found[1], indices) if found else None
            if found is None or found[0] != value.x or local != value.local or accumulate:
                raise LoweringError(f"{lw.name}: an update of picked logits written back "
                                    f"elsewhere is not lowered")
            x, rows_shape = found
            columns = _label_columns(lw, local, x, rows_shape)
            return lw.emit("sub", [x, columns], [lw.shapes[x]])[0]
        _refuse_pending(lw, [args[0], args[2], *indices], "index_put_")
        return base(lw, args, kwargs, shapes, group)
    return lower


# -- the backward of VocabParallelEmbedding -------------------------------------------

@dataclass(frozen=True)
class MaskedGrad(_Pending):
    """``g`` with the rows of ids outside a vocabulary shard zeroed (the
    backward of the lookup's ``out[mask] = 0``), read only by the lookup's
    backward."""
    g: int
    mask: _VocabMask


def index_put_copy(base: Handler) -> Handler:
    """``index_put(g, [mask], 0)`` (out of place) with a vocabulary shard's mask."""
    def lower(lw: Any, args, kwargs, shapes, group):
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        mask = _env(lw, indices[0]) if len(indices) == 1 else None
        accumulate = bool(args[3]) if len(args) > 3 else False
        if isinstance(mask, _VocabMask) and lw.const(args[2]) == 0 and not accumulate \
                and isinstance(_env(lw, args[0]), int):
            return MaskedGrad(lw.val(args[0]), mask)
        _refuse_pending(lw, [args[0], args[2], *indices], "index_put")
        return base(lw, args, kwargs, shapes, group)
    return lower


def embedding_backward(base: Handler) -> Handler:
    """The backward of a vocabulary-parallel lookup (ids shifted by ``lo``, 0
    outside ``[lo, hi)``) of a gradient zeroed outside: the one-hot columns
    ``[lo, hi)`` transposed times the gradient (a masked id's row, picked
    at local row 0, brings a zero row)."""
    def lower(lw: Any, args, kwargs, shapes, group):
        g, ids = _env(lw, args[0]), _env(lw, args[1])
        if not isinstance(g, MaskedGrad):
            _refuse_pending(lw, args[:2], "an embedding backward")
            return base(lw, args, kwargs, shapes, group)
        rows = int(args[2])
        padding = args[3] if len(args) > 3 else -1
        if not isinstance(ids, _Shifted) or ids.mask != g.mask or ids.mask.lo != ids.lo \
                or ids.mask.hi - ids.lo != rows or (len(args) > 4 and args[4]) \
                or (padding is not None and int(padding) >= 0):
            raise LoweringError(f"{lw.name}: the backward of a masked gradient other than by "
                                f"its vocabulary-parallel lookup is not lowered")
        if rows <= 0 or lw.vocab % rows or ids.lo % rows:
            raise LoweringError(f"{lw.name}: a lookup of the rows [{ids.lo}, {ids.lo + rows}) "
                                f"is not one of equal vocabulary shards")
        onehot = _one_hot(lw, ("v", _ids_value(lw, ids.ids)))
        shape = [*lw.shapes[onehot][:-1], rows]
        part = onehot if rows == lw.vocab else lw.emit(
            "split", [onehot], [shape], {"dim": len(shape) - 1, "parts": lw.vocab // rows,
                                         "index": ids.lo // rows})[0]
        out = lw.new(shapes[0])
        lw.nodes.append(LNode("embedding", "bw", [part, -1, g.g], [-1, out], {}, lw.name, None,
                              lw.mb))
        return out
    return lower


# -- zeroed memory ---------------------------------------------------------------------

@dataclass(frozen=True)
class Zeroed:
    """``t.zero_()``: zeros of ``shape`` (a gradient buffer's view before the
    backward adds into it); an addition of it is the other operand."""
    shape: tuple[int, ...]

    def emit_into(self, lw: Any) -> int:
        return lw.emit("zeros", [], [self.shape], {"shape": list(self.shape)}, direction="none")[0]


def zero_(lw: Any, args, kwargs, shapes, group):
    _refuse_pending(lw, args[:1], "zero_")
    return Zeroed(tuple(shapes[0]))


def add_zero(base: Handler) -> Handler:
    """``zeros + x`` (``main_grad.add_(grad)`` into a zeroed buffer) is x."""
    def lower(lw: Any, args, kwargs, shapes, group):
        for i in (0, 1):
            if len(args) > 1 and isinstance(_env(lw, args[i]), Zeroed) \
                    and isinstance(args[1 - i], (list, tuple)) and kwargs.get("alpha", 1) == 1:
                x = lw.val(args[1 - i])
                if tuple(lw.shapes[x]) == tuple(shapes[0]):
                    return x
        return base(lw, args, kwargs, shapes, group)
    return lower


# -- a flat buffer of gradients built by hand ---------------------------------------------

def cat_flat(base: Handler) -> Handler:
    """``torch.cat`` of 1-d tensors along dim 0 that only in-place all-reduces
    read (``_flatten_dense_tensors`` of the sequence-parallel gradients in
    ``finalize_model_grads``): a ``Bucket`` of them, all-reduced piece by
    piece (lower_buckets). A part that is another value flattened (a
    ``view(-1)`` of a 2-d gradient) is that value in the bucket, with its
    own shape: its elements in the same order."""
    def lower(lw: Any, args, kwargs, shapes, group):
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        parts = args[0] if isinstance(args[0], (list, tuple)) else []
        outs = lw.trace["events"][lw.event][2]
        if dim == 0 and parts and all(isinstance(_env(lw, a), int) for a in parts) \
                and all(len(lw.shapes[lw.val(a)]) == 1 for a in parts):
            readers = _readers(lw, outs[0])
            if readers and all(e[0] == "c10d.allreduce_.default" for e in readers):
                return Bucket(tuple(lw.flat_of.get(lw.val(a), lw.val(a)) for a in parts))
        return base(lw, args, kwargs, shapes, group)
    return lower


def slice_bucket(base: Handler) -> Handler:
    """``flat[a:b]`` of a bucket (``_unflatten_dense_tensors``): its pieces there."""
    def lower(lw: Any, args, kwargs, shapes, group):
        b = _env(lw, args[0])
        if not isinstance(b, Bucket):
            return base(lw, args, kwargs, shapes, group)
        dim = int(args[1]) if len(args) > 1 else 0
        start = int(args[2]) if len(args) > 2 and args[2] is not None else 0
        step = int(args[4]) if len(args) > 4 else 1
        if dim != 0 or step != 1:
            raise LoweringError(f"{lw.name}: a strided slice of a gradient bucket is not lowered")
        return bucket_view(lw, b, start, tuple(shapes[0]))
    return lower


# -- a 2-d matmul of a 3-d value with its leading dims merged ------------------------

@dataclass(frozen=True)
class Merged:
    """``x`` ``[a, b, c]`` seen as ``[a * b, c]`` (``transposed``: then as its
    transpose ``[c, a * b]``), read only by ``mm``: kept 3-d, so that a piece
    of either leading dim (a data-parallel cut of the batch of Megatron's
    ``[s, b, h]`` activations) stays a piece. Any other reader gets the
    flattened value."""
    x: int
    transposed: bool = False

    def emit_into(self, lw: Any) -> int:
        a, b, c = lw.shapes[self.x]
        flat = lw.emit("flatten", [self.x], [(a * b, c)], {"start": 0, "end": 1})[0]
        if not self.transposed:
            return flat
        return lw.emit("transpose", [flat], [(c, a * b)], {"dim0": 0, "dim1": 1})[0]


def _only_mm_reads(lw: Any, value: int) -> bool:
    readers = _readers(lw, value)
    for e in readers:
        if e[0] == "aten.t.default":
            if not all(r[0] == "aten.mm.default" for r in _readers(lw, e[2][0])):
                return False
        elif e[0] == "aten.sum.dim_IntList":
            dims = e[1][0][1] if len(e[1][0]) > 1 else None
            keep = e[1][0][2] if len(e[1][0]) > 2 else False
            if list(dims or []) != [0] or keep:
                return False
        elif e[0] not in ("aten.mm.default", "aten.index.Tensor", "aten.index_put_.default"):
            return False
    return bool(readers)


def view_merged(base: Handler) -> Handler:
    """``x.view(a * b, c)`` of a 3-d ``x`` read only by ``mm`` (``Merged``), in
    the step of a model whose activations are sequence first (``[s, b, h]``:
    the model's ``sequence_first``, Megatron's layout), where the batch dim
    is the inner one of the two merged; the 3-d product seen again as
    ``[a, b, n]``."""
    def lower(lw: Any, args, kwargs, shapes, group):
        x, dst = _env(lw, args[0]), tuple(shapes[0])
        if isinstance(x, Merged) and not x.transposed and len(dst) == 3 \
                and tuple(lw.shapes[x.x]) == dst:
            return x.x
        if x is not None and not isinstance(x, (_Pending, Merged, Bucket)) \
                and lw.trace.get("sequence_first") and len(dst) == 2:
            outs = lw.trace["events"][lw.event][2]
            shape = tuple(lw.trace["shapes"][args[0][1]])
            if len(shape) == 3 and dst == (shape[0] * shape[1], shape[2]) \
                    and _only_mm_reads(lw, outs[0]):
                return Merged(lw.val(args[0]))  # a pending gather is emitted here
        return base(lw, args, kwargs, shapes, group)
    return lower


def t_merged(base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, Merged) and not x.transposed:
            return Merged(x.x, True)
        return base(lw, args, kwargs, shapes, group)
    return lower


def mm_merged(base: Handler) -> Handler:
    """``mm`` of merged values as one ``einsum`` over the 3-d values:
    ``[ab, c] @ [c, n]`` is ``abc,cn->abn`` (seen as ``[a, b, n]``, a
    ``Merged`` value), ``[n, ab] @ [ab, c]`` is ``abn,abc->nc``."""
    def lower(lw: Any, args, kwargs, shapes, group):
        x, y = _env(lw, args[0]), _env(lw, args[1])
        if isinstance(x, Merged) and not x.transposed and isinstance(y, int):
            a, b, c = lw.shapes[x.x]
            n = lw.shapes[lw.val(args[1])][1]
            out = lw.emit("einsum", [x.x, lw.val(args[1])], [(a, b, n)], {"eq": "abc,cn->abn"})[0]
            return Merged(out)
        if isinstance(x, Merged) and x.transposed and isinstance(y, Merged) \
                and not y.transposed and lw.shapes[x.x][:2] == lw.shapes[y.x][:2]:
            n, c = lw.shapes[x.x][2], lw.shapes[y.x][2]
            return lw.emit("einsum", [x.x, y.x], [(n, c)], {"eq": "abn,abc->nc"})[0]
        return base(lw, args, kwargs, shapes, group)
    return lower


def all_reduce_coalesced(all_reduce: Handler) -> Handler:
    """c10d's ``allreduce_coalesced_`` (Megatron's coalescing manager around
    its buckets' all-reduces): each tensor all-reduced in place, as one
    ``allreduce_`` of it."""
    def lower(lw: Any, args, kwargs, shapes, group):
        out = []
        for t, shape in zip(args[0], shapes):
            out += all_reduce(lw, [[t], args[1], args[2], None], {}, [shape], group)
        return out
    return lower


def sum_merged(base: Handler) -> Handler:
    """``sum(x.view(a * b, c), 0)`` (a bias's gradient): the sum over both
    leading dims of x."""
    def lower(lw: Any, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, Merged) and not x.transposed:
            return lw.emit("sum", [x.x], shapes, {"dim": [0, 1], "keepdim": False})[0]
        return base(lw, args, kwargs, shapes, group)
    return lower


def out_form(base: Handler) -> Handler:
    """``op(x, out=y)``: the op's value (the recorder renames ``y`` to it)."""
    def lower(lw: Any, args, kwargs, shapes, group):
        return base(lw, args, {k: v for k, v in kwargs.items() if k != "out"}, shapes, group)
    return lower


def megatron_handlers(table: dict[str, Handler]) -> dict[str, Handler]:
    """The entries this module wraps in ``table`` (lower.py's, complete)."""
    return {
        "aten.max.dim": max_dim(table["aten.max.dim"]),
        "c10d.allreduce_.default": all_reduce_inplace(table["c10d.allreduce_.default"]),
        "aten.lt.Scalar": compare("lt", table["aten.lt.Scalar"]),
        "aten.ge.Scalar": compare("ge", table["aten.ge.Scalar"]),
        "aten.bitwise_or.Tensor": bitwise_or(table["aten.bitwise_or.Tensor"]),
        "aten.sub.Tensor": sub(table["aten.sub.Tensor"]),
        "aten.view.default": view_merged(view(table["aten.view.default"])),
        "aten._unsafe_view.default": view_merged(table["aten._unsafe_view.default"]),
        "aten.t.default": t_merged(table["aten.t.default"]),
        "aten.mm.default": mm_merged(table["aten.mm.default"]),
        "aten.sum.dim_IntList": sum_merged(table["aten.sum.dim_IntList"]),
        "aten._to_copy.default": to_copy(table["aten._to_copy.default"]),
        "aten.rsub.Scalar": rsub(table["aten.rsub.Scalar"]),
        "aten.index.Tensor": index(table["aten.index.Tensor"]),
        "aten.sub_.Tensor": sub_inplace(table.get("aten.sub_.Tensor", table["aten.sub.Tensor"])),
        "aten.index_put_.default": index_put(table["aten.index_put_.default"]),
        "aten.exp.out": out_form(table["aten.exp.default"]),
        "aten.zero_.default": zero_,
        "c10d.allreduce_coalesced_.default": all_reduce_coalesced(
            all_reduce_inplace(table["c10d.allreduce_.default"])),
        "aten.cat.default": cat_flat(table["aten.cat.default"]),
        "aten.slice.Tensor": slice_bucket(table["aten.slice.Tensor"]),
        "aten.add_.Tensor": add_zero(table["aten.add_.Tensor"]),
        "aten.add.Tensor": add_zero(table["aten.add.Tensor"]),
        "aten.index_put.default": index_put_copy(table.get("aten.index_put.default",
                                                           table["aten.index_put_.default"])),
        "aten.embedding_dense_backward.default":
            embedding_backward(table["aten.embedding_dense_backward.default"]),
    }
