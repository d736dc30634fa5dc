"""Lowerings of more of ``torch.nn``'s activation kernels (LeakyReLU,
Hardtanh/ReLU6, ELU/SELU/CELU, Softplus, Mish, GLU), each written with the
rule table's operators so that the composition equals the kernel's function
in exact real arithmetic, branch conditions included (docs/soundness.md,
"Plans traced from PyTorch", 17).

Handlers have the signature of ``backends.torch.lower.HANDLERS``:
``(lowerer, args, kwargs, out_shapes, group) -> value``. A branch of a
kernel (``x > 0 ? a : b``) is ``b + step(x) * (a - b)``, with ``step`` the
uninterpreted step of the ``relu`` rule's backward (``t * step(y)``, 1 for
``y > 0``, else 0) and ``1 - step(-x)`` for ``x >= 0``; exp, log, tanh and
sigmoid are the rule table's uninterpreted functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.exchange import ALL_TO_ALL
from backends.torch.lower_conv import CONV_HANDLERS


def _arg(args, kwargs, i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _number(lw: Any, a: Any, what: str) -> float:
    value = lw.const(a)
    if value is None:
        raise LoweringError(f"{lw.name}: {what} is not a number")
    return value


def _scaled(lw: Any, x: int, c: float) -> int:
    if c == 1.0:
        return x
    return lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": float(c)})[0]


def _shifted(lw: Any, x: int, c: float) -> int:
    if c == 0.0:
        return x
    return lw.emit("add_scalar", [x], [lw.shapes[x]], {"value": float(c)})[0]


def _binary(lw: Any, op: str, a: int, b: int) -> int:
    return lw.emit(op, [a, b], [lw.shapes[a]])[0]


def _unary(lw: Any, op: str, x: int) -> int:
    return lw.emit(op, [x], [lw.shapes[x]])[0]


def _step_times(lw: Any, y: int, t: int) -> int:
    """``t * step(y)``: the relu rule's backward node."""
    return lw.emit("relu", [y, t], [lw.shapes[t]], direction="bw")[0]


def _branch(lw: Any, cond: int, then: int, other: int) -> int:
    """``cond > 0 ? then : other`` as ``other + step(cond) * (then - other)``."""
    return _binary(lw, "add", other, _step_times(lw, cond, _binary(lw, "sub", then, other)))


def _relu(lw: Any, x: int) -> int:
    return _unary(lw, "relu", x)


# -- LeakyReLU ---------------------------------------------------------------------------------

def leaky_relu(lw: Any, args, kwargs, shapes, group):
    """``x > 0 ? x : a x`` = ``a x + (1 - a) relu(x)`` (relu(x) = x step(x))."""
    x = lw.val(args[0])
    a = _number(lw, _arg(args, kwargs, 1, "negative_slope", 0.01), "leaky_relu's slope")
    return _binary(lw, "add", _scaled(lw, x, a), _scaled(lw, _relu(lw, x), 1.0 - a))


def leaky_relu_backward(lw: Any, args, kwargs, shapes, group):
    """``x > 0 ? g : a g`` = ``a g + (1 - a) g step(x)``. With the output
    given instead of x (in place), its sign is x's for a slope a > 0."""
    g, x = lw.val(args[0]), lw.val(args[1])
    a = _number(lw, _arg(args, kwargs, 2, "negative_slope", 0.01), "leaky_relu's slope")
    if _arg(args, kwargs, 3, "self_is_result", False) and a <= 0:
        raise LoweringError(f"{lw.name}: in-place leaky_relu backward with a slope <= 0")
    return _binary(lw, "add", _scaled(lw, g, a), _scaled(lw, _step_times(lw, x, g), 1.0 - a))


# -- Hardtanh, ReLU6 ---------------------------------------------------------------------------

def _bounds(lw: Any, args, kwargs) -> tuple[float, float]:
    lo = _number(lw, _arg(args, kwargs, 1, "min_val", -1.0), "hardtanh's min_val")
    hi = _number(lw, _arg(args, kwargs, 2, "max_val", 1.0), "hardtanh's max_val")
    if not lo < hi:
        raise LoweringError(f"{lw.name}: hardtanh with min_val {lo} not below max_val {hi}")
    return lo, hi


