"""Lowerings of more of ``torch.nn``'s activation kernels (LeakyReLU,
Hardtanh/ReLU6, ELU/SELU/CELU, Softplus, Mish, GLU), each written with the
rule table's operators so that the composition equals the kernel's function
in exact real arithmetic, branch conditions included (docs/soundness.md,
"Plans traced from PyTorch", 17).

Handlers have the signature of ``backends.torch.lowering.registry``:
``(lowerer, args, kwargs, out_shapes, group) -> value``. A branch of a
kernel (``x > 0 ? a : b``) is ``b + step(x) * (a - b)``, with ``step`` the
uninterpreted step of the ``relu`` rule's backward (``t * step(y)``, 1 for
``y > 0``, else 0) and ``1 - step(-x)`` for ``x >= 0``; exp, log, tanh and
sigmoid are the rule table's uninterpreted functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import (
    arg,
    emit_binary,
    emit_unary,
    expand_to,
    number,
    permuted,
    put_region,
    region_dims,
    scaled,
    shifted,
    step_times,
)
from backends.torch.lowering.ir import Pending
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _branch(lw: Lowerer, cond: int, then: int, other: int) -> int:
    """``cond > 0 ? then : other`` as ``other + step(cond) * (then - other)``."""
    return emit_binary(lw, "add", other, step_times(lw, cond, emit_binary(lw, "sub", then, other)))


def _relu(lw: Lowerer, x: int) -> int:
    return emit_unary(lw, "relu", x)


# -- LeakyReLU ---------------------------------------------------------------------------------

@lowers("aten.leaky_relu.default", "aten.leaky_relu_.default")
def leaky_relu(lw: Lowerer, args, kwargs, shapes, group):
    """``x > 0 ? x : a x`` = ``a x + (1 - a) relu(x)`` (relu(x) = x step(x))."""
    x = lw.val(args[0])
    a = number(lw, arg(args, kwargs, 1, "negative_slope", 0.01), "leaky_relu's slope")
    return emit_binary(lw, "add", scaled(lw, x, a), scaled(lw, _relu(lw, x), 1.0 - a))


@lowers("aten.leaky_relu_backward.default")
def leaky_relu_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``x > 0 ? g : a g`` = ``a g + (1 - a) g step(x)``. With the output
    given instead of x (in place), its sign is x's for a slope a > 0."""
    g, x = lw.val(args[0]), lw.val(args[1])
    a = number(lw, arg(args, kwargs, 2, "negative_slope", 0.01), "leaky_relu's slope")
    if arg(args, kwargs, 3, "self_is_result", False) and a <= 0:
        raise LoweringError(f"{lw.name}: in-place leaky_relu backward with a slope <= 0")
    return emit_binary(lw, "add", scaled(lw, g, a), scaled(lw, step_times(lw, x, g), 1.0 - a))


# -- Hardtanh, ReLU6 ---------------------------------------------------------------------------

def _bounds(lw: Lowerer, args, kwargs) -> tuple[float, float]:
    lo = number(lw, arg(args, kwargs, 1, "min_val", -1.0), "hardtanh's min_val")
    hi = number(lw, arg(args, kwargs, 2, "max_val", 1.0), "hardtanh's max_val")
    if not lo < hi:
        raise LoweringError(f"{lw.name}: hardtanh with min_val {lo} not below max_val {hi}")
    return lo, hi


@lowers("aten.hardtanh.default", "aten.hardtanh_.default")
def hardtanh(lw: Lowerer, args, kwargs, shapes, group):
    """``min(max(x, lo), hi)`` = ``lo + relu(x - lo) - relu(x - hi)`` for lo < hi."""
    x = lw.val(args[0])
    lo, hi = _bounds(lw, args, kwargs)
    above_lo = _relu(lw, shifted(lw, x, -lo))
    above_hi = _relu(lw, shifted(lw, x, -hi))
    return shifted(lw, emit_binary(lw, "sub", above_lo, above_hi), lo)


