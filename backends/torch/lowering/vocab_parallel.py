"""Lowering of vocabulary-parallel code: the cross-entropy of logits sharded
along the vocabulary (loss parallelism) and torchtitan's own masked lookup.

Two implementations record the same local ops and are lowered here:
DTensor's ``loss_parallel()`` (``torch/distributed/tensor/parallel/loss.py``)
and torchtitan's ``_LossParallelCrossEntropy``. On the rank holding the
vocabulary rows ``[lo, hi)`` of logits ``x``:

- the stable log-softmax: ``m = all_reduce_max(amax(x))``, ``x - m``,
  ``exp``, a row ``sum``, ``all_reduce_sum``, ``log``, a subtraction. The
  MAX all-reduce of the local row maxima is lowered as the maximum of the
  all-gathered rows (``all_gather`` along the vocabulary, ``max``): the
  same value for every input (max is associative and commutative), and one
  the verifier proves to be the single-device ``max``;
- the target logit: labels shifted by ``lo`` and set to 0 outside
  ``[lo, hi)``, ``gather``, the picked values zeroed outside, a SUM
  all-reduce. Lowered as the row sum of the log-probabilities times the
  one-hot labels' columns ``[lo, hi)``, which is exactly what the masked
  gather holds (docs/torch-backend.md, "Folds");
- the fused backward ``(grad_input + exp(logp)) * g`` with ``grad_input``
  -1 at the local label (``index_put_`` of ``mask - 1`` into zeros):
  ``-onehot[:, lo:hi]``.

Every helper value (a mask, a shifted id, a float copy of a mask) is a
pending object that only the next op of the pattern may read; any other
use stops the run with one line naming it. Imported by ``lowering/``, whose
table it extends (``vocab_parallel_handlers``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_value
from backends.torch.lowering.context import LNode
from backends.torch.lowering.devices import on_cpu
from backends.torch.lowering.ir import (
    Const,
    Flag,
    FlagLike,
    Ids,
    IdsTest,
    PatternOnly,
    Pending,
    RowMax,
    Shifted,
    VocabMask,
    Zeros,
)
from backends.torch.lowering.mask_values import Quotient, flag_not, ids_equal
from backends.torch.lowering.onehot import label_values, one_hot
from backends.torch.lowering.registry import Handler, lowers, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class AllLabels(FlagLike):
    """``labels != ignore_index`` with the index outside the vocabulary: true
    for every label (the backend draws them in ``[0, vocab)``). ``where``
    reads it as its pattern; any other reader (the count of kept labels a
    mean divides by, ``mask.sum()``) reads the flag it is
    (docs/soundness.md, "Plans traced from PyTorch", 120 (a))."""
    ids: Ids
    ignore: int

    def truth(self, lw: Lowerer) -> np.ndarray:
        return np.asarray(label_values(lw, ("v", _ids_source(lw, self.ids)))) != self.ignore

    def flag(self, lw: Lowerer) -> Flag:
        return flag_not(lw, ids_equal(lw, ("v", _ids_source(lw, self.ids)), self.ignore))


@dataclass(frozen=True)
class InRange(PatternOnly):
    """``(ids >= lo) & (ids < hi)``: torchtitan's embedding range mask."""
    ids: Ids
    lo: int
    hi: int


@dataclass(frozen=True)
class Unsqueezed(PatternOnly):
    """A mask or shifted ids with a trailing dim of 1 added."""
    of: Any


@dataclass(frozen=True)
class AsFloat(PatternOnly):
    """A boolean mask converted to numbers (1 where it holds)."""
    mask: Any


@dataclass(frozen=True)
class LabelUpdate(PatternOnly):
    """``mask.float() - 1``: -1 for the labels inside the rows, 0 outside."""
    mask: VocabMask


@dataclass(frozen=True)
class Clamped(PatternOnly):
    """``(ids - lo).clamp(0, rows - 1)``: torchtitan's local row of each id,
    clamped into the table (the rows outside are zeroed by its mask)."""
    ids: Ids
    lo: int
    rows: int


@dataclass(frozen=True)
class ClampedLookup(PatternOnly):
    """The local table's rows picked by clamped ids, ``value`` being the
    one-hot columns ``[lo, lo + rows)`` times the table: equal to the lookup
    only after the output is multiplied by its range mask."""
    value: int
    ids: Ids
    lo: int
    rows: int


@dataclass(frozen=True)
class MaskedGrad(PatternOnly):
    """A gradient multiplied by the range mask of a clamped lookup (the
    backward of that multiplication), read only by the lookup's backward."""
    g: int
    mask: InRange