def hardtanh(lw: Any, args, kwargs, shapes, group):
    """``min(max(x, lo), hi)`` = ``lo + relu(x - lo) - relu(x - hi)`` for lo < hi."""
    x = lw.val(args[0])
    lo, hi = _bounds(lw, args, kwargs)
    above_lo = _relu(lw, _shifted(lw, x, -lo))
    above_hi = _relu(lw, _shifted(lw, x, -hi))
    return _shifted(lw, _binary(lw, "sub", above_lo, above_hi), lo)


def hardtanh_backward(lw: Any, args, kwargs, shapes, group):
    """``lo < x < hi ? g : 0`` = ``g step(x - lo) - g (1 - step(hi - x))``:
    ``x >= hi`` implies ``x > lo``, so the second term removes exactly it."""
    g, x = lw.val(args[0]), lw.val(args[1])
    lo, hi = _bounds(lw, args[1:], {"min_val": kwargs.get("min_val", -1.0),
                                     "max_val": kwargs.get("max_val", 1.0)})
    inside = _step_times(lw, _shifted(lw, x, -lo), g)
    below_hi = _step_times(lw, _shifted(lw, _scaled(lw, x, -1.0), hi), g)
    return _binary(lw, "add", _binary(lw, "sub", inside, g), below_hi)


# -- ELU (SELU, CELU) --------------------------------------------------------------------------

def _elu_params(lw: Any, args, kwargs, first: int) -> tuple[float, float, float]:
    names = ("alpha", "scale", "input_scale")
    values = tuple(_number(lw, _arg(args, kwargs, first + i, n, 1.0), f"elu's {n}")
                   for i, n in enumerate(names))
    if min(values) <= 0:
        raise LoweringError(f"{lw.name}: elu with a non-positive alpha, scale or input_scale")
    return values


def elu(lw: Any, args, kwargs, shapes, group):
    """``x > 0 ? s x : s a (exp(i x) - 1)``."""
    x = lw.val(args[0])
    a, s, i = _elu_params(lw, args, kwargs, 1)
    negative = _scaled(lw, _shifted(lw, _unary(lw, "exp", _scaled(lw, x, i)), -1.0), s * a)
    return _branch(lw, x, _scaled(lw, x, s), negative)


def celu(lw: Any, args, kwargs, shapes, group):
    """``celu(x, a)`` is ``elu(x, a, 1, 1 / a)``."""
    a = _number(lw, _arg(args, kwargs, 1, "alpha", 1.0), "celu's alpha")
    if a <= 0:
        raise LoweringError(f"{lw.name}: celu with alpha <= 0")
    return elu(lw, [args[0], a, 1.0, 1.0 / a], {}, shapes, group)


def elu_backward(lw: Any, args, kwargs, shapes, group):
    """``x > 0 ? g s : g i s a exp(i x)``; given the output y instead (in
    place), ``g i (y + s a)`` on the negative side, and y has x's sign (a,
    s > 0)."""
    g = lw.val(args[0])
    a, s, i = _elu_params(lw, args, kwargs, 1)
    is_result = bool(_arg(args, kwargs, 4, "is_result", False))
    y = lw.val(_arg(args, kwargs, 5, "self_or_result", None))
    if is_result:
        negative = _binary(lw, "mul", g, _scaled(lw, _shifted(lw, y, s * a), i))
    else:
        negative = _binary(lw, "mul", g, _scaled(lw, _unary(lw, "exp", _scaled(lw, y, i)), i * s * a))
    return _branch(lw, y, _scaled(lw, g, s), negative)


# -- Softplus, Mish ----------------------------------------------------------------------------

def _softplus_params(lw: Any, args, kwargs, first: int) -> tuple[float, float]:
    beta = _number(lw, _arg(args, kwargs, first, "beta", 1.0), "softplus's beta")
    threshold = _number(lw, _arg(args, kwargs, first + 1, "threshold", 20.0), "softplus's threshold")
    if beta <= 0:
        raise LoweringError(f"{lw.name}: softplus with beta <= 0")
    return beta, threshold


