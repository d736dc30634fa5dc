"""Elementwise arithmetic, reductions, matmul, 2-norms and the optimizer's
in-place updates (torch.optim's AdamW and SGD, for-loop implementation),
kept pending until their last op shows the whole update."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.arranged import Arranged
from backends.torch.lowering.constants import constant_value
from backends.torch.lowering.fills import additive_mask, masked_fill, selected, where
from backends.torch.lowering.flat_ranges import FlatRange, range_blocks
from backends.torch.lowering.ir import (
    ChunkCat,
    Compare,
    Complex,
    Decayed,
    Denom,
    Flat,
    Ids,
    IdsTest,
    Moment1,
    Moment2,
    Norm,
    NormIsZero,
    NormStack,
    NoShard,
    Scaled,
    SgdGrad,
    Shifted,
    VocabMask,
    complex_parts,
    numel,
)
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _binary(tensor_op: str, scalar_op: str):
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = args[0], args[1]
        if kwargs.get("alpha", 1) != 1:
            raise LoweringError(f"{lw.name}: {tensor_op} with alpha is not lowered")
        if tensor_op == "mul":
            product = complex_mul(lw, args, shapes)
            if product is not None:
                return product
        cb = lw.const(b)
        if cb is not None:
            return lw.emit(scalar_op, [lw.val(a)], shapes, {"value": cb})[0]
        ca = lw.const(a)
        if ca is not None:
            return lw.emit(scalar_op, [lw.val(b)], shapes, {"value": ca})[0]
        return lw.emit(tensor_op, [lw.val(a), lw.val(b)], shapes)[0]
    return lower


def _scalar(op: str, unit: bool = False):
    """``x op value`` for a constant ``value`` (a division by a tensor: a
    quotient). ``unit``: an out-of-place division, whose quotient by exactly
    1 is its dividend itself, no node (docs/soundness.md, "Plans traced from
    PyTorch", 119)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        value = lw.const(args[1])
        if value is None and op == "div":
            return _quotient(lw, args, kwargs, shapes)
        if value is None:
            raise LoweringError(f"{lw.name}: {op} by a tensor is not lowered")
        buf = lw.env.get(args[0][1])
        if op == "div" and isinstance(buf, ChunkCat):
            return ChunkCat(buf.grads, buf.chunks, buf.group, buf.divide * value, buf.replicas)
        if unit and value == 1 and kwargs.get("rounding_mode") is None:
            return lw.val(args[0])
        return lw.emit(op, [lw.val(args[0])], shapes, {"value": value})[0]
    return lower


def _quotient(lw: Lowerer, args, kwargs, shapes) -> int:
    """a / b for a tensor b: a * pow(b, -1) (the reciprocal uninterpreted, as
    every non-linear function); a rounding mode is refused."""
    if kwargs.get("rounding_mode") is not None:
        raise LoweringError(f"{lw.name}: division with rounding_mode is not lowered")
    a, b = lw.val(args[0]), lw.val(args[1])
    recip = lw.emit("pow", [b], [lw.shapes[b]], {"exponent": -1.0})[0]
    out = lw.emit("mul", [a, recip], shapes)[0]
    lw.quotients[out] = (a, b)
    return out


def _unary(op: str):
    return lambda lw, args, kwargs, shapes, group: lw.emit(op, [lw.val(args[0])], shapes)[0]


def _pow(lw: Lowerer, args, kwargs, shapes, group):
    return lw.emit("pow", [lw.val(args[0])], shapes, {"exponent": float(args[1])})[0]


@lowers("aten.silu_backward.default")
def _silu_bw(lw: Lowerer, args, kwargs, shapes, group):
    return lw.emit("silu", [lw.val(args[1]), lw.val(args[0])], shapes, direction="bw")[0]


def _reduce(op: str):
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if isinstance(dim, list) and not dim:
            dim = None
        x = lw.val(args[0])
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = int(dim[0]) % len(lw.shapes[x])  # one dim, as the lowered log-softmax names it
        return lw.emit(op, [x], shapes, {"dim": dim, "keepdim": keepdim})[0]
    return lower


def _folded(lw: Lowerer, x: Any, k: int) -> Any:
    """``x`` as torch.matmul's batch folding of its first ``k`` dims
    (``Flat``) when it is one: a ``Flat``, or an all-to-all's output
    (``Arranged``) whose last view merges the first k dims of the form
    before it (more than 3 dims), that form then emitted. Else ``x``."""
    if isinstance(x, Flat) or not isinstance(x, Arranged) or x.prev is None \
            or x.step[:1] != ("view",):
        return x
    src, dst = x.prev.pos.shape, x.step[1]
    if len(src) > 3 and len(src) == len(dst) + k - 1 and math.prod(src[:k]) == dst[0] \
            and tuple(src[k:]) == tuple(dst[1:]):
        return Flat(lw.materialize(x.prev), k)
    return x


@lowers("aten.mm.default", "aten.bmm.default")
def _matmul(lw: Lowerer, args, kwargs, shapes, group):
    """A matrix product; of two batch-folded operands (``Flat``, one of them
    an all-to-all's output so folded: Ulysses' attention backward), the
    batched product of the unfolded ones, folded."""
    a, b = lw.env.get(args[0][1]), lw.env.get(args[1][1])
    if isinstance(a, Flat) and not isinstance(b, Flat):
        b = _folded(lw, b, a.k)
    elif isinstance(b, Flat) and not isinstance(a, Flat):
        a = _folded(lw, a, b.k)
    if isinstance(a, Flat) and isinstance(b, Flat) and a.k == b.k:
        lead = lw.shapes[a.x][:a.k]
        out = lw.emit("matmul", [a.x, b.x], [(*lead, *shapes[0][1:])])[0]
        return Flat(out, a.k)
    return lw.emit("matmul", [lw.val(args[0]), lw.val(args[1])], shapes)[0]


def _constant(op: str):
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        return lw.emit(op, [], shapes, {"shape": list(shapes[0])}, direction="none")[0]
    return lower


def _add(lw: Lowerer, args, kwargs, shapes, group):
    """``scores + mask`` with the constant causal mask, or an addition."""
    masked = causal_add(lw, args, shapes)
    return masked if masked is not None else _binary("add", "add_scalar")(lw, args, kwargs,
                                                                          shapes, group)


@lowers("aten._to_copy.default")
def _to_copy(lw: Lowerer, args, kwargs, shapes, group):
    """A change of precision (arithmetic.to_copy); the batch's integer ids are
    never converted to numbers."""
    x = lw.env.get(args[0][1])
    if isinstance(x, (Ids, Shifted, IdsTest, VocabMask)):
        raise LoweringError(f"{lw.name}: the batch's integer ids converted to numbers")
    if isinstance(x, ChunkCat) and (x.group is not None or x.chunks == 1):
        # FSDP's reduced buffer cast back from its reduce dtype
        if "float" not in str(kwargs.get("dtype", "")) and "double" not in str(kwargs.get("dtype", "")):
            raise LoweringError(f"{lw.name}: FSDP's reduced buffer converted to {kwargs.get('dtype')}")
        return x
    return to_copy(lw, args, kwargs, shapes, group)


def _square_sum(lw: Lowerer, x: int) -> int:
    shape = lw.shapes[x]
    sq = lw.emit("mul", [x, x], [shape])[0]
    return lw.emit("sum", [sq], [()], {"dim": None, "keepdim": False})[0]


def _check_two_norm(lw: Lowerer, ord_: Any) -> None:
    if float(ord_) != 2.0:
        raise LoweringError(f"{lw.name}: a norm of order {ord_} is not lowered (only 2-norms)")


@lowers("aten._foreach_norm.Scalar")
def _foreach_norm(lw: Lowerer, args, kwargs, shapes, group):
    """One 2-norm per tensor: sqrt of its square sum, kept pending (``Norm``)."""
    _check_two_norm(lw, args[1] if len(args) > 1 else 2.0)
    return [Norm(_square_sum_of(lw, a)) for a in args[0]]


def _square_sum_of(lw: Lowerer, a: Any) -> int:
    """The square sum of a tensor; of a gradient's empty shard, 0 (a sum
    over no rows: docs/soundness.md, "Plans traced from PyTorch", 15d)."""
    x = lw.env.get(a[1])
    if isinstance(x, NoShard) and x.grad >= 0:
        s = lw.emit("zeros", [], [()], {"shape": []}, direction="none")[0]
        lw.empty_sums[s] = (x.grad, x.group)
        return s
    if isinstance(x, FlatRange):
        return _range_square_sum(lw, x)
    return _square_sum(lw, lw.val(a))


def _range_square_sum(lw: Lowerer, x: FlatRange) -> int:
    """The square sum of a reduce-scattered range's elements: of each run
    (value, lo, hi) the square sums of its blocks added in memory order,
    the runs' added in order. A run that is not its whole value is a part,
    over the group the ranges were cut for, of that value's square sum
    (``range_sums``; docs/soundness.md, "Plans traced from PyTorch", 80)."""
    total = None
    for v, lo, hi in x.parts:
        if (lo, hi) == (0, numel(lw, v)):
            run = _square_sum(lw, v)
        elif x.group is None:
            raise LoweringError(f"{lw.name}: the norm of part of a value that no reduce-scatter "
                                f"cut is not lowered")
        else:
            run = lw.reshape(_blocks_square_sum(lw, v, lo, hi), ())
            lw.range_sums[run] = (v, x.group)
        total = run if total is None else lw.emit("add", [total, run], [()])[0]
    return total


def _blocks_square_sum(lw: Lowerer, v: int, lo: int, hi: int) -> int:
    """The square sum of the flat elements [lo, hi) of v: v squared whole
    (the single-device square the norm sums), then the sums of the blocks
    of the square that the elements make, each kept with v's number of dims
    (shape 1, ..., 1, a piece of nothing that fits in the square: the loose
    values of item 80), added in memory order."""
    ones = (1,) * len(lw.shapes[v])
    sq = lw.emit("mul", [v, v], [lw.shapes[v]])[0]
    total = None
    for block in range_blocks(lw, FlatRange(((sq, lo, hi),))):
        s = lw.emit("sum", [block], [ones], {"dim": list(range(len(ones))), "keepdim": True})[0]
        total = s if total is None else lw.emit("add", [total, s], [ones])[0]
    return total


@lowers("aten.linalg_vector_norm.default")
def _vector_norm(lw: Lowerer, args, kwargs, shapes, group):
    """The 2-norm of a tensor, or of a stack of norms: sqrt of the sum of
    the square sums (the square of a norm of a square sum s is s, s >= 0),
    summed in stack order."""
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2.0)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if float(ord_) == 1.0 and dim not in (None, []):
        return _one_norm_along(lw, lw.val(args[0]), list(dim),
                               bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False)),
                               shapes)
    _check_two_norm(lw, ord_)
    if dim not in (None, []):
        return _norm_along(lw, lw.val(args[0]), list(dim),
                           bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False)), shapes)
    x = lw.env.get(args[0][1])
    if isinstance(x, NormStack) and not x.squared:
        total = None
        for norm in x.norms:
            if norm.share != 1:
                raise LoweringError(f"{lw.name}: the norm of a stack of partial norms, never "
                                    f"reduced, is not lowered")
            total = norm.s if total is None else lw.emit("add", [total, norm.s], [()])[0]
        return Norm(total)
    if isinstance(x, FlatRange):
        return Norm(_range_square_sum(lw, x))
    return Norm(_square_sum(lw, lw.val(args[0])))


