"""Lowering of a vocabulary-parallel cross-entropy written with c10d's
in-place collectives and tensor writes (Megatron-Core's
``tensor_parallel/cross_entropy.py``), and of a vocabulary-parallel
lookup's backward; docs/soundness.md, "Plans traced from PyTorch", 35
(c) to (f).

The loss of logits ``x`` ``[S, B, V/t]`` (the rank's vocabulary rows
``[lo, hi)``) against labels ``[S, B]`` (one-hot rows in the plan):

- ``m = x.max(-1)[0]`` all-reduced with MAX: the maximum along the
  vocabulary of ``x`` all-gathered along it (max is associative,
  commutative and idempotent); the plan proves the gathered pieces are the
  logits' columns in order;
- ``mask = (labels < lo) | (labels >= hi)``, ``local = labels - lo``,
  ``local[mask] = 0``; ``x.view(-1, w)[arange(n), local.view(-1)]``, the
  picks then zeroed where ``mask`` holds: the row sum of ``x`` times the
  one-hot labels' columns ``[lo, hi)`` (in-range rows pick the same entry,
  the others are 0 both ways);
- the backward's ``g2d[arange(n), local] -= 1 - mask.float()`` (an
  ``index`` at the same places, ``sub_``, ``index_put_`` back): ``g2d``
  minus the one-hot columns ``[lo, hi)``.

Every helper (a comparison, the mask, the local labels, a pick) is a
pending value only the next op of these rules may read; any other reader
stops the run with one line. Each rule is the op's value at those
arguments for every input, so the same ops written by any code lower the
same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_value
from backends.torch.lowering.context import LNode, pg, tensor_args
from backends.torch.lowering.ir import IdRows, Merged, PatternOnly, Pending, Shifted, VocabMask
from backends.torch.lowering.onehot import ids_value, one_hot, one_hot_of
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: c10d's ReduceOp.MAX
REDOP_MAX = 4


class Helper(PatternOnly):
    """A label mask, local labels or pick: read only by the rules of this module."""

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a vocabulary-parallel label mask, local labels or "
                            f"pick ({type(self).__name__}) is read outside the cross-entropy "
                            f"rules (backends/torch/lowering/vocab_picks.py)")


@dataclass(frozen=True)
class LabelTest(Helper):
    """``labels < value`` (op "lt") or ``labels >= value`` (op "ge")."""
    src: int  # the recorded value holding the labels (one-hot rows in the plan)
    op: str
    value: int


@dataclass(frozen=True)
class OutOfRange(Helper):
    """``(labels < lo) | (labels >= hi)``, seen with ``shape``."""
    src: int
    lo: int
    hi: int
    shape: tuple[int, ...]

    def key(self) -> tuple[int, int, int]:
        return (self.src, self.lo, self.hi)


@dataclass(frozen=True)
class AsNumbers(Helper):
    """``mask.float()``."""
    mask: OutOfRange


@dataclass(frozen=True)
class Inside(Helper):
    """``1 - mask.float()``: 1 for the labels in ``[lo, hi)``."""
    mask: OutOfRange


@dataclass(frozen=True)
class Local(Helper):
    """``labels - lo`` (then 0 where ``mask`` holds), seen with ``shape``."""
    src: int
    lo: int
    mask: OutOfRange | None
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Pick(Helper):
    """``x2d[arange(n), local]``: ``value`` is the row sum of ``x2d`` times the
    one-hot columns of the local labels' range (seen with ``shape``), equal
    to the pick once the out-of-range picks are zeroed."""
    x: int
    local: Local
    value: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PickMinusInside(Helper):
    """``x2d[arange(n), local] - (1 - mask.float())``."""
    x: int
    local: Local


@dataclass(frozen=True)
class MaskedGrad(Helper):
    """``g`` with the rows of ids outside a vocabulary shard zeroed (the
    backward of the lookup's ``out[mask] = 0``), read only by the lookup's
    backward. ``mask``: of the batch's ids (``VocabMask``) or of ids the
    model computed (``OutOfRange``)."""
    g: int
    mask: VocabMask | OutOfRange


@dataclass(frozen=True)
class RowsLookup(Helper):
    """A vocabulary-parallel lookup of computed ids (``Local`` masked by
    ``mask``): ``out`` is the one-hot columns ``[lo, hi)`` times the local
    table, zero for ids outside the rows, where the recorded lookup still
    holds table row 0 until ``out[mask] = 0``, the one reader allowed."""
    out: int
    mask: OutOfRange


@dataclass(frozen=True)
class MaxValues(Pending):
    """``x.max(dim)``'s values read only by a MAX all-reduce, not yet emitted
    (any other reader gets the local maximum)."""
    x: int
    dim: int
    keepdim: bool

    def materialize(self, lw: Lowerer) -> int:
        shape = list(lw.shapes[self.x])
        if self.keepdim:
            shape[self.dim] = 1
        else:
            del shape[self.dim]
        return lw.emit("max", [self.x], [shape], {"dim": self.dim, "keepdim": self.keepdim})[0]


class Unread(Helper):
    """An output no later op reads."""


def _env(lw: Lowerer, a: Any) -> Any:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v":
        return lw.env.get(a[1])
    return None


def _refuse_helpers(lw: Lowerer, args: Any, what: str) -> None:
    for a in args if isinstance(args, (list, tuple)) else [args]:
        if isinstance(_env(lw, a), Helper):
            raise LoweringError(f"{lw.name}: {what} reads a vocabulary-parallel label mask, "
                                f"local labels or pick outside the cross-entropy rules "
                                f"(backends/torch/lowering/vocab_picks.py)")


def readers(lw: Lowerer, value: int) -> list[tuple]:
    """The events after the current one that read ``value``."""
    return [e for e in lw.trace["events"][lw.event + 1:] if value in tensor_args(e[1])]


def _columns(lw: Lowerer, local: Local, width: int, shape: tuple[int, ...]) -> int:
    """The one-hot rows of the labels ``local`` shifts, seen with ``shape``
    (without the vocabulary) in row-major order, columns ``[lo, lo + width)``."""
    src = lw.env.get(local.src)
    onehot = src.x if isinstance(src, IdRows) else one_hot_of(lw, src)
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


# -- the MAX all-reduce of row maxima ------------------------------------------------

@refines("aten.max.dim")
def max_dim(base: Handler) -> Handler:
    """``x.max(dim)`` whose values only a MAX all-reduce reads and whose
    indices nothing reads: pending values (``MaxValues``); else the base's."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        outs = lw.trace["events"][lw.event][2]
        if len(outs) == 2 and not readers(lw, outs[1]):
            found = readers(lw, outs[0])
            if found and all(e[0] == "c10d.allreduce_.default"
                             and tuple(e[1][0][2]) == ("redop", REDOP_MAX) for e in found):
                x = lw.val(args[0])
                dim = int(args[1] if len(args) > 1 else kwargs["dim"]) % len(lw.shapes[x])
                keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
                return [MaxValues(x, dim, keepdim), Unread()]
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("c10d.allreduce_.default")
def all_reduce_max(base: Handler) -> Handler:
    """c10d's in-place MAX all-reduce of ``x.max(dim)``'s values: the maximum
    along ``dim`` of ``x`` all-gathered along it."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        tensors, op = args[0], args[2]
        if not (isinstance(op, (list, tuple)) and op[0] == "redop" and op[1] == REDOP_MAX):
            _refuse_helpers(lw, tensors, "an all-reduce")
            return base(lw, args, kwargs, shapes, group)
        top = _env(lw, tensors[0]) if len(tensors) == 1 else None
        if not isinstance(top, MaxValues):
            return base(lw, args, kwargs, shapes, group)
        ranks = pg(lw, args[1])
        shape = list(lw.shapes[top.x])
        shape[top.dim] *= len(ranks)
        rows = top.x if len(ranks) == 1 else lw.emit(  # a group of one rank: the identity
            "all_gather", [top.x], [shape], {"dim": top.dim}, group=ranks)[0]
        return [lw.emit("max", [rows], shapes[:1], {"dim": top.dim, "keepdim": top.keepdim})[0]]
    return lower


# -- the label mask and the local labels -----------------------------------------

def compare(op: str):
    def refine(base: Handler) -> Handler:
        def lower(lw: Lowerer, args, kwargs, shapes, group):
            value = lw.const(args[1])
            if isinstance(_env(lw, args[0]), IdRows) and value is not None:
                return LabelTest(args[0][1], op, int(value))
            _refuse_helpers(lw, args, f"a comparison '{op}'")
            return base(lw, args, kwargs, shapes, group)
        return lower
    return refine


refines("aten.lt.Scalar")(compare("lt"))
refines("aten.ge.Scalar")(compare("ge"))


@refines("aten.bitwise_or.Tensor")
def bitwise_or(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        if isinstance(a, LabelTest) and isinstance(b, LabelTest) and a.src == b.src:
            low, high = (a, b) if a.op == "lt" else (b, a)
            if (low.op, high.op) == ("lt", "ge"):
                return OutOfRange(a.src, low.value, high.value, tuple(shapes[0]))
        _refuse_helpers(lw, args, "an 'or'")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.sub.Tensor")
def sub(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        value = lw.const(args[1]) if len(args) > 1 else None
        if isinstance(_env(lw, args[0]), IdRows) and value is not None \
                and kwargs.get("alpha", 1) == 1:
            return Local(args[0][1], int(value), None, tuple(shapes[0]))
        _refuse_helpers(lw, args, "a subtraction")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.view.default")
def view(base: Handler) -> Handler:
    """A mask, local labels or pick seen with another shape."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x, shape = _env(lw, args[0]), tuple(shapes[0])
        if isinstance(x, (OutOfRange, Local)):
            return type(x)(**{**x.__dict__, "shape": shape})
        if isinstance(x, Pick):
            value = x.value if tuple(lw.shapes[x.value]) == shape else lw.reshape(x.value, shape)
            return Pick(x.x, x.local, value, shape)
        _refuse_helpers(lw, args[:1], "a view")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten._to_copy.default")
def to_copy(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, OutOfRange):
            return AsNumbers(x)
        _refuse_helpers(lw, args[:1], "a conversion")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.rsub.Scalar")
def rsub(base: Handler) -> Handler:
    """``1 - mask.float()``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, AsNumbers) and lw.const(args[1]) == 1 and kwargs.get("alpha", 1) == 1:
            return Inside(x.mask)
        _refuse_helpers(lw, args, "a subtraction")
        return base(lw, args, kwargs, shapes, group)
    return lower


# -- the picks ----------------------------------------------------------------------

def _logits(lw: Lowerer, a: Any) -> tuple[int, tuple[int, ...]] | None:
    """The logits a pick reads: a 2-d value ``[n, w]``, or a 3-d one
    ``[s, b, w]`` merged to ``[s * b, w]`` (``Merged``); and its rows' shape."""
    x = _env(lw, a)
    if isinstance(x, Merged) and not x.transposed:
        return x.x, tuple(lw.shapes[x.x][:2])
    if isinstance(x, int) and len(lw.shapes[x]) == 2:
        return x, (lw.shapes[x][0],)
    return None


def _rows_and_local(lw: Lowerer, x: int, rows_shape: tuple[int, ...],
                    indices: Any) -> Local | None:
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


def _label_columns(lw: Lowerer, local: Local, x: int, rows_shape: tuple[int, ...]) -> int:
    """The one-hot columns of ``local``'s range shaped as ``x``'s rows: the
    labels' one-hot rows paired with the logits' rows by flat position."""
    src = lw.env.get(local.src)
    onehot = src.x if isinstance(src, IdRows) else one_hot_of(lw, src)
    shape = tuple(lw.shapes[onehot][:-1]) if tuple(lw.shapes[onehot][:-1]) == rows_shape \
        else rows_shape
    return _columns(lw, local, lw.shapes[x][-1], shape)


@refines("aten.index.Tensor")
def index(base: Handler) -> Handler:
    """``x2d[arange(n), local]`` (``Pick``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        found = _logits(lw, args[0])
        local = _rows_and_local(lw, found[0], found[1], args[1]) if found else None
        if local is None:
            _refuse_helpers(lw, [args[0], *(args[1] if isinstance(args[1], (list, tuple))
                                            else [])], "an index")
            return base(lw, args, kwargs, shapes, group)
        x, rows_shape = found
        columns = _label_columns(lw, local, x, rows_shape)
        picked = lw.emit("mul", [x, columns], [lw.shapes[x]])[0]
        value = lw.emit("sum", [picked], [rows_shape], {"dim": len(rows_shape),
                                                        "keepdim": False})[0]
        return Pick(x, local, value, rows_shape)
    return lower


@refines("aten.sub_.Tensor")
def sub_inplace(base: Handler) -> Handler:
    """``pick -= 1 - mask.float()`` (the backward's update)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        if isinstance(a, Pick) and isinstance(b, Inside) and kwargs.get("alpha", 1) == 1:
            if a.local.mask is None or a.local.mask.key() != b.mask.key():
                raise LoweringError(f"{lw.name}: a pick updated by another range's mask")
            return PickMinusInside(a.x, a.local)
        _refuse_helpers(lw, args, "an in-place subtraction")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.index_put_.default")
def index_put(base: Handler) -> Handler:
    """``local[mask] = 0``; ``pick[mask] = 0``; ``x2d[arange(n), local] =
    pick - (1 - mask.float())``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        target, value = _env(lw, args[0]), _env(lw, args[2])
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        accumulate = bool(args[3]) if len(args) > 3 else False
        mask = _env(lw, indices[0]) if len(indices) == 1 else None
        zero = lw.const(args[2]) == 0
        if isinstance(target, Local) and isinstance(mask, OutOfRange) and zero \
                and not accumulate and target.mask is None \
                and (target.src, target.lo) == (mask.src, mask.lo):
            return Local(target.src, target.lo, mask, target.shape)
        if isinstance(target, RowsLookup):
            if not (isinstance(mask, OutOfRange) and zero and not accumulate
                    and mask.key() == target.mask.key()):
                raise LoweringError(f"{lw.name}: a vocabulary-parallel lookup not zeroed "
                                    f"outside the shard's rows by its mask")
            return target.out
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
        _refuse_helpers(lw, [args[0], args[2], *indices], "index_put_")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.exp.out", base="aten.exp.default")
def exp_out(base: Handler) -> Handler:
    """``exp(x, out=y)``: ``exp(x)`` (the recorder names ``y`` as its result)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        return base(lw, args, {k: v for k, v in kwargs.items() if k != "out"}, shapes, group)
    return lower


# -- a vocabulary-parallel lookup of computed ids, and its backward -----------------

def _lookup_columns(lw: Lowerer, local: Local, rows: int) -> int:
    """The one-hot columns ``[lo, lo + rows)`` of the ids ``local`` shifts
    (seen with its shape), for a lookup of a table of ``rows`` rows: the
    ids must be masked to exactly those rows."""
    if local.mask is None or local.mask.lo != local.lo or local.mask.hi - local.lo != rows:
        raise LoweringError(f"{lw.name}: a lookup of ids not masked to its table's "
                            f"{rows} rows is not lowered")
    return _columns(lw, local, rows, local.shape)


@refines("aten.embedding.default")
def embedding(base: Handler) -> Handler:
    """``embedding(local, w)`` with ``local`` computed ids shifted by ``lo``
    and 0 outside ``[lo, hi)`` (Megatron's ``VocabParallelEmbedding`` of ids
    the model rolled): the one-hot columns ``[lo, hi)`` times ``w``, equal to
    the recorded lookup once the rows of ids outside are zeroed
    (``RowsLookup``); docs/soundness.md, "Plans traced from PyTorch",
    49."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        ids = _env(lw, args[1])
        if not isinstance(ids, Local):
            return base(lw, args, kwargs, shapes, group)
        w = lw.val(args[0])
        if len(args) > 2 and args[2] is not None and int(args[2]) >= 0:
            raise LoweringError(f"{lw.name}: a vocabulary-parallel lookup with a padding_idx "
                                f"is not lowered")
        part = _lookup_columns(lw, ids, lw.shapes[w][0])
        out = lw.emit("embedding", [part, w], shapes)[0]
        return RowsLookup(out, ids.mask)
    return lower


# -- the backward of a vocabulary-parallel lookup -------------------------------------

@refines("aten.index_put.default")
def index_put_copy(base: Handler) -> Handler:
    """``index_put(g, [mask], 0)`` (out of place) with a vocabulary shard's mask."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        mask = _env(lw, indices[0]) if len(indices) == 1 else None
        accumulate = bool(args[3]) if len(args) > 3 else False
        if isinstance(mask, (VocabMask, OutOfRange)) and lw.const(args[2]) == 0 \
                and not accumulate and isinstance(_env(lw, args[0]), int):
            return MaskedGrad(lw.val(args[0]), mask)
        _refuse_helpers(lw, [args[0], args[2], *indices], "index_put")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.embedding_dense_backward.default")
def embedding_backward(base: Handler) -> Handler:
    """The backward of a vocabulary-parallel lookup (ids shifted by ``lo``, 0
    outside ``[lo, hi)``) of a gradient zeroed outside: the one-hot columns
    ``[lo, hi)`` transposed times the gradient (a masked id's row, picked
    at local row 0, brings a zero row)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        g, ids = _env(lw, args[0]), _env(lw, args[1])
        if not isinstance(g, MaskedGrad):
            _refuse_helpers(lw, args[:2], "an embedding backward")
            return base(lw, args, kwargs, shapes, group)
        rows = int(args[2])
        padding = args[3] if len(args) > 3 else -1
        if isinstance(g.mask, OutOfRange):
            if not isinstance(ids, Local) or ids.mask is None or ids.mask.key() != g.mask.key() \
                    or (len(args) > 4 and args[4]) or (padding is not None and int(padding) >= 0):
                raise LoweringError(f"{lw.name}: the backward of a masked gradient other than "
                                    f"by its vocabulary-parallel lookup is not lowered")
            part = _lookup_columns(lw, ids, rows)
            out = lw.new(shapes[0])
            lw.nodes.append(LNode("embedding", "bw", [part, -1, g.g], [-1, out], {}, lw.name,
                                  None, lw.mb))
            return out
        if not isinstance(ids, Shifted) or ids.mask != g.mask or ids.mask.lo != ids.lo \
                or ids.mask.hi - ids.lo != rows or (len(args) > 4 and args[4]) \
                or (padding is not None and int(padding) >= 0):
            raise LoweringError(f"{lw.name}: the backward of a masked gradient other than by "
                                f"its vocabulary-parallel lookup is not lowered")
        if rows <= 0 or lw.vocab % rows or ids.lo % rows:
            raise LoweringError(f"{lw.name}: a lookup of the rows [{ids.lo}, {ids.lo + rows}) "
                                f"is not one of equal vocabulary shards")
        onehot = one_hot(lw, ("v", ids_value(lw, ids.ids)))
        shape = [*lw.shapes[onehot][:-1], rows]
        part = onehot if rows == lw.vocab else lw.emit(
            "split", [onehot], [shape], {"dim": len(shape) - 1, "parts": lw.vocab // rows,
                                         "index": ids.lo // rows})[0]
        out = lw.new(shapes[0])
        lw.nodes.append(LNode("embedding", "bw", [part, -1, g.g], [-1, out], {}, lw.name, None,
                              lw.mb))
        return out
    return lower