def _log1p_exp(lw: Any, x: int) -> int:
    return _unary(lw, "log", _shifted(lw, _unary(lw, "exp", x), 1.0))


def softplus(lw: Any, args, kwargs, shapes, group):
    """``b x > t ? x : log(1 + exp(b x)) / b`` (torch's kernel, its
    threshold branch included)."""
    x = lw.val(args[0])
    beta, threshold = _softplus_params(lw, args, kwargs, 1)
    bx = _scaled(lw, x, beta)
    smooth = _scaled(lw, _log1p_exp(lw, bx), 1.0 / beta)
    return _branch(lw, _shifted(lw, bx, -threshold), x, smooth)


def softplus_backward(lw: Any, args, kwargs, shapes, group):
    """``b x > t ? g : g z / (z + 1)``, z = exp(b x): ``z / (z + 1)`` is
    ``sigmoid(b x)``."""
    g, x = lw.val(args[0]), lw.val(args[1])
    beta, threshold = _softplus_params(lw, args, kwargs, 2)
    bx = _scaled(lw, x, beta)
    smooth = _binary(lw, "mul", g, _unary(lw, "sigmoid", bx))
    return _branch(lw, _shifted(lw, bx, -threshold), g, smooth)


def mish(lw: Any, args, kwargs, shapes, group):
    """``x tanh(log(1 + exp(x)))`` (torch's CPU kernel has no threshold)."""
    x = lw.val(args[0])
    return _binary(lw, "mul", x, _unary(lw, "tanh", _log1p_exp(lw, x)))


def mish_backward(lw: Any, args, kwargs, shapes, group):
    """``g (t + x sigmoid(x) (1 - t^2))``, t = tanh(sp), sp = log(1 + exp(x)):
    ``g t`` plus the tanh rule's backward at sp of ``g x sigmoid(x)``."""
    g, x = lw.val(args[0]), lw.val(args[1])
    sp = _log1p_exp(lw, x)
    direct = _binary(lw, "mul", g, _unary(lw, "tanh", sp))
    inner = _binary(lw, "mul", _binary(lw, "mul", g, x), _unary(lw, "sigmoid", x))
    through = lw.emit("tanh", [sp, inner], [lw.shapes[x]], direction="bw")[0]
    return _binary(lw, "add", direct, through)


# -- GLU -----------------------------------------------------------------------------------------

def _halves(lw: Any, x: int, dim: int) -> tuple[int, int, int]:
    shape = list(lw.shapes[x])
    d = dim % len(shape)
    if shape[d] % 2:
        raise LoweringError(f"{lw.name}: glu of an odd dim")
    half = shape[d] // 2
    shape[d] = half
    a, b = (lw.emit("narrow", [x], [shape], {"dim": d, "start": start, "length": half})[0]
            for start in (0, half))
    return a, b, d


def glu(lw: Any, args, kwargs, shapes, group):
    """``a * sigmoid(b)`` for the halves a, b of x along dim."""
    x = lw.val(args[0])
    a, b, _ = _halves(lw, x, int(_arg(args, kwargs, 1, "dim", -1)))
    return _binary(lw, "mul", a, _unary(lw, "sigmoid", b))


def glu_backward(lw: Any, args, kwargs, shapes, group):
    """The halves' gradients ``g sigmoid(b)`` and the sigmoid rule's backward
    at b of ``g a``, concatenated along dim."""
    g, x = lw.val(args[0]), lw.val(args[1])
    a, b, d = _halves(lw, x, int(_arg(args, kwargs, 2, "dim", -1)))
    ga = _binary(lw, "mul", g, _unary(lw, "sigmoid", b))
    gb = lw.emit("sigmoid", [b, _binary(lw, "mul", g, a)], [lw.shapes[b]], direction="bw")[0]
    return lw.emit("cat", [ga, gb], [lw.shapes[x]], {"dim": d})[0]


# -- LogSigmoid, Hardsigmoid, Hardswish, PReLU ------------------------------------------------