def _one_norm_along(lw: Lowerer, x: int, dims: list[int], keepdim: bool, shapes) -> int:
    """``x.norm(p=1, dim=dims)``: ``sum(|x|, dims)``, with ``|x| = relu(x) +
    relu(-x)`` (DBRX's router normalizes its top weights so); its backward,
    ``sgn(x) * g``, is recorded as those ops (docs/soundness.md, "Plans
    traced from PyTorch", 117)."""
    nd = len(lw.shapes[x])
    dims = sorted(d % nd for d in dims)
    shape = [lw.shapes[x]]
    negated = lw.emit("mul_scalar", [x], shape, {"value": -1.0})[0]
    absolute = lw.emit("add", [lw.emit("relu", [x], shape)[0], lw.emit("relu", [negated], shape)[0]],
                       shape)[0]
    return lw.emit("sum", [absolute], shapes, {"dim": dims, "keepdim": keepdim})[0]


def _norm_along(lw: Lowerer, x: int, dims: list[int], keepdim: bool, shapes) -> int:
    """``x.norm(dim=dims)``: pow(sum(x * x, dims), 0.5)."""
    nd = len(lw.shapes[x])
    dims = sorted(d % nd for d in dims)
    sq = lw.emit("mul", [x, x], [lw.shapes[x]])[0]
    s = lw.emit("sum", [sq], shapes, {"dim": dims, "keepdim": keepdim})[0]
    out = lw.emit("pow", [s], shapes, {"exponent": 0.5})[0]
    if keepdim:
        lw.norms[out] = x
    return out