@lowers("aten.hardtanh_backward.default")
def hardtanh_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``lo < x < hi ? g : 0`` = ``g step(x - lo) - g (1 - step(hi - x))``:
    ``x >= hi`` implies ``x > lo``, so the second term removes exactly it."""
    g, x = lw.val(args[0]), lw.val(args[1])
    lo, hi = _bounds(lw, args[1:], {"min_val": kwargs.get("min_val", -1.0),
                                     "max_val": kwargs.get("max_val", 1.0)})
    inside = step_times(lw, shifted(lw, x, -lo), g)
    below_hi = step_times(lw, shifted(lw, scaled(lw, x, -1.0), hi), g)
    return emit_binary(lw, "add", emit_binary(lw, "sub", inside, g), below_hi)


# -- ELU (SELU, CELU) --------------------------------------------------------------------------

def _elu_params(lw: Lowerer, args, kwargs, first: int) -> tuple[float, float, float]:
    names = ("alpha", "scale", "input_scale")
    values = tuple(number(lw, arg(args, kwargs, first + i, n, 1.0), f"elu's {n}")
                   for i, n in enumerate(names))
    if min(values) <= 0:
        raise LoweringError(f"{lw.name}: elu with a non-positive alpha, scale or input_scale")
    return values


@lowers("aten.elu.default", "aten.elu_.default")
def elu(lw: Lowerer, args, kwargs, shapes, group):
    """``x > 0 ? s x : s a (exp(i x) - 1)``."""
    x = lw.val(args[0])
    a, s, i = _elu_params(lw, args, kwargs, 1)
    negative = scaled(lw, shifted(lw, emit_unary(lw, "exp", scaled(lw, x, i)), -1.0), s * a)
    return _branch(lw, x, scaled(lw, x, s), negative)


@lowers("aten.celu.default", "aten.celu_.default")
def celu(lw: Lowerer, args, kwargs, shapes, group):
    """``celu(x, a)`` is ``elu(x, a, 1, 1 / a)``."""
    a = number(lw, arg(args, kwargs, 1, "alpha", 1.0), "celu's alpha")
    if a <= 0:
        raise LoweringError(f"{lw.name}: celu with alpha <= 0")
    return elu(lw, [args[0], a, 1.0, 1.0 / a], {}, shapes, group)


@lowers("aten.elu_backward.default")
def elu_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``x > 0 ? g s : g i s a exp(i x)``; given the output y instead (in
    place), ``g i (y + s a)`` on the negative side, and y has x's sign (a,
    s > 0)."""
    g = lw.val(args[0])
    a, s, i = _elu_params(lw, args, kwargs, 1)
    is_result = bool(arg(args, kwargs, 4, "is_result", False))
    y = lw.val(arg(args, kwargs, 5, "self_or_result", None))
    if is_result:
        negative = emit_binary(lw, "mul", g, scaled(lw, shifted(lw, y, s * a), i))
    else:
        negative = emit_binary(lw, "mul", g, scaled(lw, emit_unary(lw, "exp", scaled(lw, y, i)), i * s * a))
    return _branch(lw, y, scaled(lw, g, s), negative)


# -- Softplus, Mish ----------------------------------------------------------------------------

def _softplus_params(lw: Lowerer, args, kwargs, first: int) -> tuple[float, float]:
    beta = number(lw, arg(args, kwargs, first, "beta", 1.0), "softplus's beta")
    threshold = number(lw, arg(args, kwargs, first + 1, "threshold", 20.0), "softplus's threshold")
    if beta <= 0:
        raise LoweringError(f"{lw.name}: softplus with beta <= 0")
    return beta, threshold


def _log1p_exp(lw: Lowerer, x: int) -> int:
    return emit_unary(lw, "log", shifted(lw, emit_unary(lw, "exp", x), 1.0))


@lowers("aten.expm1.default")
def expm1(lw: Lowerer, args, kwargs, shapes, group):
    """``exp(x) - 1``: the kernel's extra precision near 0 is a float matter,
    in exact arithmetic the two are one value."""
    return shifted(lw, emit_unary(lw, "exp", lw.val(args[0])), -1.0)


@lowers("aten.log1p.default")
def log1p(lw: Lowerer, args, kwargs, shapes, group):
    """``log(1 + x)`` (as ``expm1``, one value in exact arithmetic)."""
    return emit_unary(lw, "log", shifted(lw, lw.val(args[0]), 1.0))


@lowers("aten.softplus.default")
def softplus(lw: Lowerer, args, kwargs, shapes, group):
    """``b x > t ? x : log(1 + exp(b x)) / b`` (torch's kernel, its
    threshold branch included)."""
    x = lw.val(args[0])
    beta, threshold = _softplus_params(lw, args, kwargs, 1)
    bx = scaled(lw, x, beta)
    smooth = scaled(lw, _log1p_exp(lw, bx), 1.0 / beta)
    return _branch(lw, shifted(lw, bx, -threshold), x, smooth)