def log_sigmoid(lw: Any, args, kwargs, shapes, group):
    """``-log(1 + exp(-x))``; the kernel's second output (a buffer only its
    backward reads) is not lowered."""
    x = lw.val(args[0])
    return [_scaled(lw, _log1p_exp(lw, _scaled(lw, x, -1.0)), -1.0), "log_sigmoid buffer"]


def log_sigmoid_backward(lw: Any, args, kwargs, shapes, group):
    """``g sigmoid(-x)`` (the derivative of ``-log(1 + exp(-x))``)."""
    g, x = lw.val(args[0]), lw.val(args[1])
    return _binary(lw, "mul", g, _unary(lw, "sigmoid", _scaled(lw, x, -1.0)))


def _relu6_of_x_plus_3(lw: Any, x: int) -> int:
    """``min(max(x + 3, 0), 6)`` = ``relu(x + 3) - relu(x - 3)``."""
    return _binary(lw, "sub", _relu(lw, _shifted(lw, x, 3.0)), _relu(lw, _shifted(lw, x, -3.0)))


def hardsigmoid(lw: Any, args, kwargs, shapes, group):
    """``relu6(x + 3) / 6``."""
    return _scaled(lw, _relu6_of_x_plus_3(lw, lw.val(args[0])), 1.0 / 6.0)


def hardsigmoid_backward(lw: Any, args, kwargs, shapes, group):
    """``-3 < x < 3 ? g c : 0`` = ``g c (step(x + 3) - 1 + step(3 - x))``, with
    the kernel's own constant c: 1/6 rounded to float32 (``1.0f / 6.0f``)."""
    g, x = lw.val(args[0]), lw.val(args[1])
    g6 = _scaled(lw, g, float(np.float32(1.0) / np.float32(6.0)))
    above = _step_times(lw, _shifted(lw, x, 3.0), g6)
    below = _step_times(lw, _shifted(lw, _scaled(lw, x, -1.0), 3.0), g6)
    return _binary(lw, "add", _binary(lw, "sub", above, g6), below)


def hardswish(lw: Any, args, kwargs, shapes, group):
    """``x relu6(x + 3) / 6`` (0 for x <= -3, x for x >= 3, as torch's)."""
    x = lw.val(args[0])
    return _binary(lw, "mul", x, _scaled(lw, _relu6_of_x_plus_3(lw, x), 1.0 / 6.0))


def hardswish_backward(lw: Any, args, kwargs, shapes, group):
    """``x < -3 ? 0 : x <= 3 ? g (x / 3 + 1 / 2) : g``: the middle value
    times the indicator of ``x >= -3`` (``1 - step(-3 - x)``), plus ``g``
    minus it where ``x > 3`` (which implies ``x >= -3``)."""
    g, x = lw.val(args[0]), lw.val(args[1])
    middle = _binary(lw, "mul", g, _shifted(lw, _scaled(lw, x, 1.0 / 3.0), 0.5))
    from_minus3 = _binary(lw, "sub", middle, _step_times(lw, _shifted(lw, _scaled(lw, x, -1.0), -3.0),
                                                         middle))
    return _binary(lw, "add", from_minus3,
                   _step_times(lw, _shifted(lw, x, -3.0), _binary(lw, "sub", g, middle)))


def _spread(lw: Any, w: int, shape: tuple[int, ...]) -> int:
    if tuple(lw.shapes[w]) == tuple(shape):
        return w
    return lw.emit("expand", [w], [tuple(shape)], {"shape": list(shape)})[0]


def prelu(lw: Any, args, kwargs, shapes, group):
    """``x > 0 ? x : w x`` = ``relu(x) - w relu(-x)``, w broadcast."""
    x, w = lw.val(args[0]), lw.val(args[1])
    w = _spread(lw, w, lw.shapes[x])
    return _binary(lw, "sub", _relu(lw, x), _binary(lw, "mul", w, _relu(lw, _scaled(lw, x, -1.0))))


