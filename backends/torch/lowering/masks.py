"""Lowering of boolean masks and of -inf masking off the causal pattern.

Two kinds of value, both exact in real arithmetic (docs/soundness.md,
"Plans traced from PyTorch", 16):

* A *flag* (``Flag``): a boolean tensor computed from the batch's ids
  (``ids != pad``, ``labels == ignore_index``), or combined from such
  flags and constant masks with ``~``, ``&`` and ``|``. It is lowered as a
  0/1 tensor computed from the one-hot ids: ``ids == c`` is the one-hot
  column ``c`` (``1 - sum`` of the row for a ``c`` outside the
  vocabulary, which no id of the vocabulary equals), ``~a`` is ``1 - a``,
  ``a & b`` is ``a * b``, ``a | b`` is ``a + b - a b``. Read as a number
  it is that 0/1 tensor, which is what torch promotes a boolean to; read
  as a mask by ``masked_fill`` or ``where`` with a finite fill ``c`` it
  selects: ``x (1 - m) + c m``. The sum of all its entries (a count of
  kept labels, ``Count``) is its recorded count, read only as a divisor;
  a SUM all-reduce of it is the group's total (``lower.lower_ranks``).

* A *-inf mask* (``Masked``): scores with -inf at the positions a keep
  mask ``K`` (a flag, or a constant mask off the causal pattern) zeroes.
  Only a softmax may read it, which is then ``K exp(x - t) / sum(K exp(x
  - t))`` along the last dim (``_masked_softmax``): torch's ``exp(-inf) =
  0`` drops the hidden entries from the sum and makes their probabilities
  0. A row with every position hidden is NaN in torch: refused. The
  softmax's backward is written on its probabilities
  (``attention.softmax_grad``).

Each handler refines the earlier layers' entry for the same op and hands every other
case to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.attention import sdpa_scores, softmax_grad
from backends.torch.lowering.constants import NEG_INF, causal_fill, constant_input, constant_value
from backends.torch.lowering.devices import on_cpu
from backends.torch.lowering.ir import (
    Const,
    Flag,
    FlagLike,
    IdRows,
    Ids,
    IdsTest,
    SdpaSaved,
    as_flag,
    constant_flag,
    pending_of,
)
from backends.torch.lowering.mask_values import (
    HIDDEN_SCORE,
    Count,
    DeadRows,
    Masked,
    NegInfMask,
    Quotient,
    expanded,
    flag_not,
    ids_equal,
    one_minus,
    summed,
)
from backends.torch.lowering.onehot import flag_of
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

def compare_ids(op: str, base: Handler) -> Handler:
    """``ids == c`` and ``ids != c`` of the batch's ids as flags (``ne`` of
    labels with an index outside the vocabulary stays the loss-parallel
    pattern of ``base``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        ids, c = pending_of(lw, args[0]), lw.const(args[1])
        inside = c is not None and 0 <= int(c) < lw.vocab
        if c is None or not (isinstance(ids, IdRows) or isinstance(ids, Ids)
                             and (inside or op == "eq")):
            return base(lw, args, kwargs, shapes, group)
        flag = ids_equal(lw, args[0], int(c))
        return flag if op == "eq" else flag_not(lw, flag)
    return lower


@refines("aten.bitwise_not.default", "aten.logical_not.default")
def logical_not(base: Handler | None) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        f = as_flag(lw, args[0])
        if f is not None:
            return flag_not(lw, f)
        if base is None:
            raise LoweringError(f"{lw.name}: a negation of other than a mask of the batch's ids "
                                f"or a constant mask is not lowered")
        return base(lw, args, kwargs, shapes, group)
    return lower


def combine_flags(lw: Lowerer, a: Flag, b: Flag, op: str) -> Flag:
    """``a & b`` (``a b``) or ``a | b`` (``a + b - a b``) of two flags of one shape."""
    shape = lw.shapes[a.x]
    both = lw.emit("mul", [a.x, b.x], [shape])[0]
    if op == "and":
        return Flag(both, a.value & b.value)
    either = lw.emit("sub", [lw.emit("add", [a.x, b.x], [shape])[0], both], [shape])[0]
    return Flag(either, a.value | b.value)