@dataclass(frozen=True)
class MaskedPick(PatternOnly):
    """The target logits picked by a loss-parallel ``gather``, ``value``
    being the row sum of the log-probabilities times the one-hot columns
    ``[lo, hi)``: equal to the gather only once the picks outside the rows
    are zeroed (``index_put_`` of 0 at ``mask``), the one reader allowed."""
    value: int
    mask: VocabMask


@dataclass(frozen=True)
class Spread(Pending):
    """Value ``x`` broadcast to ``shape`` by ``where`` (not yet emitted)."""
    x: int
    shape: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        return lw.emit("expand", [self.x], [list(self.shape)], {"shape": list(self.shape)})[0]


def _env(lw: Lowerer, a: Any) -> Any:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v":
        return lw.env.get(a[1])
    return None


def _refuse_pending(lw: Lowerer, args: Any, what: str) -> None:
    """Stop when an op outside the patterns reads a pending helper value."""
    items = args if isinstance(args, (list, tuple)) else [args]
    for a in items:
        if isinstance(_env(lw, a), PatternOnly):
            raise LoweringError(f"{lw.name}: {what} reads a vocabulary-parallel mask or "
                                f"shifted ids outside the patterns lowered "
                                f"(backends/torch/lowering/vocab_parallel.py)")