def prelu_backward(lw: Any, args, kwargs, shapes, group):
    """Input gradient ``g step(x) + w (g - g step(x))``; the weight's,
    before autograd sums it to w's shape, ``g (x - relu(x))`` (x where
    x <= 0, else 0)."""
    g, x, w = lw.val(args[0]), lw.val(args[1]), lw.val(args[2])
    w = _spread(lw, w, lw.shapes[x])
    kept = _step_times(lw, x, g)
    gx = _binary(lw, "add", kept, _binary(lw, "mul", w, _binary(lw, "sub", g, kept)))
    gw = _binary(lw, "mul", g, _binary(lw, "sub", x, _relu(lw, x)))
    return [gx, gw]


# -- statistics ----------------------------------------------------------------------------------

def _channel_row(lw: Any, x: int) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
    """BatchNorm's reduced dims (all but the channel dim 1), the shape of a
    per-channel statistic kept along them, and of a parameter broadcast
    along the trailing dims."""
    shape = lw.shapes[x]
    if len(shape) < 2:
        raise LoweringError(f"{lw.name}: batch norm of fewer than two dims")
    dims = [d for d in range(len(shape)) if d != 1]
    row = tuple(n if d == 1 else 1 for d, n in enumerate(shape))
    return dims, row, (shape[1],) + (1,) * (len(shape) - 2)


def batch_norm(lw: Any, args, kwargs, shapes, group):
    """Training mode: the statistics of the batch (the rank's own rows, as
    the real run computes them) over every dim but the channels,
    ``y = (x - mean) * rsqrt(var + eps) * w + b``; the running statistics
    the kernel updates in place are read by no loss or gradient."""
    x = lw.val(args[0])
    weight, bias = _arg(args, kwargs, 1, "weight", None), _arg(args, kwargs, 2, "bias", None)
    if not _arg(args, kwargs, 5, "training", False):
        raise LoweringError(f"{lw.name}: batch norm in eval mode (running statistics) is not "
                            f"lowered")
    eps = _number(lw, _arg(args, kwargs, 7, "eps", 1e-5), "batch norm's eps")
    dims, row, param = _channel_row(lw, x)
    shape = lw.shapes[x]
    mean = lw.emit("mean", [x], [row], {"dim": dims, "keepdim": True})[0]
    centered = _binary(lw, "sub", x, mean)
    var = lw.emit("mean", [_binary(lw, "mul", centered, centered)], [row],
                  {"dim": dims, "keepdim": True})[0]
    rstd = _unary(lw, "rsqrt", _shifted(lw, var, eps))
    y = lw.emit("mul", [centered, rstd], [shape])[0]
    lw.ln_y[(x, mean, rstd)] = y
    if weight is not None:
        y = lw.emit("mul", [y, lw.reshape(lw.val(weight), param)], [shape])[0]
    if bias is not None:
        y = lw.emit("add", [y, lw.reshape(lw.val(bias), param)], [shape])[0]
    channels = (shape[1],)
    return [y, lw.reshape(mean, channels), lw.reshape(rstd, channels)]


def batch_norm_backward(lw: Any, args, kwargs, shapes, group):
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
        y = lw.emit("mul", [_binary(lw, "sub", x, mean), rstd], [shape])[0]
    outs: list[Any] = []
    if mask[0]:
        gy = g if weight is None else lw.emit("mul", [g, lw.reshape(lw.val(weight), param)],
                                              [shape])[0]
        m1 = lw.emit("mean", [gy], [row], {"dim": dims, "keepdim": True})[0]
        m2 = lw.emit("mean", [_binary(lw, "mul", gy, y)], [row], {"dim": dims, "keepdim": True})[0]
        inner = _binary(lw, "sub", _binary(lw, "sub", gy, m1), lw.emit("mul", [y, m2], [shape])[0])
        outs.append(lw.emit("mul", [inner, rstd], [shape])[0])
    else:
        outs.append(None)
    channels = (shape[1],)
    outs.append(lw.emit("sum", [_binary(lw, "mul", g, y)], [channels], {"dim": dims, "keepdim": False})[0]
                if mask[1] else None)
    outs.append(lw.emit("sum", [g], [channels], {"dim": dims, "keepdim": False})[0]
                if mask[2] else None)
    return outs