@lowers("aten.eq.Scalar")
def _eq_scalar(lw: Lowerer, args, kwargs, shapes, group):
    """``norm == 0`` (the norm's backward guards its division with it)."""
    n = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
    if isinstance(n, int) and n in lw.norms and lw.const(args[1]) == 0:
        return NormIsZero(n)
    raise LoweringError(f"{lw.name}: a comparison other than a norm's with 0 is not lowered")


@lowers("aten.masked_fill_.Scalar")
def _masked_fill_pending(lw: Lowerer, args, kwargs, shapes, group):
    """A constant mask's fill (``fills.masked_fill``), or the norm's
    backward guard ``(x / n).masked_fill_(n == 0, 0)`` for ``n`` the 2-norm
    of ``x`` along kept dims: the identity, since in real arithmetic ``n =
    0`` only where every entry of ``x`` along the dims is 0, where ``x / n``
    is then ``0 * pow(0, -1) = 0`` already (docs/soundness.md, "Plans
    traced from PyTorch", 10)."""
    mask = lw.env.get(args[1][1])
    if not isinstance(mask, NormIsZero):
        return masked_fill(lw, args, kwargs, shapes, group)
    q = lw.val(args[0])
    if lw.quotients.get(q) != (lw.norms[mask.norm], mask.norm) or lw.const(args[2]) != 0:
        raise LoweringError(f"{lw.name}: a fill where a norm is 0 of other than the norm's "
                            f"input divided by it is not lowered")
    return q