def _vocab_columns(lw: Lowerer, ids: Ids, lo: int, rows: int, what: str,
                   shape: tuple[int, ...] | None = None) -> int:
    """The one-hot rows of ``ids`` (seen with ``shape`` when given),
    columns ``[lo, lo + rows)``: a ``split`` of the vocabulary into equal
    pieces."""
    if rows <= 0 or lw.vocab % rows or lo % rows:
        raise LoweringError(f"{lw.name}: {what} of the rows [{lo}, {lo + rows}) is not one of "
                            f"equal vocabulary shards")
    if shape is not None and ids.shape != tuple(shape):
        ids = Ids(ids.source, ids.index, ids.parts, tuple(shape))
    onehot = one_hot(lw, ("v", _ids_source(lw, ids)))
    if rows == lw.vocab:
        return onehot
    shape = [*lw.shapes[onehot][:-1], rows]
    return lw.emit("split", [onehot], [shape], {"dim": len(shape) - 1,
                                                 "parts": lw.vocab // rows,
                                                 "index": lo // rows})[0]


def _ids_source(lw: Lowerer, ids: Ids) -> int:
    """A recorded value holding ``ids`` (added to the environment, under a
    fresh negative key, when no op produced them with that shape)."""
    for v, x in lw.env.items():
        if x == ids:
            return v
    key = -2 - len(lw.env)
    lw.env[key] = ids
    return key


# -- the stable log-softmax ------------------------------------------------------

@lowers("aten.amax.default")
def amax(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.val(args[0])
    dims = args[1] if len(args) > 1 else kwargs.get("dim", [])
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    dims = [int(d) % len(lw.shapes[x]) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if len(dims) != 1:  # several dims, or none (every dim)
        return lw.emit("max", [x], shapes, {"dim": dims or None, "keepdim": keepdim})[0]
    if keepdim:
        return RowMax(x, dims[0])
    return lw.emit("max", [x], shapes, {"dim": dims[0], "keepdim": False})[0]


@refines("_c10d_functional.all_reduce.default")
def all_reduce(base: Handler) -> Handler:
    """A MAX all-reduce of local row maxima: the maximum of the gathered rows."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if args[1] != "max":
            _refuse_pending(lw, args[:1], "an all_reduce")
            return base(lw, args, kwargs, shapes, group)
        if not isinstance(x, RowMax):
            raise LoweringError(f"{lw.name}: a MAX all_reduce of anything but a row maximum "
                                f"(amax) is not lowered")
        shape = list(lw.shapes[x.x])
        shape[x.dim] *= len(group)
        rows = lw.emit("all_gather", [x.x], [shape], {"dim": x.dim}, group=group)[0]
        return lw.emit("max", [rows], shapes, {"dim": x.dim, "keepdim": True})[0]
    return lower


def unary(op: str) -> Handler:
    return lambda lw, args, kwargs, shapes, group: lw.emit(op, [lw.val(args[0])], shapes)[0]


# -- masks and shifted labels ---------------------------------------------------

@lowers("aten.ne.Scalar")
def ne(lw: Lowerer, args, kwargs, shapes, group):
    """``labels != ignore_index``: true for every label when the index is
    outside the vocabulary."""
    ids, value = _env(lw, args[0]), lw.const(args[1])
    if isinstance(ids, Ids) and value is not None and not 0 <= int(value) < lw.vocab:
        return AllLabels(ids, int(value))
    raise LoweringError(f"{lw.name}: a comparison 'ne' other than of the labels with an "
                        f"ignore index outside the vocabulary is not lowered")


@refines("aten.where.self")
@refines("aten.where.ScalarOther", absent=lambda op: _no_where)
def where(base: Handler) -> Handler:
    """``where(labels != ignore, x, 0)`` is x (broadcast to the output's
    shape) when no label is ignored."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        cond = _env(lw, args[0])
        if isinstance(cond, Unsqueezed):
            cond = cond.of
        if not isinstance(cond, AllLabels):
            _refuse_pending(lw, args, "where")
            return base(lw, args, kwargs, shapes, group)
        kept = _env(lw, args[1])
        if isinstance(kept, Ids):
            return kept
        if isinstance(kept, Quotient):  # a mean's gradient: still divided after its product
            return Quotient(_spread(lw, kept.x, shapes), kept.divisor)
        return _spread(lw, lw.val(args[1]), shapes)
    return lower


def _spread(lw: Lowerer, x: Any, shapes) -> Any:
    """Value ``x`` seen with the output's shape (pending when broadcast)."""
    if isinstance(x, int) and lw.shapes[x] == tuple(shapes[0]):
        return x
    return Spread(lw.materialize(x), tuple(shapes[0]))


def _no_where(lw: Lowerer, args, kwargs, shapes, group):
    raise LoweringError(f"{lw.name}: where with a scalar other than of the labels' "
                        f"ignore-index mask is not lowered")


@refines("aten.view_as.default", "aten.flatten.using_ints", base="aten.view.default")
def view_like(view: Handler) -> Handler:
    """``view_as`` and ``flatten``: a view to the output's shape."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        _refuse_pending(lw, args[:1], "a view")
        return view(lw, args[:1], {}, shapes, group)
    return lower


@lowers("aten.bitwise_and.Tensor")
def bitwise_and(lw: Lowerer, args, kwargs, shapes, group):
    a, b = _env(lw, args[0]), _env(lw, args[1])
    if isinstance(a, IdsTest) and isinstance(b, IdsTest) and a.ids == b.ids \
            and (a.op, b.op) == ("ge", "lt"):
        return InRange(a.ids, a.value, b.value)
    raise LoweringError(f"{lw.name}: an 'and' other than of ids >= lo and ids < hi is not lowered")


@refines("aten.unsqueeze.default")
def unsqueeze(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, (AllLabels, InRange, VocabMask, Shifted)):
            if int(args[1]) not in (-1, len(shapes[0]) - 1):
                raise LoweringError(f"{lw.name}: a mask or shifted ids unsqueezed at dim "
                                    f"{args[1]} is not lowered")
            return Unsqueezed(x)
        _refuse_pending(lw, args[:1], "unsqueeze")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten._to_copy.default")
def to_copy(base: Handler) -> Handler:
    """A boolean mask converted to numbers stays a mask."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, (InRange, VocabMask)) or isinstance(x, Unsqueezed) \
                and isinstance(x.of, (InRange, VocabMask)):
            return AsFloat(x)
        _refuse_pending(lw, args[:1], "a conversion")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.to.dtype", base="aten._to_copy.default")
def to_dtype(to_copy_handler: Handler) -> Handler:
    """``x.to(dtype)`` (DTensor's loss-parallel log-softmax backward) as
    ``_to_copy``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        return to_copy(to_copy_handler)(lw, args[:1], {"dtype": args[1]}, shapes, group)
    return lower


@refines("aten.to.device", base="aten._to_copy.default")
def to_device(to_copy_handler: Handler) -> Handler:
    """``x.to(other)`` (DTensor's loss-parallel count of kept labels, cast
    to the logits' type) records ``to.device``: on the CPU the ranks run on,
    a change of type only, lowered as ``_to_copy``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        device = args[1] if len(args) > 1 else kwargs.get("device")
        if not on_cpu(device):
            raise LoweringError(f"{lw.name}: a copy to device {device} is not lowered (the "
                                f"ranks run on the CPU)")
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        return to_copy(to_copy_handler)(lw, args[:1], {"dtype": dtype}, shapes, group)
    return lower


@refines("aten.sub.Tensor")
def sub(base: Handler) -> Handler:
    """``mask.float() - 1``: the value the fused backward writes at the label."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if isinstance(x, AsFloat) and isinstance(x.mask, VocabMask) and lw.const(args[1]) == 1:
            return LabelUpdate(x.mask)
        _refuse_pending(lw, args, "a subtraction")
        return base(lw, args, kwargs, shapes, group)
    return lower


def clamp(lw: Lowerer, args, kwargs, shapes, group):
    """``(ids - lo).clamp(0, rows - 1)`` of torchtitan's embedding."""
    x = _env(lw, args[0])
    low = lw.const(args[1]) if len(args) > 1 else None
    high = lw.const(args[2]) if len(args) > 2 else None
    if isinstance(x, Shifted) and x.mask is None and low == 0 and high is not None:
        return Clamped(x.ids, x.lo, int(high) + 1)
    raise LoweringError(f"{lw.name}: clamp other than of shifted ids into a table's rows is "
                        f"not lowered")


# -- torchtitan's masked lookup -------------------------------------------------

@refines("aten.embedding.default")
def embedding(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        ids = _env(lw, args[1])
        if not isinstance(ids, Clamped):
            _refuse_pending(lw, args, "an embedding")
            return base(lw, args, kwargs, shapes, group)
        w = lw.val(args[0])
        if len(args) > 2 and args[2] is not None and int(args[2]) >= 0:
            raise LoweringError(f"{lw.name}: embedding with a padding_idx is not lowered")
        if lw.shapes[w][0] != ids.rows:
            raise LoweringError(f"{lw.name}: ids clamped to {ids.rows} rows index a table of "
                                f"{lw.shapes[w][0]}")
        part = _vocab_columns(lw, ids.ids, ids.lo, ids.rows, "a vocabulary-parallel lookup")
        out = lw.emit("embedding", [part, w], shapes)[0]
        return ClampedLookup(out, ids.ids, ids.lo, ids.rows)
    return lower


def _range_mask(x: Any) -> InRange | None:
    """The range mask of ``mask.unsqueeze(-1).to(dtype)``."""
    if isinstance(x, AsFloat) and isinstance(x.mask, Unsqueezed) and isinstance(x.mask.of, InRange):
        return x.mask.of
    return None


@refines("aten.mul.Tensor")
def mul(base: Handler) -> Handler:
    """A clamped lookup times its range mask (the lookup), a gradient times
    it (pending for the lookup's backward), or ``x * where(...)``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        mask = _range_mask(b)
        if mask is not None:
            if isinstance(a, ClampedLookup):
                if (a.ids, a.lo, a.lo + a.rows) != (mask.ids, mask.lo, mask.hi):
                    raise LoweringError(f"{lw.name}: a lookup multiplied by another range's mask")
                return a.value
            if isinstance(a, int):
                return MaskedGrad(a, mask)
        for i, x in enumerate((a, b)):
            quotient = x if isinstance(x, Quotient) and isinstance(x.x, Spread) else None
            if quotient is not None:
                x = quotient.x
            if isinstance(x, Spread):
                other = lw.val(args[1 - i])
                if lw.shapes[other] == tuple(shapes[0]):
                    pair = [other, x.x] if i else [x.x, other]
                    out = lw.emit("mul", pair, shapes)[0]
                    return out if quotient is None else quotient.divided(lw, out)
        _refuse_pending(lw, args[:2], "a multiplication")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.embedding_dense_backward.default")
def embedding_backward(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        g, ids = _env(lw, args[0]), _env(lw, args[1])
        if not isinstance(ids, Clamped):
            _refuse_pending(lw, args, "an embedding backward")
            return base(lw, args, kwargs, shapes, group)
        if not isinstance(g, MaskedGrad) or (g.mask.ids, g.mask.lo, g.mask.hi) != \
                (ids.ids, ids.lo, ids.lo + ids.rows):
            raise LoweringError(f"{lw.name}: the backward of a clamped lookup without its "
                                f"range mask is not lowered")
        if int(args[2]) != ids.rows or (len(args) > 4 and args[4]):
            raise LoweringError(f"{lw.name}: embedding backward of another table size or "
                                f"with scale_grad_by_freq is not lowered")
        part = _vocab_columns(lw, ids.ids, ids.lo, ids.rows, "a vocabulary-parallel lookup")
        out = lw.new(shapes[0])
        lw.nodes.append(LNode("embedding", "bw", [part, -1, g.g], [-1, out], {}, lw.name, None,
                              lw.mb))
        return out
    return lower


# -- the target logit and the fused backward --------------------------------------

@lowers("aten.gather.default")
def gather(lw: Lowerer, args, kwargs, shapes, group):
    """``gather(logp, -1, local_labels.unsqueeze(-1))`` with the labels
    shifted by ``lo`` and 0 outside ``[lo, hi)``: the row sum of ``logp``
    times the one-hot columns ``[lo, hi)``, pending until the picks outside
    the rows are zeroed (``MaskedPick``)."""
    x = lw.val(args[0])
    index = _env(lw, args[2])
    dim = int(args[1]) % len(lw.shapes[x])
    shifted = index.of if isinstance(index, Unsqueezed) else index
    if dim != len(lw.shapes[x]) - 1 or not isinstance(shifted, Shifted) or shifted.mask is None \
            or shifted.mask.lo != shifted.lo or shifted.mask.ids != shifted.ids:
        raise LoweringError(f"{lw.name}: gather other than of a vocabulary shard's rows at "
                            f"the masked local labels is not lowered")
    rows = lw.shapes[x][-1]
    if shifted.mask.hi - shifted.lo != rows:
        raise LoweringError(f"{lw.name}: labels masked to [{shifted.lo}, {shifted.mask.hi}) "
                            f"index a shard of {rows} rows")
    columns = _vocab_columns(lw, shifted.ids, shifted.lo, rows, "a loss-parallel gather",
                             lw.shapes[x][:-1])
    picked = lw.emit("mul", [x, columns], [lw.shapes[x]])[0]
    out = lw.emit("sum", [picked], shapes, {"dim": dim, "keepdim": True})[0]
    return MaskedPick(out, shifted.mask)


@refines("aten.index_put_.default")
def index_put(base: Handler) -> Handler:
    """The picked logits zeroed outside the rows (already zero), or the
    fused backward's ``-1`` at each local label."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        target = _env(lw, args[0])
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        masks = [_env(lw, m) for m in indices]
        accumulate = bool(args[3]) if len(args) > 3 else False
        mask = masks[0].of if len(masks) == 1 and isinstance(masks[0], Unsqueezed) else \
            masks[0] if len(masks) == 1 else None
        if isinstance(target, MaskedPick):
            if mask != target.mask or accumulate or lw.const(args[2]) != 0:
                raise LoweringError(f"{lw.name}: the picked target logits are not zeroed "
                                    f"outside the vocabulary shard's rows by its mask")
            return target.value
        if isinstance(target, Zeros) and len(masks) == 2 and not accumulate:
            return _label_update(lw, target, indices, masks, _env(lw, args[2]), shapes)
        _refuse_pending(lw, [args[0], args[2], *indices], "index_put_")
        return base(lw, args, kwargs, shapes, group)
    return lower


def _label_update(lw: Lowerer, target: Zeros, indices, masks, value: Any, shapes) -> int:
    """``zeros[arange(n), local_labels] = mask.float() - 1``: -1 at every
    label inside the rows, nothing outside (the masked label 0 receives 0):
    minus the one-hot columns ``[lo, hi)``."""
    rows = constant_value(lw, indices[0]) if isinstance(masks[0], Const) else None
    shifted = masks[1]
    n, width = target.shape[0], target.shape[-1]
    if rows is None or len(target.shape) != 2 or not np.array_equal(rows, np.arange(n)) \
            or not isinstance(shifted, Shifted) or not isinstance(value, LabelUpdate) \
            or shifted.mask != value.mask or shifted.mask is None \
            or (shifted.mask.lo, shifted.mask.hi) != (shifted.lo, shifted.lo + width):
        raise LoweringError(f"{lw.name}: index_put_ into zeros other than the loss-parallel "
                            f"backward's -1 at the local labels is not lowered")
    columns = _vocab_columns(lw, shifted.ids, shifted.lo, width, "a loss-parallel backward",
                             target.shape[:-1])
    if math.prod(lw.shapes[columns]) != math.prod(shapes[0]):
        raise LoweringError(f"{lw.name}: the labels do not match the logits' rows")
    return lw.emit("mul_scalar", [columns], shapes, {"value": -1.0})[0]


@refines("aten.zeros_like.default")
def zeros_like(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if lw.env.get(args[0][1]) in lw.params:
            return base(lw, args, kwargs, shapes, group)
        return Zeros(tuple(shapes[0]))
    return lower


@refines("aten.add.Tensor")
def add(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        _refuse_pending(lw, args[:2], "an addition")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.clamp.default")
def clamp_or(base: Handler | None) -> Handler:
    """torchtitan's clamp of shifted ids, else the table's clamp."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if isinstance(_env(lw, args[0]), Shifted) or base is None:
            return clamp(lw, args, kwargs, shapes, group)
        return base(lw, args, kwargs, shapes, group)
    return lower


lowers("aten.exp.default")(unary("exp"))
lowers("aten.log.default")(unary("log"))