def var(lw: Any, args, kwargs, shapes, group):
    """``sum((x - mean(x))^2, dims) / (n - correction)`` along dims."""
    x = lw.val(args[0])
    nd = len(lw.shapes[x])
    dims = _arg(args, kwargs, 1, "dim", None)
    dims = list(range(nd)) if dims is None else [int(d) % nd for d in dims]
    correction = _number(lw, kwargs.get("correction", 1), "var's correction")
    keepdim = bool(kwargs.get("keepdim", False))
    n = 1
    for d in dims:
        n *= lw.shapes[x][d]
    if n - correction <= 0:
        raise LoweringError(f"{lw.name}: var over {n} values with correction {correction}")
    dim = dims[0] if len(dims) == 1 else dims
    kept = tuple(1 if d in dims else k for d, k in enumerate(lw.shapes[x]))
    mean = lw.emit("mean", [x], [kept], {"dim": dim, "keepdim": True})[0]
    centered = _binary(lw, "sub", x, _spread(lw, mean, lw.shapes[x]))
    total = lw.emit("sum", [_binary(lw, "mul", centered, centered)], shapes,
                    {"dim": dim, "keepdim": keepdim})[0]
    return lw.emit("div", [total], shapes, {"value": float(n - correction)})[0]


# -- losses written with logarithms ---------------------------------------------------------------

def bce_with_logits(lw: Any, args, kwargs, shapes, group):
    """``(1 - t) x + log(1 + exp(-x))`` (torch's kernel, with its max shift,
    which cancels in exact arithmetic) = ``log(1 + exp(x)) - t x``; summed
    or averaged. Class weights and ``pos_weight`` are not lowered."""
    x, t = lw.val(args[0]), lw.val(args[1])
    weight = _arg(args, kwargs, 2, "weight", None)
    pos_weight = _arg(args, kwargs, 3, "pos_weight", None)
    reduction = int(_arg(args, kwargs, 4, "reduction", 1))
    if weight is not None or pos_weight is not None:
        raise LoweringError(f"{lw.name}: binary_cross_entropy_with_logits with weight or "
                            f"pos_weight is not lowered")
    per = _binary(lw, "sub", _log1p_exp(lw, x), _binary(lw, "mul", t, x))
    if reduction == 0:
        return per
    out = lw.emit("sum", [per], [()], {"dim": None, "keepdim": False})[0]
    if reduction == 1:
        count = 1
        for n in lw.shapes[x]:
            count *= n
        out = lw.emit("div", [out], [()], {"value": float(count)})[0]
    return out


def xlogy(lw: Any, args, kwargs, shapes, group):
    """``x log(y)`` (0 where x is 0, log uninterpreted: exact wherever
    torch's value is finite; ``F.kl_div``'s ``t log t``)."""
    x, y = lw.val(args[0]), lw.val(args[1])
    if lw.shapes[x] != lw.shapes[y]:
        raise LoweringError(f"{lw.name}: xlogy of differently shaped tensors is not lowered")
    return _binary(lw, "mul", x, _unary(lw, "log", y))


def logsumexp(lw: Any, args, kwargs, shapes, group):
    """``log(sum(exp(x), dims))``: torch's max shift cancels in exact
    arithmetic (``m + log(sum(exp(x - m))) = log(sum(exp(x)))``)."""
    x = lw.val(args[0])
    dims = _arg(args, kwargs, 1, "dim", None)
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    dims = [int(d) % len(lw.shapes[x]) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    dim = dims[0] if len(dims) == 1 else dims
    total = lw.emit("sum", [_unary(lw, "exp", x)], shapes, {"dim": dim, "keepdim": keepdim})[0]
    return _unary(lw, "log", total)


def partial_write(lw: Any, args, kwargs, shapes, group):
    """A tensor read after an op wrote into part of it (``record.py``)."""
    raise LoweringError(f"{lw.name}: a tensor written in place through a view of part of it "
                        f"({args[1]}, e.g. y[:, 0] = ...) is read after; such writes are not "
                        f"lowered: build the tensor with torch.cat or torch.where")


#: the recorder's event for ``.tolist()``, ``.numpy()``, ``np.asarray(t)`` (``record.ValueReads``)
VALUE_READ_EVENT = "python.value_read"
#: ops that hand a tensor's value to Python (``.item()``, ``bool(t)``, ``torch.equal``)
VALUE_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default",
               VALUE_READ_EVENT}