@lowers("aten.softplus_backward.default")
def softplus_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``b x > t ? g : g z / (z + 1)``, z = exp(b x): ``z / (z + 1)`` is
    ``sigmoid(b x)``."""
    g, x = lw.val(args[0]), lw.val(args[1])
    beta, threshold = _softplus_params(lw, args, kwargs, 2)
    bx = scaled(lw, x, beta)
    smooth = emit_binary(lw, "mul", g, emit_unary(lw, "sigmoid", bx))
    return _branch(lw, shifted(lw, bx, -threshold), g, smooth)


@lowers("aten.mish.default", "aten.mish_.default")
def mish(lw: Lowerer, args, kwargs, shapes, group):
    """``x tanh(log(1 + exp(x)))`` (torch's CPU kernel has no threshold)."""
    x = lw.val(args[0])
    return emit_binary(lw, "mul", x, emit_unary(lw, "tanh", _log1p_exp(lw, x)))


@lowers("aten.mish_backward.default")
def mish_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``g (t + x sigmoid(x) (1 - t^2))``, t = tanh(sp), sp = log(1 + exp(x)):
    ``g t`` plus the tanh rule's backward at sp of ``g x sigmoid(x)``."""
    g, x = lw.val(args[0]), lw.val(args[1])
    sp = _log1p_exp(lw, x)
    direct = emit_binary(lw, "mul", g, emit_unary(lw, "tanh", sp))
    inner = emit_binary(lw, "mul", emit_binary(lw, "mul", g, x), emit_unary(lw, "sigmoid", x))
    through = lw.emit("tanh", [sp, inner], [lw.shapes[x]], direction="bw")[0]
    return emit_binary(lw, "add", direct, through)


# -- GLU -----------------------------------------------------------------------------------------

def _halves(lw: Lowerer, x: int, dim: int) -> tuple[int, int, int]:
    shape = list(lw.shapes[x])
    d = dim % len(shape)
    if shape[d] % 2:
        raise LoweringError(f"{lw.name}: glu of an odd dim")
    half = shape[d] // 2
    shape[d] = half
    a, b = (lw.emit("narrow", [x], [shape], {"dim": d, "start": start, "length": half})[0]
            for start in (0, half))
    return a, b, d


@lowers("aten.glu.default")
def glu(lw: Lowerer, args, kwargs, shapes, group):
    """``a * sigmoid(b)`` for the halves a, b of x along dim."""
    x = lw.val(args[0])
    a, b, _ = _halves(lw, x, int(arg(args, kwargs, 1, "dim", -1)))
    return emit_binary(lw, "mul", a, emit_unary(lw, "sigmoid", b))


@lowers("aten.glu_backward.default")
def glu_backward(lw: Lowerer, args, kwargs, shapes, group):
    """The halves' gradients ``g sigmoid(b)`` and the sigmoid rule's backward
    at b of ``g a``, concatenated along dim."""
    g, x = lw.val(args[0]), lw.val(args[1])
    a, b, d = _halves(lw, x, int(arg(args, kwargs, 2, "dim", -1)))
    ga = emit_binary(lw, "mul", g, emit_unary(lw, "sigmoid", b))
    gb = lw.emit("sigmoid", [b, emit_binary(lw, "mul", g, a)], [lw.shapes[b]], direction="bw")[0]
    return lw.emit("cat", [ga, gb], [lw.shapes[x]], {"dim": d})[0]


# -- LogSigmoid, Hardsigmoid, Hardswish, PReLU ------------------------------------------------

@lowers("aten.log_sigmoid_forward.default")
def log_sigmoid(lw: Lowerer, args, kwargs, shapes, group):
    """``-log(1 + exp(-x))``; the kernel's second output (a buffer only its
    backward reads) is not lowered."""
    x = lw.val(args[0])
    return [scaled(lw, _log1p_exp(lw, scaled(lw, x, -1.0)), -1.0), "log_sigmoid buffer"]


@lowers("aten.log_sigmoid.default")
def log_sigmoid_alone(lw: Lowerer, args, kwargs, shapes, group):
    """``-log(1 + exp(-x))`` (recorded undecomposed where autograd is off,
    e.g. inside a DTensor op handler such as the context-parallel ring's
    merge)."""
    x = lw.val(args[0])
    return scaled(lw, _log1p_exp(lw, scaled(lw, x, -1.0)), -1.0)


@lowers("aten.log_sigmoid_backward.default")
def log_sigmoid_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``g sigmoid(-x)`` (the derivative of ``-log(1 + exp(-x))``)."""
    g, x = lw.val(args[0]), lw.val(args[1])
    return emit_binary(lw, "mul", g, emit_unary(lw, "sigmoid", scaled(lw, x, -1.0)))


def _relu6_of_x_plus_3(lw: Lowerer, x: int) -> int:
    """``min(max(x + 3, 0), 6)`` = ``relu(x + 3) - relu(x - 3)``."""
    return emit_binary(lw, "sub", _relu(lw, shifted(lw, x, 3.0)), _relu(lw, shifted(lw, x, -3.0)))


@lowers("aten.hardsigmoid.default")
def hardsigmoid(lw: Lowerer, args, kwargs, shapes, group):
    """``relu6(x + 3) / 6``."""
    return scaled(lw, _relu6_of_x_plus_3(lw, lw.val(args[0])), 1.0 / 6.0)


@lowers("aten.hardsigmoid_backward.default")
def hardsigmoid_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``-3 < x < 3 ? g c : 0`` = ``g c (step(x + 3) - 1 + step(3 - x))``, with
    the kernel's own constant c: 1/6 rounded to float32 (``1.0f / 6.0f``)."""
    g, x = lw.val(args[0]), lw.val(args[1])
    g6 = scaled(lw, g, float(np.float32(1.0) / np.float32(6.0)))
    above = step_times(lw, shifted(lw, x, 3.0), g6)
    below = step_times(lw, shifted(lw, scaled(lw, x, -1.0), 3.0), g6)
    return emit_binary(lw, "add", emit_binary(lw, "sub", above, g6), below)


@lowers("aten.hardswish.default")
def hardswish(lw: Lowerer, args, kwargs, shapes, group):
    """``x relu6(x + 3) / 6`` (0 for x <= -3, x for x >= 3, as torch's)."""
    x = lw.val(args[0])
    return emit_binary(lw, "mul", x, scaled(lw, _relu6_of_x_plus_3(lw, x), 1.0 / 6.0))


@lowers("aten.hardswish_backward.default")
def hardswish_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``x < -3 ? 0 : x <= 3 ? g (x / 3 + 1 / 2) : g``: the middle value
    times the indicator of ``x >= -3`` (``1 - step(-3 - x)``), plus ``g``
    minus it where ``x > 3`` (which implies ``x >= -3``)."""
    g, x = lw.val(args[0]), lw.val(args[1])
    middle = emit_binary(lw, "mul", g, shifted(lw, scaled(lw, x, 1.0 / 3.0), 0.5))
    from_minus3 = emit_binary(lw, "sub", middle, step_times(lw, shifted(lw, scaled(lw, x, -1.0), -3.0),
                                                         middle))
    return emit_binary(lw, "add", from_minus3,
                   step_times(lw, shifted(lw, x, -3.0), emit_binary(lw, "sub", g, middle)))


@lowers("aten._prelu_kernel.default")
def prelu(lw: Lowerer, args, kwargs, shapes, group):
    """``x > 0 ? x : w x`` = ``relu(x) - w relu(-x)``, w broadcast."""
    x, w = lw.val(args[0]), lw.val(args[1])
    w = expand_to(lw, w, lw.shapes[x])
    return emit_binary(lw, "sub", _relu(lw, x), emit_binary(lw, "mul", w, _relu(lw, scaled(lw, x, -1.0))))


@lowers("aten._prelu_kernel_backward.default")
def prelu_backward(lw: Lowerer, args, kwargs, shapes, group):
    """Input gradient ``g step(x) + w (g - g step(x))``; the weight's,
    before autograd sums it to w's shape, ``g (x - relu(x))`` (x where
    x <= 0, else 0)."""
    g, x, w = lw.val(args[0]), lw.val(args[1]), lw.val(args[2])
    w = expand_to(lw, w, lw.shapes[x])
    kept = step_times(lw, x, g)
    gx = emit_binary(lw, "add", kept, emit_binary(lw, "mul", w, emit_binary(lw, "sub", g, kept)))
    gw = emit_binary(lw, "mul", g, emit_binary(lw, "sub", x, _relu(lw, x)))
    return [gx, gw]


# -- statistics ----------------------------------------------------------------------------------

def _channel_row(lw: Lowerer, x: int) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
    """BatchNorm's reduced dims (all but the channel dim 1), the shape of a
    per-channel statistic kept along them, and of a parameter broadcast
    along the trailing dims."""
    shape = lw.shapes[x]
    if len(shape) < 2:
        raise LoweringError(f"{lw.name}: batch norm of fewer than two dims")
    dims = [d for d in range(len(shape)) if d != 1]
    row = tuple(n if d == 1 else 1 for d, n in enumerate(shape))
    return dims, row, (shape[1],) + (1,) * (len(shape) - 2)


@lowers("aten.native_batch_norm.default")
def batch_norm(lw: Lowerer, args, kwargs, shapes, group):
    """Training mode: the statistics of the batch (the rank's own rows, as
    the real run computes them) over every dim but the channels,
    ``y = (x - mean) * rsqrt(var + eps) * w + b``; the running statistics
    the kernel updates in place are read by no loss or gradient."""
    x = lw.val(args[0])
    weight, bias = arg(args, kwargs, 1, "weight", None), arg(args, kwargs, 2, "bias", None)
    if not arg(args, kwargs, 5, "training", False):
        raise LoweringError(f"{lw.name}: batch norm in eval mode (running statistics) is not "
                            f"lowered")
    eps = number(lw, arg(args, kwargs, 7, "eps", 1e-5), "batch norm's eps")
    dims, row, param = _channel_row(lw, x)
    shape = lw.shapes[x]
    mean = lw.emit("mean", [x], [row], {"dim": dims, "keepdim": True})[0]
    centered = emit_binary(lw, "sub", x, mean)
    var = lw.emit("mean", [emit_binary(lw, "mul", centered, centered)], [row],
                  {"dim": dims, "keepdim": True})[0]
    rstd = emit_unary(lw, "rsqrt", shifted(lw, var, eps))
    y = lw.emit("mul", [centered, rstd], [shape])[0]
    lw.ln_y[(x, mean, rstd)] = y
    if weight is not None:
        y = lw.emit("mul", [y, lw.reshape(lw.val(weight), param)], [shape])[0]
    if bias is not None:
        y = lw.emit("add", [y, lw.reshape(lw.val(bias), param)], [shape])[0]
    channels = (shape[1],)
    return [y, lw.reshape(mean, channels), lw.reshape(rstd, channels)]


@lowers("aten.native_batch_norm_backward.default")
def batch_norm_backward(lw: Lowerer, args, kwargs, shapes, group):
    """The layer norm backward over BatchNorm's dims: ``dx = rstd (gy -
    mean(gy) - y mean(gy y))``, gy = g w; ``dw = sum(g y)``, ``db = sum(g)``."""
    g, x = lw.val(args[0]), lw.val(args[1])
    weight = args[2]
    if not args[7]:
        raise LoweringError(f"{lw.name}: batch norm backward in eval mode is not lowered")
    dims, row, param = _channel_row(lw, x)
    shape = lw.shapes[x]
    mean, rstd = (lw.reshape(lw.val(a), row) for a in (args[5], args[6]))
    mask = list(args[9])
    y = lw.ln_y.get((x, mean, rstd))
    if y is None:
        y = lw.emit("mul", [emit_binary(lw, "sub", x, mean), rstd], [shape])[0]
    outs: list[Any] = []
    if mask[0]:
        gy = g if weight is None else lw.emit("mul", [g, lw.reshape(lw.val(weight), param)],
                                              [shape])[0]
        m1 = lw.emit("mean", [gy], [row], {"dim": dims, "keepdim": True})[0]
        m2 = lw.emit("mean", [emit_binary(lw, "mul", gy, y)], [row], {"dim": dims, "keepdim": True})[0]
        inner = emit_binary(lw, "sub", emit_binary(lw, "sub", gy, m1), lw.emit("mul", [y, m2], [shape])[0])
        outs.append(lw.emit("mul", [inner, rstd], [shape])[0])
    else:
        outs.append(None)
    channels = (shape[1],)
    outs.append(lw.emit("sum", [emit_binary(lw, "mul", g, y)], [channels], {"dim": dims, "keepdim": False})[0]
                if mask[1] else None)
    outs.append(lw.emit("sum", [g], [channels], {"dim": dims, "keepdim": False})[0]
                if mask[2] else None)
    return outs


# -- losses written with logarithms ---------------------------------------------------------------

@lowers("aten.binary_cross_entropy_with_logits.default")
def bce_with_logits(lw: Lowerer, args, kwargs, shapes, group):
    """``(1 - t) x + log(1 + exp(-x))`` (torch's kernel, with its max shift,
    which cancels in exact arithmetic) = ``log(1 + exp(x)) - t x``; summed
    or averaged. Class weights and ``pos_weight`` are not lowered."""
    x, t = lw.val(args[0]), lw.val(args[1])
    weight = arg(args, kwargs, 2, "weight", None)
    pos_weight = arg(args, kwargs, 3, "pos_weight", None)
    reduction = int(arg(args, kwargs, 4, "reduction", 1))
    if weight is not None or pos_weight is not None:
        raise LoweringError(f"{lw.name}: binary_cross_entropy_with_logits with weight or "
                            f"pos_weight is not lowered")
    per = emit_binary(lw, "sub", _log1p_exp(lw, x), emit_binary(lw, "mul", t, x))
    if reduction == 0:
        return per
    out = lw.emit("sum", [per], [()], {"dim": None, "keepdim": False})[0]
    if reduction == 1:
        count = 1
        for n in lw.shapes[x]:
            count *= n
        out = lw.emit("div", [out], [()], {"value": float(count)})[0]
    return out


@lowers("aten.xlogy.Tensor")
def xlogy(lw: Lowerer, args, kwargs, shapes, group):
    """``x log(y)`` (0 where x is 0, log uninterpreted: exact wherever
    torch's value is finite; ``F.kl_div``'s ``t log t``)."""
    x, y = lw.val(args[0]), lw.val(args[1])
    if lw.shapes[x] != lw.shapes[y]:
        raise LoweringError(f"{lw.name}: xlogy of differently shaped tensors is not lowered")
    return emit_binary(lw, "mul", x, emit_unary(lw, "log", y))


@lowers("aten.logsumexp.default")
def logsumexp(lw: Lowerer, args, kwargs, shapes, group):
    """``log(sum(exp(x), dims))``: torch's max shift cancels in exact
    arithmetic (``m + log(sum(exp(x - m))) = log(sum(exp(x)))``)."""
    x = lw.val(args[0])
    dims = arg(args, kwargs, 1, "dim", None)
    keepdim = bool(arg(args, kwargs, 2, "keepdim", False))
    dims = [int(d) % len(lw.shapes[x]) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    dim = dims[0] if len(dims) == 1 else dims
    total = lw.emit("sum", [emit_unary(lw, "exp", x)], shapes, {"dim": dim, "keepdim": keepdim})[0]
    return emit_unary(lw, "log", total)


@dataclass(frozen=True)
class Written(Pending):
    """An uninitialized tensor (``empty``) seen as ``sizes`` with regions
    written into it (``(starts, steps, value)``: the value's entries at
    ``starts[d] + k steps[d]`` along each dim d; disjoint), read as
    ``shape``. Read as a tensor only when the regions cover it: every entry
    is then the value written there (docs/soundness.md, "Plans traced from
    PyTorch", 45 and 50)."""
    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    blocks: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]

    def materialize(self, lw: Lowerer) -> int:
        if self not in lw.emitted_once:  # one value for every reader
            lw.emitted_once[self] = self.emit(lw)
        return lw.emitted_once[self]

    def emit(self, lw: Lowerer) -> int:
        covered = sum(int(np.prod(lw.shapes[b])) for _, _, b in self.blocks)
        if covered != int(np.prod(self.sizes)):
            raise LoweringError(f"{lw.name}: reads a tensor made by torch.empty of which only "
                                f"{covered} of {int(np.prod(self.sizes))} entries were written "
                                f"(the others are uninitialized memory)")
        interleaved = self.interleaved(lw)
        if interleaved is not None:
            return lw.reshape(interleaved, self.shape)
        whole = None  # zeros, every one of them replaced: the regions cover them
        for starts, steps, block in self.blocks:
            whole = put_region(lw, whole, list(starts), list(steps), block, self.sizes)
        return lw.reshape(whole, self.shape)


    def interleaved(self, lw: Lowerer) -> int | None:
        """Regions that interleave along one dim d (s regions of step s,
        starting at 0, ..., s - 1, each n entries with n s the dim's size,
        whole along every other dim): the ``cat`` of the regions, each seen
        ``(n, 1)`` along d, in the order of their starts, seen as the dim
        again (docs/soundness.md, "Plans traced from PyTorch",
        50 (d)). None when they are not such."""
        count = len(self.blocks)
        dims = {d for starts, steps, _ in self.blocks for d, k in enumerate(steps) if k > 1}
        if count < 2 or len(dims) != 1:
            return None
        d = dims.pop()
        by_start = {}
        for starts, steps, block in self.blocks:
            shape = lw.shapes[block]
            if steps[d] != count or shape[d] * count != self.sizes[d] \
                    or any(starts[e] or steps[e] != 1 or shape[e] != self.sizes[e]
                           for e in range(len(self.sizes)) if e != d):
                return None
            by_start[starts[d]] = block
        if sorted(by_start) != list(range(count)):
            return None
        n = self.sizes[d] // count
        parts = [lw.reshape(by_start[k], (*self.sizes[:d], n, 1, *self.sizes[d + 1:]))
                 for k in range(count)]
        pairs = (*self.sizes[:d], n, count, *self.sizes[d + 1:])
        joined = lw.emit("cat", parts, [pairs], {"dim": d + 1})[0]
        return lw.reshape(joined, tuple(self.sizes))