@lowers("aten.where.self")
def _where_pending(lw: Lowerer, args, kwargs, shapes, group):
    """``where(x op c, t, 0)`` or ``where(x op c, 0, t)`` (clamp's backward),
    else a constant mask's ``where`` (``fills.where``)."""
    cond = lw.env.get(args[0][1])
    if not isinstance(cond, Compare):
        return where(lw, args, kwargs, shapes, group)
    if lw.const(args[2]) == 0:
        return selected(lw, cond, lw.val(args[1]), True, shapes[0])
    if lw.const(args[1]) == 0:
        return selected(lw, cond, lw.val(args[2]), False, shapes[0])
    if lw.const(args[1]) is None and lw.const(args[2]) is None:
        # two tensors: each selected by its side of the comparison, summed
        # (one of the two terms is 0 at every position: soundness.md, "Plans
        # traced from PyTorch", 39b)
        then = selected(lw, cond, lw.val(args[1]), True, shapes[0])
        other = selected(lw, cond, lw.val(args[2]), False, shapes[0])
        return lw.emit("add", [then, other], [tuple(shapes[0])])[0]
    raise LoweringError(f"{lw.name}: where on a comparison between a tensor and a number other "
                        f"than 0 is not lowered")


@lowers("aten.clamp_min.default")
def _clamp_min(lw: Lowerer, args, kwargs, shapes, group):
    bound = lw.const(args[1])
    if bound is None:
        raise LoweringError(f"{lw.name}: clamp_min by a tensor is not lowered")
    return lw.emit("clamp", [lw.val(args[0])], shapes, {"min": bound, "max": None})[0]


@lowers("aten.stack.default")
def _stack(lw: Lowerer, args, kwargs, shapes, group):
    items = [lw.env.get(a[1]) for a in args[0]]
    dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
    if items and all(isinstance(x, Norm) for x in items) and dim == 0:
        return NormStack(tuple(items))
    raise LoweringError(f"{lw.name}: stack of tensors other than norms is not lowered")