def combine(op: str, base: Handler | None) -> Handler:
    """``a & b`` (the product) and ``a | b`` (``a + b - a b``) of flags or
    constant masks, broadcast to the output's shape."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if isinstance(pending_of(lw, args[0]), Flag) or isinstance(pending_of(lw, args[1]), Flag):
            a, b = as_flag(lw, args[0]), as_flag(lw, args[1])
            if a is not None and b is not None:
                return combine_flags(lw, _shaped(lw, a, tuple(shapes[0])),
                                     _shaped(lw, b, tuple(shapes[0])), op)
        if any(isinstance(pending_of(lw, x), IdsTest) for x in args[:2]):
            # comparisons of the ids: the vocabulary-parallel patterns first,
            # then any such comparison as a flag
            if base is not None:
                try:
                    return base(lw, args, kwargs, shapes, group)
                except LoweringError:
                    pass
            a, b = flag_of(lw, args[0]), flag_of(lw, args[1])
            if a is not None and b is not None:
                return combine_flags(lw, _shaped(lw, a, tuple(shapes[0])),
                                     _shaped(lw, b, tuple(shapes[0])), op)
        if base is None:
            raise LoweringError(f"{lw.name}: an '{op}' of other than masks of the batch's ids or "
                                f"constant masks is not lowered")
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.unsqueeze.default", "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
          "aten.expand.default")
def view(base: Handler) -> Handler:
    """A view or expansion of a flag is a flag of the output's shape."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        f = pending_of(lw, args[0])
        out = base(lw, args, kwargs, shapes, group)
        if not isinstance(f, Flag):
            return out
        shape = tuple(shapes[0])
        value = f.value.reshape(shape) if f.value.size == int(np.prod(shape)) else \
            np.broadcast_to(f.value, shape)
        return Flag(lw.materialize(out), value)
    return lower


# -- masking -------------------------------------------------------------------------

def _select(lw: Lowerer, x: int, hidden: Flag, fill: float, shape: tuple[int, ...]) -> Any:
    """``x`` with the positions of ``hidden`` set to ``fill``: a finite fill
    is ``x (1 - m) + fill m``; -inf makes the pending ``Masked``."""
    if fill == NEG_INF:
        if lw.shapes[x] != shape:
            raise LoweringError(f"{lw.name}: a -inf mask broadcasting its scores is not lowered")
        return Masked(x, _shaped(lw, flag_not(lw, hidden), shape))
    if not np.isfinite(fill):
        raise LoweringError(f"{lw.name}: masking with the value {fill} is not lowered")
    m = expanded(lw, hidden.x, shape)
    out = lw.emit("mul", [expanded(lw, x, shape), one_minus(lw, m)], [shape])[0]
    if fill != 0:
        out = lw.emit("add", [out, lw.emit("mul_scalar", [m], [shape], {"value": fill})[0]],
                      [shape])[0]
    return out


def _refill(lw: Lowerer, m: Masked, hidden: Flag | None, fill: float | None,
            shape: tuple[int, ...]) -> Masked:
    """A -inf masked value filled again where ``hidden`` holds: with -inf the
    kept set shrinks to ``K (1 - h)``; with a finite c the filled positions
    hold c and are kept, ``K + h - K h``."""
    if hidden is None or fill is None or lw.shapes[m.x] != shape:
        raise LoweringError(f"{lw.name}: scores masked with -inf are filled again with other "
                            f"than a mask and a number")
    h = _shaped(lw, hidden, shape)
    if fill == NEG_INF:
        return Masked(m.x, _shaped(lw, combine_flags(lw, m.keep, flag_not(lw, h), "and"), shape))
    x = _select(lw, m.x, h, fill, shape)
    return Masked(x, combine_flags(lw, m.keep, h, "or"))