def _indices(start: int, length: int, step: int) -> set[int]:
    return set(range(start, start + length * step, step))


def _overlap(a: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
             b: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]) -> bool:
    """Whether two regions ``(starts, lengths, steps)`` share an entry: they
    do when their indices meet along every dim."""
    return all(_indices(sa, la, ka) & _indices(sb, lb, kb)
               for sa, la, ka, sb, lb, kb in zip(*a, *b))


@lowers("partial_write")
def partial_write(lw: Lowerer, args, kwargs, shapes, group):
    """A tensor read after an op wrote into a region of it through a view
    (``y[1:] += x``, ``y[:, 0] = x``, ``y[..., ::2] = x``; ``record.py``
    gives the region: a start, length and step per dim): the tensor with
    those entries replaced by the view's new value, pieced together with
    ``narrow``, zero padding, reshapes and ``cat`` (docs/soundness.md,
    "Plans traced from PyTorch", 39d and 50). Regions written into
    a tensor made by ``torch.empty`` (MiniCPM3's keys, filled by two
    ``copy_`` into halves; an interleaved rotary embedding's even and odd
    positions) are kept until they cover it (``Written``)."""
    region = args[2] if len(args) > 2 else None
    written = args[3] if len(args) > 3 else None
    base = lw.env.get(args[0][1])
    if region is None or written is None or isinstance(lw.env.get(written[1]), str):
        raise LoweringError(f"{lw.name}: a tensor written in place through a view of part of it "
                            f"({args[1]}) that is no region of it (overlapping or reshaped) is "
                            f"read after; such writes are not lowered: build the tensor with "
                            f"torch.cat or torch.where")
    sizes, dims = region[0], region_dims(region[1])
    w = lw.val(written)
    # the view's dims of size > 1 (in the view's order) put in the base's order
    w = lw.reshape(w, tuple(length for _, length in sorted((at, n) for _, n, at, _ in dims
                                                           if at >= 0)))
    w = permuted(lw, w, [at for _, _, at, _ in dims if at >= 0])
    block = lw.reshape(w, tuple(length for _, length, _, _ in dims))
    starts = tuple(start for start, _, _, _ in dims)
    steps = tuple(step for _, _, _, step in dims)
    if base == "empty" or isinstance(base, Written):
        before = base.blocks if isinstance(base, Written) else ()
        mine = (starts, tuple(lw.shapes[block]), steps)
        if any(_overlap(mine, (s, tuple(lw.shapes[b]), k)) for s, k, b in before):
            raise LoweringError(f"{lw.name}: entries of a tensor made by torch.empty written "
                                f"twice ({args[1]}) are not lowered")
        return Written(tuple(sizes), tuple(shapes[0]), (*before, (starts, steps, block)))
    if isinstance(base, str):
        raise LoweringError(f"{lw.name}: a tensor written in place through a view ({args[1]}) "
                            f"whose base has no value ({base}) is read after")
    x = lw.val(args[0])
    seen = None if x in lw.zeros_made else lw.reshape(x, tuple(sizes))  # zeros: cut no part
    whole = put_region(lw, seen, list(starts), list(steps), block, tuple(sizes))
    return lw.reshape(whole, lw.shapes[x])