def _sqrt2_share(value: float) -> int | None:
    """n when value is DTensor's float sqrt(n), n a positive integer."""
    n = round(value * value)
    return n if n >= 1 and math.isclose(math.sqrt(n), value, rel_tol=1e-15, abs_tol=0) else None


@lowers("aten.div.Tensor")
def _div_tensor(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.env.get(args[0][1])
    value = lw.const(args[1])
    if isinstance(x, Norm) and value is not None and x.share == 1:
        share = _sqrt2_share(value)
        if share is None:
            raise LoweringError(f"{lw.name}: a norm divided by {value} is not lowered")
        return Norm(x.s, share)
    if isinstance(x, Denom) and x.root and value is not None:
        return Denom(x.v2, value, 0.0)
    return _scalar("div", unit=True)(lw, args, kwargs, shapes, group)


@lowers("aten.pow.Tensor_Scalar")
def _pow_pending(lw: Lowerer, args, kwargs, shapes, group):
    """A power; of a norm or a stack of norms, kept pending: the square of a
    norm is its square sum, the root of a squared stack its norms again
    (a stack's entries always carry their square sums)."""
    x = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
    e = float(args[1])
    if isinstance(x, Norm) and e == 2.0:
        return _squared(lw, x)
    if isinstance(x, NormStack) and e == 2.0 and not x.squared:
        return NormStack(x.norms, squared=True)
    if isinstance(x, NormStack) and e == 0.5 and x.squared \
            and all(n.share == 1 for n in x.norms):
        return NormStack(x.norms)
    return _pow(lw, args, kwargs, shapes, group)


def _squared(lw: Lowerer, x: Norm) -> int:
    """The square of a norm: its square sum (divided by its share)."""
    if x.share == 1:
        return x.s
    return lw.emit("div", [x.s], [lw.shapes[x.s]], {"value": float(x.share)})[0]


@lowers("aten.reciprocal.default")
def _reciprocal(lw: Lowerer, args, kwargs, shapes, group):
    return lw.emit("pow", [lw.val(args[0])], shapes, {"exponent": -1.0})[0]


@lowers("aten.clamp.default")
def _clamp(lw: Lowerer, args, kwargs, shapes, group):
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    bounds = {"min": None if lo is None else lw.const(lo), "max": None if hi is None else lw.const(hi)}
    if (lo is not None and bounds["min"] is None) or (hi is not None and bounds["max"] is None):
        raise LoweringError(f"{lw.name}: clamp by a tensor is not lowered")
    # an infinite bound bounds no real number: no bound (soundness.md, "Plans
    # traced from PyTorch", 39g)
    bounds = {k: None if v is not None and math.isinf(v) and (v > 0) == (k == "max") else v
              for k, v in bounds.items()}
    if all(v is None for v in bounds.values()):
        return lw.val(args[0])
    return lw.emit("clamp", [lw.val(args[0])], shapes, bounds)[0]


@lowers("aten._foreach_mul_.Tensor")
def _foreach_mul_(lw: Lowerer, args, kwargs, shapes, group):
    """Each tensor of the list times the scalar (clipping's coefficient)."""
    c = lw.val(args[1])
    return [NoShard() if isinstance(lw.env.get(a[1]), NoShard)
            else lw.emit("mul", [lw.val(a), c], [lw.shapes[lw.val(a)]])[0] for a in args[0]]


@lowers("aten.zeros_like.default")
def _zeros_like(lw: Lowerer, args, kwargs, shapes, group):
    """A zero tensor; shaped like a parameter, a fresh optimizer state, named
    after it (so each rank's state is matched with its own parameter's)."""
    p = lw.env.get(args[0][1])
    if p in lw.params:
        lw.name = f"{lw.params[p]}.optimizer"
    out = _constant("zeros")(lw, args, kwargs, shapes, group)
    if p in lw.params:
        lw.fresh_state.add(out)
    return out


@lowers("aten.mul_.Tensor")
def _mul_inplace(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.env.get(args[0][1])
    value = lw.const(args[1])
    if value is not None and x in lw.params:
        return Decayed(x, value)
    if value is not None and x in lw.fresh_state:
        return Scaled(x, value)
    return _binary("mul", "mul_scalar")(lw, args, kwargs, shapes, group)


@lowers("aten.lerp_.Scalar")
def _lerp(lw: Lowerer, args, kwargs, shapes, group):
    m, weight = lw.env.get(args[0][1]), lw.const(args[2])
    if m not in lw.fresh_state or weight is None or 1.0 - (1.0 - weight) != weight:
        raise LoweringError(f"{lw.name}: lerp_ other than Adam's first moment is not lowered")
    return Moment1(m, lw.val(args[1]), weight)


@lowers("aten.addcmul_.default")
def _addcmul(lw: Lowerer, args, kwargs, shapes, group):
    v = lw.env.get(args[0][1])
    value = kwargs.get("value", args[3] if len(args) > 3 else 1.0)
    if isinstance(v, Scaled) and args[1] == args[2] and value == 1.0 - v.factor:
        return Moment2(v.v, lw.val(args[1]), v.factor)
    raise LoweringError(f"{lw.name}: addcmul_ other than Adam's second moment is not lowered")


@lowers("aten.sqrt.default")
def _sqrt(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.env.get(args[0][1])
    if isinstance(x, Moment2):
        return Denom(x, root=True)
    return lw.emit("pow", [lw.val(args[0])], shapes, {"exponent": 0.5})[0]


def _add_pending(plain):
    """An addition, or a step of the optimizer (Adam's eps, SGD's alpha)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        alpha = kwargs.get("alpha", 1)
        eps = lw.const(args[1])
        if isinstance(a, Denom) and not a.root and a.eps == 0.0 and eps is not None \
                and alpha == 1:
            return Denom(a.v2, a.scale, eps)
        if alpha != 1:
            return _sgd(lw, a, args, float(alpha), shapes)
        return plain(lw, args, kwargs, shapes, group)
    return lower


def _sgd(lw: Lowerer, a: Any, args, alpha: float, shapes) -> Any:
    """``torch.add(g, p, alpha=wd)`` (weight decay), then ``p.add_(d, alpha=-lr)``."""
    b = lw.env.get(args[1][1])
    if (b in lw.params or b in lw.written_params) and isinstance(a, int):
        return SgdGrad(a, b, alpha)
    held = lw.params.get(a) if a in lw.params else lw.written_params.get(a) \
        if isinstance(a, int) else None
    if held is not None:  # the parameter, or what the step wrote into it (item 128 a)
        lw.name = f"{held}.optimizer"
        g, wd = (b.g, b.wd) if isinstance(b, SgdGrad) and b.p == a else (lw.val(args[1]), 0.0)
        return lw.emit("sgd_step", [a, g], shapes, {"lr": -alpha, "weight_decay": wd},
                       direction="none")[0]
    raise LoweringError(f"{lw.name}: an addition with alpha other than SGD's step is not lowered")


def _adam_step_count(beta2: float, scale: float) -> int:
    """The step n whose bias correction sqrt(1 - beta2 ** n) is ``scale``."""
    for n in range(1, 100_000):
        if (1 - beta2 ** n) ** 0.5 == scale:
            return n
    raise LoweringError(f"no Adam step has the bias correction {scale}")


@lowers("aten.addcdiv_.default")
def _addcdiv(lw: Lowerer, args, kwargs, shapes, group):
    """AdamW's update ``p.addcdiv_(m, denom, value=-step_size)`` after its
    moments: one ``adam_step`` of (p, g, m, v); its new moments become the
    values of the states."""
    target, m, denom = (lw.env.get(a[1]) for a in args[:3])
    value = kwargs.get("value", args[3] if len(args) > 3 else 1.0)
    p, keep = (target.p, target.keep) if isinstance(target, Decayed) else (target, 1.0)
    if p not in lw.params or not isinstance(m, Moment1) or not isinstance(denom, Denom) \
            or denom.root or m.g != denom.v2.g:
        raise LoweringError(f"{lw.name}: addcdiv_ other than AdamW's update is not lowered")
    beta1, beta2 = 1.0 - m.weight, denom.v2.beta2
    step = _adam_step_count(beta2, denom.scale)
    lr = -value * (1 - beta1 ** step)
    kw = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": denom.eps,
          "weight_decay": (1.0 - keep) / lr, "decoupled": True, "step": step}
    shape = lw.shapes[p]
    lw.name = f"{lw.params[p]}.optimizer"
    new_p, new_m, new_v = lw.emit("adam_step", [p, m.g, m.m, denom.v2.v], [shape] * 3, kw,
                                  direction="none")
    lw.updated[m] = new_m
    lw.updated[denom.v2] = new_v
    return new_p


def causal_add(lw: Lowerer, args: Any, shapes: list) -> int | None:
    """``scores + mask`` with a constant mask holding -inf: the causal mask
    (and the mask's finite entries added as a constant)."""
    for mine, other in ((args[0], args[1]), (args[1], args[0])):
        value = constant_value(lw, mine)
        if value is not None and value.size > 1 and np.any(np.isneginf(value)):
            x = lw.val(other)
            if lw.shapes[x] != tuple(shapes[0]):
                raise LoweringError(f"{lw.name}: a causal mask broadcasting its scores")
            return additive_mask(lw, x, value, tuple(shapes[0]))
    return None


def complex_mul(lw: Lowerer, args: Any, shapes: list) -> Complex | None:
    """(x + iy)(u + iv) = (xu - yv) + i(xv + yu); None when neither factor is complex."""
    pa, pb = complex_parts(lw, args[0]), complex_parts(lw, args[1])
    if pa is None and pb is None:
        return None
    pa = pa or (lw.val(args[0]), None)
    pb = pb or (lw.val(args[1]), None)
    (x, y), (u, v) = pa, pb
    shape = tuple(shapes[0])

    def mul(p: int, q: int) -> int:
        return lw.emit("mul", [p, q], [shape])[0]

    if y is None or v is None:
        scale, (re, im) = (x, (u, v)) if y is None else (u, (x, y))
        return Complex(mul(re, scale), mul(im, scale))
    return Complex(lw.emit("sub", [mul(x, u), mul(y, v)], [shape])[0],
                   lw.emit("add", [mul(x, v), mul(y, u)], [shape])[0])


def to_copy(lw: Lowerer, args, kwargs, shapes, group):
    """A change of floating (or complex) precision: the same real number (the
    proof is in exact arithmetic); other conversions are refused."""
    x = lw.env.get(args[0][1])
    dtype = str(kwargs.get("dtype", ""))
    floating = ("float" in dtype or "double" in dtype or "half" in dtype) and "complex" not in dtype
    if isinstance(x, Complex) and ("complex" in dtype or not dtype):
        return x
    if not isinstance(x, Complex) and (floating or not dtype):
        return lw.val(args[0])
    raise LoweringError(f"{lw.name}: a conversion of a computed value to {dtype or 'another layout'} "
                        f"is not lowered (only the batch's ids, masks of them and integers "
                        f"counted from them convert exactly; any other value would be rounded)")

@lowers("aten._conj.default", "aten.conj_physical.default", "aten.conj.default")
def conj(lw: Lowerer, args, kwargs, shapes, group):
    """The complex conjugate: the real part, the imaginary part negated (a
    real tensor is its own conjugate)."""
    parts = complex_parts(lw, args[0])
    if parts is None or parts[1] is None:
        return lw.val(args[0])
    re, im = parts
    return Complex(re, lw.emit("mul_scalar", [im], [lw.shapes[im]], {"value": -1.0})[0])


lowers("aten.div_.Scalar", "aten.div_.Tensor")(_scalar('div'))
lowers("aten.div.Scalar")(_scalar('div', unit=True))
lowers("aten.mul.Scalar")(_scalar('mul_scalar'))
lowers("aten.mean.dim", "aten.mean.default")(_reduce('mean'))
lowers("aten.sum.dim_IntList", "aten.sum.default")(_reduce('sum'))
lowers("aten.ones_like.default")(_constant('ones'))
lowers("aten.add.Tensor")(_add_pending(_add))
lowers("aten.add_.Tensor")(_add_pending(_binary("add", "add_scalar")))
lowers("aten.mul.Tensor", "aten.mul.out")(_binary("mul", "mul_scalar"))
lowers("aten.rsqrt.default")(_unary("rsqrt"))
lowers("aten.silu.default")(_unary("silu"))
lowers("aten.add_.Scalar")(_binary("add", "add_scalar"))