def check_no_value_reads(trace: dict) -> None:
    """Refuse a step in which Python read the value of a tensor that depends
    on the parameters or a collective (``if h.sum() > 0:``, ``.item()``):
    the trace holds one path of the program, chosen by that value, and
    other parameters may take another path, which no plan of this trace
    describes (a collective's value is not even real under the fake group).
    A value computed from the batch's ids and constants only
    (``ignore_index=int(labels[0, 0])``) is a fact of the traced step, as
    the label counts a mean divides by are, and so is the device mesh's
    own bookkeeping, and so are the answers to an all-to-all of such
    values (the token counts: exchange.py)."""
    tainted: set[int] = {v for v, _, _ in trace["params"].values()}
    constants = set(trace.get("constants", ()))
    for op, (args, kwargs), outs, _shapes, scope, *_ in trace["events"]:
        read = _values_read([args, kwargs])
        if op in VALUE_READS and tainted.intersection(read):
            raise LoweringError(f"{scope or 'top level'}: Python reads the value of a computed "
                                f"tensor ({op}: .item(), .tolist(), .numpy(), bool(), an if on a "
                                f"tensor), so the "
                                f"step's path depends on values; data-dependent control flow "
                                f"is not lowered")
        if op == "aten.topk.default" and outs[1:2] and outs[1] in trace.get("constants", ()):
            tainted.update(outs[:1])  # its indices are the recorded routing (routing.py)
            continue
        if outs and set(outs) <= constants and (
                op in ALL_TO_ALL and not tainted.intersection(read)
                or not op.startswith(("c10d", "_c10d_functional"))):
            # a constant (of shapes and constants only: zeros_like(scores)),
            # or counts answered with the members' constants (exchange.py)
            continue
        if op.startswith(("c10d", "_c10d_functional")) or tainted.intersection(read):
            tainted.update(outs)


def _values_read(args: Any) -> list[int]:
    if isinstance(args, (list, tuple)):
        if len(args) == 2 and args[0] == "v" and isinstance(args[1], int):
            return [args[1]]
        return [v for a in args for v in _values_read(a)]
    if isinstance(args, dict):
        return [v for a in args.values() for v in _values_read(a)]
    return []


MORE_HANDLERS: dict[str, Any] = {
    "aten.native_batch_norm.default": batch_norm,
    "aten.native_batch_norm_backward.default": batch_norm_backward,
    "aten.log_sigmoid_forward.default": log_sigmoid,
    "aten.log_sigmoid_backward.default": log_sigmoid_backward,
    "aten.hardsigmoid.default": hardsigmoid,
    "aten.hardsigmoid_backward.default": hardsigmoid_backward,
    "aten.hardswish.default": hardswish,
    "aten.hardswish_backward.default": hardswish_backward,
    "aten._prelu_kernel.default": prelu,
    "aten._prelu_kernel_backward.default": prelu_backward,
    "aten.var.correction": var,
    "partial_write": partial_write,
    "aten.binary_cross_entropy_with_logits.default": bce_with_logits,
    "aten.xlogy.Tensor": xlogy,
    "aten.logsumexp.default": logsumexp,
    "aten.leaky_relu.default": leaky_relu,
    "aten.leaky_relu_.default": leaky_relu,
    "aten.leaky_relu_backward.default": leaky_relu_backward,
    "aten.hardtanh.default": hardtanh,
    "aten.hardtanh_.default": hardtanh,
    "aten.hardtanh_backward.default": hardtanh_backward,
    "aten.elu.default": elu,
    "aten.elu_.default": elu,
    "aten.elu_backward.default": elu_backward,
    "aten.celu.default": celu,
    "aten.celu_.default": celu,
    "aten.softplus.default": softplus,
    "aten.softplus_backward.default": softplus_backward,
    "aten.mish.default": mish,
    "aten.mish_.default": mish,
    "aten.mish_backward.default": mish_backward,
    "aten.glu.default": glu,
    "aten.glu_backward.default": glu_backward,
    **CONV_HANDLERS,
}