def _off_causal(lw: Lowerer, a: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """The hidden positions of a constant boolean mask that is not the causal
    pattern (None for anything else: the earlier layers' lowering applies)."""
    if not isinstance(pending_of(lw, a), Const):
        return None
    value = constant_value(lw, a)
    if value is None or value.dtype != bool or causal_fill(value, shape):
        return None
    return value


@refines("aten.masked_fill.Scalar", "aten.masked_fill_.Scalar", "aten.masked_fill.Tensor")
def masked_fill(base: Handler) -> Handler:
    """``masked_fill(x, mask, c)`` with a flag (any c), or with a constant
    mask off the causal pattern and c = -inf."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        shape, fill = tuple(shapes[0]), lw.const(args[2])
        f = pending_of(lw, args[1])
        dead = pending_of(lw, args[0])
        if isinstance(dead, DeadRows):
            hidden = as_flag(lw, args[1])
            if hidden is None or fill != 0 or not np.all(
                    np.broadcast_to(hidden.value, shape)[np.broadcast_to(dead.dead, shape)]):
                return lw.materialize(dead)  # refused: the NaN is read
            return _select(lw, dead.x, hidden, 0.0, shape)
        if isinstance(pending_of(lw, args[0]), Masked):
            return _refill(lw, pending_of(lw, args[0]), as_flag(lw, args[1]), fill, shape)
        if isinstance(f, Flag) and fill is not None:
            return _select(lw, lw.val(args[0]), f, fill, shape)
        hidden = _off_causal(lw, args[1], shape)
        if hidden is not None and fill == NEG_INF:
            return _select(lw, lw.val(args[0]), constant_flag(lw, hidden), fill, shape)
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.where.self")
def where(base: Handler) -> Handler:
    """``where(cond, a, b)`` with a flag (or a constant mask off the causal
    pattern and a -inf branch): 0 and -inf branches make an additive mask;
    a tensor and a constant make a masked fill."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        shape = tuple(shapes[0])
        cond = pending_of(lw, args[0])
        if isinstance(cond, IdsTest):
            cond = flag_of(lw, args[0])
        a, b = lw.const(args[1]), lw.const(args[2])
        if not isinstance(cond, Flag):
            value = constant_value(lw, args[0]) if isinstance(cond, Const) else None
            if value is None or value.dtype != bool or NEG_INF not in (a, b):
                return base(lw, args, kwargs, shapes, group)
            hidden = value if a == NEG_INF else ~value
            if causal_fill(hidden, shape):
                return base(lw, args, kwargs, shapes, group)
            cond = constant_flag(lw, value)
        if a is not None and b is not None:
            if (a, b) == (0.0, NEG_INF):
                return NegInfMask(_shaped(lw, cond, shape))
            if (a, b) == (NEG_INF, 0.0):
                return NegInfMask(_shaped(lw, flag_not(lw, cond), shape))
            if not np.isfinite([a, b]).all():
                raise LoweringError(f"{lw.name}: where of a mask between the constants {a} and "
                                    f"{b} is not lowered (an infinite number other than an "
                                    f"additive -inf mask's)")
            # b + (a - b) m for the 0/1 mask m (soundness.md, "Plans traced from PyTorch", 39e)
            m = _shaped(lw, cond, shape)
            scaled = lw.emit("mul_scalar", [m.x], [shape], {"value": a - b})[0]
            return lw.emit("add_scalar", [scaled], [shape], {"value": b})[0]
        if b is not None:
            return _select(lw, lw.val(args[1]), flag_not(lw, cond), b, shape)
        if a is not None:
            return _select(lw, lw.val(args[2]), cond, a, shape)
        raise LoweringError(f"{lw.name}: where of a mask between two tensors is not lowered")
    return lower


def _shaped(lw: Lowerer, f: Flag, shape: tuple[int, ...]) -> Flag:
    return Flag(expanded(lw, f.x, shape), np.broadcast_to(f.value, shape))


@refines("aten.add.Tensor")
def add(base: Handler) -> Handler:
    """``scores + mask`` for an additive -inf mask: a flag's, or a constant's
    whose -inf entries are not the causal pattern (its finite entries added)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        shape = tuple(shapes[0])
        for mine, other in ((args[0], args[1]), (args[1], args[0])):
            m = pending_of(lw, mine)
            if isinstance(m, NegInfMask):
                return _select(lw, lw.val(other), flag_not(lw, m.keep), NEG_INF, shape)
            keep = _constant_keep(lw, mine, shape)
            if keep is not None:
                value = np.asarray(constant_value(lw, mine), dtype=np.float64)
                return Masked(_plus_finite(lw, lw.val(other), value, shape), keep)
        return base(lw, args, kwargs, shapes, group)
    return lower


def _constant_keep(lw: Lowerer, a: Any, shape: tuple[int, ...]) -> Flag | None:
    """The kept positions of a constant float mask holding -inf off the
    causal pattern (None otherwise)."""
    value = constant_value(lw, a) if isinstance(pending_of(lw, a), Const) else None
    if value is None or value.dtype == bool or value.size <= 1:
        return None
    value = np.asarray(value, dtype=np.float64)
    hidden = np.isneginf(value)
    if not hidden.any() or causal_fill(hidden, shape):
        return None
    if np.any(np.isnan(value) | np.isposinf(value)):
        raise LoweringError(f"{lw.name}: an attention mask with nan or +inf entries is not lowered")
    return _shaped(lw, constant_flag(lw, ~hidden), shape)


def _plus_finite(lw: Lowerer, x: int, value: np.ndarray, shape: tuple[int, ...]) -> int:
    """``x`` plus the finite entries of a constant additive mask (0 at its -inf ones)."""
    finite = np.where(np.isneginf(value), 0.0, value)
    if lw.shapes[x] != shape:
        raise LoweringError(f"{lw.name}: a -inf mask broadcasting its scores is not lowered")
    if not np.any(finite):
        return x
    return lw.emit("add", [x, constant_input(lw, finite)], [shape])[0]


# -- the masked softmax --------------------------------------------------------------

def _masked_softmax(lw: Lowerer, m: Masked, dim: int) -> int:
    """``K exp(y - t) / sum(K exp(y - t))`` along the last dim, with ``y = x
    K + (K - 1) 1e30`` (x where kept: the product with K is the same for K
    in {0, 1}; far below everything where hidden, so that exp neither
    overflows nor matters) and ``t`` the row's maximum of y, its largest
    kept score. A row with no kept position (NaN in torch) is 0."""
    shape = lw.shapes[m.x]
    if dim % len(shape) != len(shape) - 1:
        raise LoweringError(f"{lw.name}: a softmax of -inf masked scores along other than the "
                            f"last dim is not lowered")
    # a mask computed from the data may hide a whole row for some batch (on
    # some rank): its softmax is written for such rows on every rank alike
    dead_rows = _from_data(lw, m.keep.x)
    row = (*shape[:-1], 1)
    keep = expanded(lw, m.keep.x, shape)
    far = lw.emit("mul_scalar", [lw.emit("add_scalar", [keep], [shape], {"value": -1.0})[0]],
                  [shape], {"value": HIDDEN_SCORE})[0]
    candidates = lw.emit("add", [lw.emit("mul", [m.x, keep], [shape])[0], far], [shape])[0]
    top = lw.emit("max", [candidates], [row], {"dim": len(shape) - 1, "keepdim": True})[0]
    shifted = lw.emit("sub", [candidates, top], [shape])[0]
    kept = lw.emit("mul", [lw.emit("exp", [shifted], [shape])[0], keep], [shape])[0]
    total = lw.emit("sum", [kept], [row], {"dim": len(shape) - 1, "keepdim": True})[0]
    if dead_rows:
        # a row with no kept position (NaN in torch, which a finite step
        # fills away): 0 here, its sum made 1 by the row's flag of having
        # none, ``1 - max(K)`` (docs/soundness.md, "Plans traced from
        # PyTorch", 51)
        any_kept = lw.emit("max", [keep], [row], {"dim": len(shape) - 1, "keepdim": True})[0]
        total = lw.emit("sub", [lw.emit("add_scalar", [total], [row], {"value": 1.0})[0],
                                any_kept], [row])[0]
    inverse = lw.emit("pow", [total], [row], {"exponent": -1.0})[0]
    probs = lw.emit("mul", [kept, inverse], [shape])[0]
    lw.fw_in[probs] = ("masked_softmax", m.x)
    return probs


def _from_data(lw: Lowerer, x: int) -> bool:
    """Whether value x depends on an input that is not a constant (the
    batch's ids, a parameter): a walk back over the nodes emitted so far."""
    producer = {out: node for node in lw.nodes for out in node.outs if out >= 0}
    stack, seen = [x], {x}
    while stack:
        v = stack.pop()
        node = producer.get(v)
        if node is None:
            if v not in lw.const_values and lw.inputs.get(v, ("",))[0] != "buffer":
                return True
            continue
        for u in node.ins:
            if u >= 0 and u not in seen:
                seen.add(u)
                stack.append(u)
    return False


def _dead_rows(m: Masked, shape: tuple[int, ...]) -> np.ndarray:
    """The recorded rows of ``m`` with no kept position (``[..., 1]``)."""
    return ~np.any(np.broadcast_to(m.keep.value, shape), axis=-1, keepdims=True)


@refines("aten.exp.default")
def exp(base: Handler) -> Handler:
    """``exp`` of -inf masked scores (a decay mask written
    ``masked_fill(mask, -inf).exp()``): ``exp(x K) K``, 0 at the hidden
    positions as torch's ``exp(-inf)``, ``exp(x)`` at the kept ones; the
    hidden scores enter as 0, so nothing of them is read (docs/soundness.md,
    "Plans traced from PyTorch", 96)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        m = pending_of(lw, args[0])
        if not isinstance(m, Masked):
            return base(lw, args, kwargs, shapes, group)
        shape = lw.shapes[m.x]
        keep = expanded(lw, m.keep.x, shape)
        kept = lw.emit("mul", [m.x, keep], [shape])[0]
        return lw.emit("mul", [lw.emit("exp", [kept], [shape])[0], keep], [shape])[0]
    return lower


@refines("aten._softmax.default")
def softmax(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        m = pending_of(lw, args[0])
        if isinstance(m, Masked):
            probs = _masked_softmax(lw, m, int(args[1]))
            dead = _dead_rows(m, lw.shapes[m.x])
            return DeadRows(probs, dead) if dead.any() else probs
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten._softmax_backward_data.default")
def softmax_backward(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        dead = pending_of(lw, args[1])
        out = dead.x if isinstance(dead, DeadRows) else lw.val(args[1])
        if lw.fw_in.get(out, ("",))[0] == "masked_softmax":
            return softmax_grad(lw, out, lw.val(args[0]), int(args[2]))
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten._scaled_dot_product_flash_attention_for_cpu.default")
def sdpa(base: Handler) -> Handler:
    """SDPA with a flag's -inf mask, or a constant one off the causal pattern:
    the masked softmax of the scores, then times the values."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        mask = kwargs.get("attn_mask")
        m = pending_of(lw, mask)
        value = None if isinstance(m, NegInfMask) else _sdpa_keep_const(lw, args, mask)
        if not isinstance(m, NegInfMask) and value is None:
            return base(lw, args, kwargs, shapes, group)
        q, keys, values, scale, scores, groups, causal, _ = sdpa_scores(lw, args, kwargs)
        shape = lw.shapes[scores]
        if causal:
            raise LoweringError(f"{lw.name}: an attention mask given with is_causal is not lowered")
        if isinstance(m, NegInfMask):
            masked = Masked(scores, _shaped(lw, m.keep, shape))
        else:
            masked = Masked(_plus_finite(lw, scores, value, shape),
                            _shaped(lw, constant_flag(lw, ~np.isneginf(value)), shape))
        if _dead_rows(masked, lw.shapes[masked.x]).any():
            raise LoweringError(f"{lw.name}: a row of attention has every position masked with "
                                f"-inf (torch computes NaN there)")
        probs = _masked_softmax(lw, masked, -1)
        out = lw.emit("matmul", [probs, values], [shapes[0]])[0]
        lw.sdpa[out] = SdpaSaved(q, keys, values, scale, masked.x, probs, False, groups,
                                 masked_probs=True)
        return [out, "logsumexp"]
    return lower


def _sdpa_keep_const(lw: Lowerer, args: Any, mask: Any) -> np.ndarray | None:
    """A constant SDPA mask whose -inf (or False) entries are not the causal
    pattern, as an additive float mask (None otherwise: nn's sdpa)."""
    value = constant_value(lw, mask) if isinstance(pending_of(lw, mask), Const) else None
    if value is None:
        return None
    if value.dtype == bool:
        value = np.where(value, 0.0, NEG_INF)
    value = np.asarray(value, dtype=np.float64)
    hidden = np.isneginf(value)
    q, k = lw.shapes[lw.val(args[0])], lw.shapes[lw.val(args[1])]
    if not hidden.any() or len(q) != 4 or len(k) != 4 \
            or causal_fill(hidden, (*q[:3], k[2])):
        return None
    return value


# -- counts -----------------------------------------------------------------------

@refines("aten.sum.default", "aten.sum.dim_IntList")
def count(base: Handler) -> Handler:
    """The sum of every entry of a flag: its count in the recorded batch."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        f = pending_of(lw, args[0])
        if isinstance(f, Flag) and tuple(shapes[0]) == ():
            return Count(int(np.sum(f.value)))
        if isinstance(f, FlagLike) and tuple(shapes[0]) == ():
            return Count(int(np.sum(f.truth(lw))))
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.div.Tensor")
def divide(base: Handler) -> Handler:
    """``x / count``: a division by the constant count."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        c = pending_of(lw, args[1])
        if not isinstance(c, Count):
            return base(lw, args, kwargs, shapes, group)
        if c.value == 0 and not c.unsummed:
            raise LoweringError(f"{lw.name}: a division by a count of kept labels that is 0 in "
                                f"the recorded batch")
        # the pass that only collects the ranks' counts (lower_ranks) is
        # lowered again with the group's sum: 0 on this rank alone
        x = lw.val(args[0])
        if lw.shapes[x] != tuple(shapes[0]):
            return lw.emit("div", [x], shapes, {"value": float(c.value or 1)})[0]
        return Quotient(x, float(c.value or 1))
    return lower


@refines("aten.clamp.default", "aten.clamp_min.default")
def count_clamp(base: Handler) -> Handler:
    """A count clamped from below (``count.clamp(min=1)``, a mean's guard
    against a rank with no kept label): the count or the bound, whichever
    is larger, a constant like the count."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        c = pending_of(lw, args[0])
        low = args[1] if len(args) > 1 else kwargs.get("min")
        high = args[2] if len(args) > 2 else kwargs.get("max")
        if not isinstance(c, Count) or low is None or high is not None:
            return base(lw, args, kwargs, shapes, group)
        return Count(max(c.value, int(low)), c.unsummed, max(c.held, int(low)))
    return lower


@refines("aten._to_copy.default", "aten.to.dtype")
def cast(base: Handler) -> Handler:
    """A cast of a count or of an additive -inf mask to a floating type is
    the same count or mask; a flag (or a comparison of the ids) cast to any
    numeric type is its 0/1 values, which it already stands for."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        c = pending_of(lw, args[0])
        dtype = str(kwargs.get("dtype", args[1] if len(args) > 1 else ""))
        if isinstance(c, Count) or isinstance(c, NegInfMask) and "float" in dtype:
            return c
        if isinstance(c, (Flag, FlagLike, IdsTest)) and "complex" not in dtype:
            return flag_of(lw, args[0])
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.to.device")
def cast_to_device(base: Handler) -> Handler:
    """``x.to(other)`` (``to.device`` on the ranks' CPU, its type ``args[2]``)
    of a count or a flag, as ``cast``: a count stays the count, a flag its
    0/1 values (docs/soundness.md, "Plans traced from PyTorch", 120 (b))."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        c = pending_of(lw, args[0])
        if not on_cpu(args[1]):
            return base(lw, args, kwargs, shapes, group)  # refused there
        if isinstance(c, Count):
            return c
        if isinstance(c, (Flag, FlagLike, IdsTest)) and "complex" not in str(args[2]):
            return flag_of(lw, args[0])
        return base(lw, args, kwargs, shapes, group)
    return lower


def _reduced_count(lw: Lowerer, c: Count, group: tuple[int, ...]) -> Count:
    """A SUM all-reduce of a count over ``group``: the members' counts summed,
    as ``lower.lower_ranks`` computes them from every rank's recorded counts."""
    if lw.counts is None:
        raise LoweringError(f"{lw.name}: an all-reduced count of kept labels needs every rank's "
                            f"counts (lower the ranks with lower_ranks)")
    k = len(lw.count_reduces)
    lw.count_reduces.append((tuple(group), c.value))
    if lw.counts == "collect":
        return Count(c.value, unsummed=True, traced=c.held)
    return summed(lw, k, c.held)


@refines("c10d.allreduce_.default")
def count_all_reduce_inplace(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        tensors = args[0]
        c = pending_of(lw, tensors[0]) if len(tensors) == 1 else None
        if not isinstance(c, Count):
            return base(lw, args, kwargs, shapes, group)
        if args[2] not in (["redop", 0], ("redop", 0)):
            raise LoweringError(f"{lw.name}: an all-reduce of a count with reduce op {args[2]} is "
                                f"not lowered (SUM is)")
        return [_reduced_count(lw, c, tuple(args[1][1]))]
    return lower


@refines("_c10d_functional.all_reduce.default")
def count_all_reduce(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        c = pending_of(lw, args[0])
        if not isinstance(c, Count):
            return base(lw, args, kwargs, shapes, group)
        if args[1] != "sum":
            raise LoweringError(f"{lw.name}: an all-reduce of a count with op {args[1]} is not "
                                f"lowered (sum is)")
        return _reduced_count(lw, c, tuple(group))
    return lower


@refines("aten.eq.Scalar")
def compare_eq(base: Handler) -> Handler:
    return compare_ids("eq", base)


@refines("aten.ne.Scalar")
def compare_ne(base: Handler) -> Handler:
    return compare_ids("ne", base)


@refines("aten.bitwise_and.Tensor", "aten.__and__.Tensor", "aten.logical_and.default")
def combine_and(base: Handler | None) -> Handler:
    return combine("and", base)


@refines("aten.bitwise_or.Tensor", "aten.__or__.Tensor", "aten.logical_or.default")
def combine_or(base: Handler | None) -> Handler:
    return combine("or", base)
