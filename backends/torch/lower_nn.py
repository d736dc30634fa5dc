"""Lowerings of the kernels stock ``torch.nn`` layers run on the CPU, and of
the constants models compute (positions, masks, tables).

Each handler has the signature of ``backends.torch.lower.HANDLERS``:
``(lowerer, args, kwargs, out_shapes, group) -> value(s)``, and emits nodes
of the rule table whose composition is exactly the kernel's function in
real arithmetic (layer norm as mean, sub, mul and rsqrt; attention as
matmul, softmax and matmul; the backward kernels as the derivatives written
out). Non-linear functions are rule-table operators (gelu, tanh, sigmoid,
relu, silu, softmax), uninterpreted in the symbolic backend.

A value that depends on no parameter, data or collective (a *constant*:
``torch.arange`` positions, a mask built from ``torch.ones(...).tril()``,
a table computed in ``forward``) is not lowered op by op: the recorder
keeps its value, and where a lowered op reads it, it becomes a plan input
named by its value (so the single-device plan and every rank read one
logical input when they use the same constant). A mask is recognized by
its value as the causal pattern, which the rule table has an operator for.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.torch.errors import LoweringError
from verdict.ops.nn import causal_positions


@dataclass(frozen=True)
class Const:
    """Recorded value ``v``, a constant, computed by event ``event`` (not
    lowered until a lowered op reads it)."""
    v: int
    event: int


@dataclass(frozen=True)
class SdpaSaved:
    """What the attention backward recomputes from: the inputs, the masked
    scores (the softmax's input) and the probabilities."""
    q: int
    k: int
    v: int
    scale: float
    masked: int
    probs: int
    causal: bool
    groups: int = 1  # query heads per key-value head (grouped-query attention)
    #: the probabilities are a masked softmax (backends/torch/lower_masks.py):
    #: their backward is written on them (``softmax_grad``), not on the scores
    masked_probs: bool = False


@dataclass(frozen=True)
class Complex:
    """A complex tensor as its real and imaginary parts (lowered values)."""
    re: int
    im: int


NEG_INF = float("-inf")


# -- constants ------------------------------------------------------------------

def constant_value(lw: Any, a: Any) -> np.ndarray | None:
    """The value of a recorded constant argument (None: not a constant)."""
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
        return None
    if a[1] not in lw.trace.get("constants", ()):
        return None
    value = lw.trace.get("constvals", {}).get(a[1])
    if value is None:
        raise LoweringError(f"{lw.name}: a constant tensor too large to keep is read")
    return value


def constant_input(lw: Any, value: np.ndarray) -> int:
    """The plan input holding ``value`` (one per distinct value and rank),
    named by its value."""
    array = np.ascontiguousarray(np.asarray(value, dtype=np.float64))
    if not np.all(np.isfinite(array)):
        raise LoweringError(f"{lw.name}: a constant with infinite entries is read as a tensor "
                            f"(only the causal mask pattern is lowered)")
    digest = hashlib.sha1(repr(array.shape).encode() + array.tobytes()).hexdigest()[:16]
    name = f"const.{'x'.join(map(str, array.shape)) or 'scalar'}.{digest}"
    if name not in lw.const_inputs:
        x = lw.new(array.shape)
        lw.inputs[x] = ("buffer", name)
        lw.axes[x] = [[] for _ in array.shape]
        lw.const_inputs[name] = x
        lw.const_values[x] = array
    return lw.const_inputs[name]


def one_hot_constant(lw: Any, ids: np.ndarray, rows: int) -> int:
    """Constant integer ids (positions) as the one-hot input ``[..., rows]``."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise LoweringError(f"{lw.name}: constant ids outside [0, {rows}) index an embedding")
    return constant_input(lw, np.eye(rows)[ids])


def _causal_fill(mask: np.ndarray, shape: tuple[int, ...]) -> bool:
    """``mask`` (True where filled), broadcast to ``shape``, marks exactly
    the keys after each query: the causal pattern of the last two dims."""
    try:
        m = np.broadcast_to(np.asarray(mask, dtype=bool), shape)
    except ValueError:
        return False
    if len(shape) < 2:
        return False
    pattern = causal_positions(shape[-2], shape[-1], 0, 0)
    return bool(np.array_equal(m, np.broadcast_to(pattern, shape)))


def _additive_mask(lw: Any, x: int, mask: np.ndarray, shape: tuple[int, ...]) -> int:
    """``x + mask`` for a constant float mask: its finite entries added as a
    constant, its -inf entries the causal mask (any other -inf pattern is
    refused: -inf is no number a plan input can hold)."""
    m = np.asarray(mask, dtype=np.float64)
    if np.any(np.isnan(m) | np.isposinf(m)):
        raise LoweringError(f"{lw.name}: an attention mask with nan or +inf entries is not lowered")
    hidden = np.isneginf(m)
    if hidden.any() and not _causal_fill(hidden, shape):
        raise LoweringError(f"{lw.name}: an attention mask hiding other positions than the causal "
                            f"pattern with -inf is not lowered (a finite fill, such as "
                            f"torch.finfo(dtype).min, is)")
    finite = np.where(hidden, 0.0, m)
    if np.any(finite != 0):
        x = lw.emit("add", [x, constant_input(lw, finite)], [shape])[0]
    if hidden.any():
        x = lw.emit("causal_mask", [x], [shape])[0]
    return x


def causal_add(lw: Any, args: Any, shapes: list) -> int | None:
    """``scores + mask`` with a constant mask holding -inf: the causal mask
    (and the mask's finite entries added as a constant)."""
    for mine, other in ((args[0], args[1]), (args[1], args[0])):
        value = constant_value(lw, mine)
        if value is not None and value.size > 1 and np.any(np.isneginf(value)):
            x = lw.val(other)
            if lw.shapes[x] != tuple(shapes[0]):
                raise LoweringError(f"{lw.name}: a causal mask broadcasting its scores")
            return _additive_mask(lw, x, value, tuple(shapes[0]))
    return None


def _masked(lw: Any, x: Any, hidden: np.ndarray, fill: float | None, shapes: list) -> int:
    """``x`` with the positions ``hidden`` (a constant boolean mask) set to
    ``fill``: -inf on the causal pattern is the causal mask, 0 there its
    backward; any finite fill of any constant mask is ``x * keep + fill *
    hidden``, both constants."""
    shape = tuple(shapes[0])
    causal = _causal_fill(hidden, shape)
    if fill == NEG_INF and causal:
        return lw.emit("causal_mask", [lw.val(x)], shapes)[0]
    if fill == 0 and causal:
        return lw.emit("causal_mask", [-1, lw.val(x)], shapes, direction="bw")[0]
    if fill is None or not math.isfinite(fill):
        raise LoweringError(f"{lw.name}: masking with the value {fill} at other positions than "
                            f"the causal pattern is not lowered (only a finite fill, or -inf on "
                            f"the causal pattern, is exact)")
    hidden = np.asarray(hidden, dtype=bool)
    out = lw.emit("mul", [lw.val(x), constant_input(lw, (~hidden).astype(np.float64))], shapes)[0]
    if fill != 0:
        out = lw.emit("add", [out, constant_input(lw, hidden * fill)], shapes)[0]
    return out


def masked_fill(lw: Any, args, kwargs, shapes, group):
    mask = constant_value(lw, args[1])
    if mask is None:
        raise LoweringError(f"{lw.name}: masked_fill with a mask that is not a constant is not "
                            f"lowered")
    return _masked(lw, args[0], np.asarray(mask, dtype=bool), lw.const(args[2]), shapes)


def where(lw: Any, args, kwargs, shapes, group):
    """``where(mask, x, fill)`` or ``where(mask, fill, x)`` with a constant
    mask and a constant fill: a masked fill."""
    cond = constant_value(lw, args[0])
    if cond is not None:
        cond = np.asarray(cond, dtype=bool)
        if lw.const(args[2]) is not None:
            return _masked(lw, args[1], ~cond, lw.const(args[2]), shapes)
        if lw.const(args[1]) is not None:
            return _masked(lw, args[2], cond, lw.const(args[1]), shapes)
    raise LoweringError(f"{lw.name}: where with a condition that is not a constant, or no "
                        f"constant fill, is not lowered")


# -- linear, norms, activations -------------------------------------------------

def addmm(lw: Any, args, kwargs, shapes, group):
    """bias + m1 @ m2 (``nn.Linear`` with a bias)."""
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        raise LoweringError(f"{lw.name}: addmm with beta or alpha is not lowered")
    mm = lw.emit("matmul", [lw.val(args[1]), lw.val(args[2])], shapes)[0]
    return lw.emit("add", [mm, lw.val(args[0])], shapes)[0]


def baddbmm(lw: Any, args, kwargs, shapes, group):
    """input + alpha * (b1 @ b2) (``nn.MultiheadAttention``'s scores with its
    mask as ``input``: a constant mask holding -inf is the causal mask)."""
    beta = float(args[3] if len(args) > 3 else kwargs.get("beta", 1))
    alpha = float(args[4] if len(args) > 4 else kwargs.get("alpha", 1))
    if beta not in (0, 1):
        raise LoweringError(f"{lw.name}: baddbmm with beta {beta} is not lowered")
    shape = tuple(shapes[0])
    out = lw.emit("matmul", [lw.val(args[1]), lw.val(args[2])], [shape])[0]
    if alpha != 1:
        out = lw.emit("mul_scalar", [out], [shape], {"value": alpha})[0]
    if beta == 0:  # the input is not read (torch ignores it, NaN included): Megatron's scores
        return out
    mask = constant_value(lw, args[0])
    if mask is not None and np.any(np.isneginf(mask)):
        return _additive_mask(lw, out, mask, shape)
    return lw.emit("add", [out, lw.val(args[0])], [shape])[0]


def _norm_dims(lw: Any, x: int, normalized: Any) -> list[int]:
    nd = len(lw.shapes[x])
    k = len(normalized)
    if not 1 <= k <= nd or list(lw.shapes[x][nd - k:]) != list(normalized):
        raise LoweringError(f"{lw.name}: layer norm over {normalized} of a {list(lw.shapes[x])} tensor")
    return list(range(nd - k, nd))


def _normalized(lw: Any, x: int, mean: int, rstd: int) -> int:
    """(x - mean) * rstd, once per (x, mean, rstd)."""
    key = (x, mean, rstd)
    if key not in lw.ln_y:
        shape = lw.shapes[x]
        centered = lw.emit("sub", [x, mean], [shape])[0]
        lw.ln_y[key] = lw.emit("mul", [centered, rstd], [shape])[0]
    return lw.ln_y[key]


def layer_norm(lw: Any, args, kwargs, shapes, group):
    """mean, rstd = rsqrt(mean((x - mean)^2) + eps); y = (x - mean) * rstd * w + b."""
    x = lw.val(args[0])
    dims = _norm_dims(lw, x, args[1])
    weight, bias, eps = args[2], args[3], float(args[4])
    shape = lw.shapes[x]
    row = tuple(1 if d in dims else n for d, n in enumerate(shape))
    mean = lw.emit("mean", [x], [row], {"dim": dims, "keepdim": True})[0]
    centered = lw.emit("sub", [x, mean], [shape])[0]
    var = lw.emit("mean", [lw.emit("mul", [centered, centered], [shape])[0]], [row],
                  {"dim": dims, "keepdim": True})[0]
    rstd = lw.emit("rsqrt", [lw.emit("add_scalar", [var], [row], {"value": eps})[0]], [row])[0]
    y = lw.emit("mul", [centered, rstd], [shape])[0]
    lw.ln_y[(x, mean, rstd)] = y
    if weight is not None:
        y = lw.emit("mul", [y, lw.val(weight)], [shape])[0]
    if bias is not None:
        y = lw.emit("add", [y, lw.val(bias)], [shape])[0]
    return [y, mean, rstd]


def layer_norm_backward(lw: Any, args, kwargs, shapes, group):
    """dx = rstd * (gy - mean(gy) - y * mean(gy * y)) with gy = g * w,
    dw = sum(g * y), db = sum(g) over the leading dims."""
    g, x = lw.val(args[0]), lw.val(args[1])
    dims = _norm_dims(lw, x, args[2])
    mean, rstd = lw.val(args[3]), lw.val(args[4])
    weight, bias, mask = args[5], args[6], list(args[7])
    shape = lw.shapes[x]
    row = tuple(1 if d in dims else n for d, n in enumerate(shape))
    lead = [d for d in range(len(shape)) if d not in dims]
    y = _normalized(lw, x, mean, rstd)
    outs = []
    if mask[0]:
        gy = g if weight is None else lw.emit("mul", [g, lw.val(weight)], [shape])[0]
        m1 = lw.emit("mean", [gy], [row], {"dim": dims, "keepdim": True})[0]
        m2 = lw.emit("mean", [lw.emit("mul", [gy, y], [shape])[0]], [row],
                     {"dim": dims, "keepdim": True})[0]
        centered = lw.emit("sub", [gy, m1], [shape])[0]
        inner = lw.emit("sub", [centered, lw.emit("mul", [y, m2], [shape])[0]], [shape])[0]
        outs.append(lw.emit("mul", [inner, rstd], [shape])[0])
    param_shape = tuple(shape[d] for d in dims)
    if mask[1] and weight is not None:
        outs.append(lw.emit("sum", [lw.emit("mul", [g, y], [shape])[0]], [param_shape],
                            {"dim": lead, "keepdim": False})[0])
    if mask[2] and bias is not None:
        outs.append(lw.emit("sum", [g], [param_shape], {"dim": lead, "keepdim": False})[0])
    return outs


def activation(op: str, kw_names: tuple[str, ...] = ()):
    """A unary activation; its input is remembered for a backward kernel
    that reads the output (tanh, sigmoid, relu)."""
    def lower(lw: Any, args, kwargs, shapes, group):
        x = lw.val(args[0])
        kw = {}
        for i, name in enumerate(kw_names, start=1):
            kw[name] = args[i] if len(args) > i else kwargs.get(name, "none")
        out = lw.emit(op, [x], shapes, kw)[0]
        lw.fw_in[out] = (op, x)
        return out
    return lower


def activation_backward_of_output(op: str):
    """``op_backward(grad, output)``: the rule's backward node on the input
    of the op that produced ``output``."""
    def lower(lw: Any, args, kwargs, shapes, group):
        out = lw.val(args[1])
        producer, x = lw.fw_in.get(out, ("", -1))
        if producer != op:
            raise LoweringError(f"{lw.name}: {op} backward of a value no {op} produced")
        if op == "relu" and lw.const(args[2]) != 0:
            raise LoweringError(f"{lw.name}: threshold backward with a threshold other than 0")
        return lw.emit(op, [x, lw.val(args[0])], shapes, direction="bw")[0]
    return lower


def gelu_backward(lw: Any, args, kwargs, shapes, group):
    approximate = args[2] if len(args) > 2 else kwargs.get("approximate", "none")
    return lw.emit("gelu", [lw.val(args[1]), lw.val(args[0])], shapes,
                   {"approximate": approximate}, direction="bw")[0]


def _step_times(lw: Any, y: int, t: int) -> int:
    """t * step(y), step(y) = 1 for y > 0, else 0: the relu rule's backward."""
    return lw.emit("relu", [y, t], [lw.shapes[t]], direction="bw")[0]


def _negated(lw: Any, x: int) -> int:
    return lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": -1.0})[0]


def _abs(lw: Any, x: int) -> int:
    """|x| = relu(x) + relu(-x) (exact: x step(x) - x step(-x))."""
    shape = [lw.shapes[x]]
    pos = lw.emit("relu", [x], shape)[0]
    return lw.emit("add", [pos, lw.emit("relu", [_negated(lw, x)], shape)[0]], shape)[0]


def _sgn_times(lw: Any, x: int, t: int) -> int:
    """t * sgn(x) = t step(x) - t step(-x) (0 at 0, as torch's sgn)."""
    return lw.emit("sub", [_step_times(lw, x, t), _step_times(lw, _negated(lw, x), t)],
                   [lw.shapes[t]])[0]


def abs_(lw: Any, args, kwargs, shapes, group):
    return _abs(lw, lw.val(args[0]))


def sgn(lw: Any, args, kwargs, shapes, group):
    x = lw.val(args[0])
    ones = lw.emit("ones", [], [lw.shapes[x]], {"shape": list(lw.shapes[x])}, direction="none")[0]
    return _sgn_times(lw, x, ones)


def neg(lw: Any, args, kwargs, shapes, group):
    return lw.emit("mul_scalar", [lw.val(args[0])], shapes, {"value": -1.0})[0]


def rsub(lw: Any, args, kwargs, shapes, group):
    """other - alpha * x."""
    alpha = float(args[2] if len(args) > 2 else kwargs.get("alpha", 1))
    other = lw.const(args[1])
    if other is not None:
        scaled = lw.emit("mul_scalar", [lw.val(args[0])], shapes, {"value": -alpha})[0]
        return lw.emit("add_scalar", [scaled], shapes, {"value": other})[0]
    if alpha != 1:
        raise LoweringError(f"{lw.name}: rsub of a tensor with alpha is not lowered")
    return lw.emit("sub", [lw.val(args[1]), lw.val(args[0])], shapes)[0]


# -- losses ---------------------------------------------------------------------

def _reduction(lw: Any, args: Any, at: int, kwargs: dict) -> int:
    reduction = int(args[at] if len(args) > at else kwargs.get("reduction", 1))
    if reduction not in (0, 1, 2):
        raise LoweringError(f"{lw.name}: loss reduction {reduction} is not lowered")
    return reduction


def mse_loss(lw: Any, args, kwargs, shapes, group):
    """mean or sum of (x - t)^2."""
    x, t = lw.val(args[0]), lw.val(args[1])
    reduction = _reduction(lw, args, 2, kwargs)
    shape = lw.shapes[x]
    if lw.shapes[t] != shape:
        raise LoweringError(f"{lw.name}: mse_loss of a target that broadcasts")
    diff = lw.emit("sub", [x, t], [shape])[0]
    sq = lw.emit("mul", [diff, diff], [shape])[0]
    if reduction == 0:
        return sq
    return lw.emit("mean" if reduction == 1 else "sum", [sq], shapes,
                   {"dim": None, "keepdim": False})[0]


def mse_loss_backward(lw: Any, args, kwargs, shapes, group):
    """2 * (x - t) * g, divided by the element count for a mean."""
    g, x, t = lw.val(args[0]), lw.val(args[1]), lw.val(args[2])
    reduction = _reduction(lw, args, 3, kwargs)
    shape = lw.shapes[x]
    diff = lw.emit("sub", [x, t], [shape])[0]
    out = lw.emit("mul", [lw.emit("mul_scalar", [diff], [shape], {"value": 2.0})[0], g], [shape])[0]
    if reduction == 1:
        out = lw.emit("div", [out], [shape], {"value": float(math.prod(shape))})[0]
    return out


def _robust_parts(lw: Any, args: Any, kwargs: dict, at: int, name: str) -> tuple[int, int, float]:
    """(x - t, reduction, beta) of a smooth L1 or Huber loss or its backward."""
    x, t = lw.val(args[at]), lw.val(args[at + 1])
    if lw.shapes[t] != lw.shapes[x]:
        raise LoweringError(f"{lw.name}: {name} of a target that broadcasts")
    reduction = _reduction(lw, args, at + 2, kwargs)
    beta = float(args[at + 3] if len(args) > at + 3 else kwargs.get(
        "beta" if name == "smooth_l1_loss" else "delta", 1.0))
    if beta <= 0:
        raise LoweringError(f"{lw.name}: {name} with beta {beta} is not lowered (beta > 0)")
    return lw.emit("sub", [x, t], [lw.shapes[x]])[0], reduction, beta


def _near(lw: Any, d: int, beta: float) -> int:
    """beta - |d|: positive exactly where the loss is quadratic."""
    return lw.emit("add_scalar", [_negated(lw, _abs(lw, d))], [lw.shapes[d]], {"value": beta})[0]


def robust_loss(name: str):
    """Smooth L1 (beta) and Huber (delta) losses: elementwise
    ``|d| - beta/2 + step(beta - |d|) (d^2 / (2 beta) - |d| + beta/2)``, Huber
    that times delta, then reduced."""
    def lower(lw: Any, args, kwargs, shapes, group):
        d, reduction, beta = _robust_parts(lw, args, kwargs, 0, name)
        shape = [lw.shapes[d]]
        lin = lw.emit("add_scalar", [_abs(lw, d)], shape, {"value": -0.5 * beta})[0]
        quad = lw.emit("mul_scalar", [lw.emit("mul", [d, d], shape)[0]], shape,
                       {"value": 0.5 / beta})[0]
        out = lw.emit("add", [lin, _step_times(lw, _near(lw, d, beta),
                                               lw.emit("sub", [quad, lin], shape)[0])], shape)[0]
        if name == "huber_loss":
            out = lw.emit("mul_scalar", [out], shape, {"value": beta})[0]
        if reduction == 0:
            return out
        return lw.emit("mean" if reduction == 1 else "sum", [out], shapes,
                       {"dim": None, "keepdim": False})[0]
    return lower


def robust_loss_backward(name: str):
    """``g * (sgn(d) + step(beta - |d|) (d / beta - sgn(d)))``, Huber's times
    delta, divided by the element count for a mean."""
    def lower(lw: Any, args, kwargs, shapes, group):
        d, reduction, beta = _robust_parts(lw, args, kwargs, 1, name)
        shape = lw.shapes[d]
        g = lw.val(args[0])
        if lw.shapes[g] != shape:
            g = lw.emit("expand", [g], [shape], {"shape": list(shape)})[0]
        sg = _sgn_times(lw, d, g)
        lin = lw.emit("mul_scalar", [lw.emit("mul", [d, g], [shape])[0]], [shape],
                      {"value": 1.0 / beta})[0]
        out = lw.emit("add", [sg, _step_times(lw, _near(lw, d, beta),
                                              lw.emit("sub", [lin, sg], [shape])[0])], [shape])[0]
        if name == "huber_loss":
            out = lw.emit("mul_scalar", [out], [shape], {"value": beta})[0]
        if reduction == 1:
            out = lw.emit("div", [out], [shape], {"value": float(math.prod(shape))})[0]
        return out
    return lower


# -- attention ------------------------------------------------------------------

def _transposed(lw: Any, x: int) -> int:
    shape = list(lw.shapes[x])
    shape[-1], shape[-2] = shape[-2], shape[-1]
    nd = len(shape)
    return lw.emit("transpose", [x], [shape], {"dim0": nd - 2, "dim1": nd - 1})[0]


def _sdpa_options(lw: Any, args: Any, kwargs: dict, at: int) -> tuple[float, bool, Any]:
    dropout = float(args[at] if len(args) > at else kwargs.get("dropout_p", 0.0))
    causal = bool(args[at + 1] if len(args) > at + 1 else kwargs.get("is_causal", False))
    if dropout != 0.0:
        raise LoweringError(f"{lw.name}: scaled_dot_product_attention with dropout_p = {dropout} "
                            f"draws random numbers: set it to 0 (dropout is not lowered)")
    return dropout, causal, kwargs.get("attn_mask")


def _repeat_heads(lw: Any, x: int, groups: int) -> int:
    """``[B, H, S, D]`` with each head repeated ``groups`` times in place
    (``repeat_interleave(groups, dim=1)``): unflatten, expand, flatten."""
    b, h, s, d = lw.shapes[x]
    wide = (b, h, groups, s, d)
    x = lw.emit("expand", [lw.reshape(x, (b, h, 1, s, d))], [wide], {"shape": list(wide)})[0]
    return lw.reshape(x, (b, h * groups, s, d))


def _sum_heads(lw: Any, g: int, groups: int) -> int:
    """The backward of ``_repeat_heads``: each group of heads summed."""
    b, hq, s, d = lw.shapes[g]
    g = lw.reshape(g, (b, hq // groups, groups, s, d))
    return lw.emit("sum", [g], [(b, hq // groups, s, d)], {"dim": [2], "keepdim": False})[0]


def sdpa_scores(lw: Any, args, kwargs) -> tuple[int, int, int, float, int, int, bool, Any]:
    """``q @ k^T * scale`` of the CPU flash kernel's arguments: (q, the keys
    and values with each key-value head repeated for its query heads, scale,
    scores, groups, is_causal, the attn_mask argument)."""
    q, k, v = (lw.val(a) for a in args[:3])
    _, causal, mask = _sdpa_options(lw, args, kwargs, 3)
    qs, ks, vs = lw.shapes[q], lw.shapes[k], lw.shapes[v]
    if len(qs) != 4 or len(ks) != 4 or ks[0] != qs[0] or vs[:3] != ks[:3] or qs[-1] != ks[-1] \
            or not ks[1] or qs[1] % ks[1]:
        raise LoweringError(f"{lw.name}: attention of shapes {list(qs)}, {list(ks)}, {list(vs)} "
                            f"is not lowered")
    groups = qs[1] // ks[1]
    keys, values = (k, v) if groups == 1 else (_repeat_heads(lw, k, groups),
                                               _repeat_heads(lw, v, groups))
    scale = kwargs.get("scale")
    scale = 1.0 / math.sqrt(qs[-1]) if scale is None else float(scale)
    scores_shape = (*qs[:3], ks[2])
    scores = lw.emit("matmul", [q, _transposed(lw, keys)], [scores_shape])[0]
    scores = lw.emit("mul_scalar", [scores], [scores_shape], {"value": scale})[0]
    if causal and scores_shape[-1] != scores_shape[-2]:
        raise LoweringError(f"{lw.name}: causal attention of {scores_shape[-2]} queries over "
                            f"{scores_shape[-1]} keys is not lowered")
    return q, keys, values, scale, scores, groups, causal, mask


def sdpa(lw: Any, args, kwargs, shapes, group):
    """softmax(mask(q @ k^T * scale)) @ v (the CPU flash kernel's function);
    with fewer key-value heads than query heads (``enable_gqa``), each
    key-value head serves ``groups`` consecutive query heads."""
    q, keys, values, scale, scores, groups, causal, mask = sdpa_scores(lw, args, kwargs)
    scores_shape = lw.shapes[scores]
    if mask is not None:
        value = constant_value(lw, mask)
        if causal or value is None:
            raise LoweringError(f"{lw.name}: an attention mask that is not a constant (or given "
                                f"with is_causal) is not lowered")
        if value.dtype == bool:
            value = np.where(value, 0.0, NEG_INF)
        scores = _additive_mask(lw, scores, value, scores_shape)
        causal = bool(np.any(np.isneginf(value)))
    elif causal:
        scores = lw.emit("causal_mask", [scores], [scores_shape])[0]
    probs = lw.emit("softmax", [scores], [scores_shape], {"dim": -1})[0]
    lw.fw_in[probs] = ("softmax", scores)
    out = lw.emit("matmul", [probs, values], [shapes[0]])[0]
    lw.sdpa[out] = SdpaSaved(q, keys, values, scale, scores, probs, causal, groups)
    return [out, "logsumexp"]


def softmax_grad(lw: Any, p: int, g: int, dim: int) -> int:
    """The softmax backward written on its probabilities ``p``: ``p * g -
    p * sum(p * g)`` along ``dim`` (the derivative of ``p = K exp(x) /
    sum(K exp(x))`` for any constant K, so of a masked softmax too)."""
    shape = lw.shapes[p]
    dim %= len(shape)
    row = [*shape[:dim], 1, *shape[dim + 1:]]
    pg = lw.emit("mul", [p, g], [shape])[0]
    total = lw.emit("sum", [pg], [row], {"dim": dim, "keepdim": True})[0]
    return lw.emit("sub", [pg, lw.emit("mul", [p, total], [shape])[0]], [shape])[0]


def sdpa_backward(lw: Any, args, kwargs, shapes, group):
    """dv = p^T g; ds = softmax'(g v^T) (masked); dq = ds k * scale; dk = ds^T q * scale."""
    g, out = lw.val(args[0]), lw.val(args[4])
    saved = lw.sdpa.get(out)
    if saved is None:
        raise LoweringError(f"{lw.name}: attention backward of an output no attention produced")
    _sdpa_options(lw, args, kwargs, 6)
    shape = lw.shapes[saved.masked]
    dv = lw.emit("matmul", [_transposed(lw, saved.probs), g], [lw.shapes[saved.v]])[0]
    dp = lw.emit("matmul", [g, _transposed(lw, saved.v)], [shape])[0]
    if saved.masked_probs:
        ds = softmax_grad(lw, saved.probs, dp, -1)
    else:
        ds = lw.emit("softmax", [saved.masked, dp], [shape], {"dim": -1}, direction="bw")[0]
    if saved.causal:
        ds = lw.emit("causal_mask", [-1, ds], [shape], direction="bw")[0]
    ds = lw.emit("mul_scalar", [ds], [shape], {"value": saved.scale})[0]
    dq = lw.emit("matmul", [ds, saved.k], [lw.shapes[saved.q]])[0]
    dk = lw.emit("matmul", [_transposed(lw, ds), saved.q], [lw.shapes[saved.k]])[0]
    if saved.groups > 1:
        dk, dv = _sum_heads(lw, dk, saved.groups), _sum_heads(lw, dv, saved.groups)
    return [dq, dk, dv]


def slice_backward(lw: Any, args, kwargs, shapes, group):
    """The gradient of a slice, zero outside it: narrow's backward."""
    g = lw.val(args[0])
    sizes, dim, start, step = list(args[1]), int(args[2]), int(args[3]), int(args[5])
    dim %= len(sizes)
    start = start + sizes[dim] if start < 0 else start
    if step != 1:
        raise LoweringError(f"{lw.name}: the backward of a strided slice is not lowered")
    return lw.emit("narrow", [-1, g], shapes,
                   {"dim": dim, "start": start, "length": lw.shapes[g][dim]}, direction="bw")[0]


def select(lw: Any, args, kwargs, shapes, group):
    """``x[..., index, ...]``: a narrow of length 1, its dim dropped."""
    x = lw.val(args[0])
    shape = lw.shapes[x]
    dim = int(args[1]) % len(shape)
    index = int(args[2]) % shape[dim]
    piece = (*shape[:dim], 1, *shape[dim + 1:])
    out = lw.emit("narrow", [x], [piece], {"dim": dim, "start": index, "length": 1})[0]
    return lw.reshape(out, tuple(shapes[0]))


def select_backward(lw: Any, args, kwargs, shapes, group):
    """The gradient of a select: zero outside the index (narrow's backward)."""
    sizes = list(args[1])
    dim = int(args[2]) % len(sizes)
    index = int(args[3]) % sizes[dim]
    piece = (*sizes[:dim], 1, *sizes[dim + 1:])
    g = lw.reshape(lw.val(args[0]), piece)
    return lw.emit("narrow", [-1, g], shapes, {"dim": dim, "start": index, "length": 1},
                   direction="bw")[0]


# -- complex numbers (rotary embeddings written with view_as_complex) -------------

def _complex_parts(lw: Any, a: Any) -> tuple[int, int | None] | None:
    """(real, imaginary) of a complex argument, (x, None) for a real tensor."""
    x = lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" else None
    if isinstance(x, Complex):
        return x.re, x.im
    value = constant_value(lw, a)
    if value is not None and np.iscomplexobj(value):
        return constant_input(lw, value.real), constant_input(lw, value.imag)
    return None


def complex_mul(lw: Any, args: Any, shapes: list) -> Complex | None:
    """(x + iy)(u + iv) = (xu - yv) + i(xv + yu); None when neither factor is complex."""
    pa, pb = _complex_parts(lw, args[0]), _complex_parts(lw, args[1])
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


def view_as_complex(lw: Any, args, kwargs, shapes, group):
    """x[..., 0] + i x[..., 1]."""
    x = lw.val(args[0])
    shape = lw.shapes[x]
    if not shape or shape[-1] != 2:
        raise LoweringError(f"{lw.name}: view_as_complex of a last dim other than 2")
    nd = len(shape)
    piece = (*shape[:-1], 1)
    parts = [lw.emit("narrow", [x], [piece], {"dim": nd - 1, "start": k, "length": 1})[0]
             for k in (0, 1)]
    return Complex(*(lw.reshape(p, tuple(shape[:-1])) for p in parts))


def view_as_real(lw: Any, args, kwargs, shapes, group):
    """The parts stacked in a last dim of 2."""
    c = lw.env.get(args[0][1])
    if not isinstance(c, Complex):
        raise LoweringError(f"{lw.name}: view_as_real of a complex tensor not lowered as one")
    shape = lw.shapes[c.re]
    parts = [lw.reshape(p, (*shape, 1)) for p in (c.re, c.im)]
    return lw.emit("cat", parts, shapes, {"dim": len(shape)})[0]


def to_copy(lw: Any, args, kwargs, shapes, group):
    """A change of floating (or complex) precision: the same real number (the
    proof is in exact arithmetic); other conversions are refused."""
    x = lw.env.get(args[0][1])
    dtype = str(kwargs.get("dtype", ""))
    floating = ("float" in dtype or "double" in dtype or "half" in dtype) and "complex" not in dtype
    if isinstance(x, Complex) and ("complex" in dtype or not dtype):
        return x
    if not isinstance(x, Complex) and (floating or not dtype):
        return lw.val(args[0])
    raise LoweringError(f"{lw.name}: a conversion to {dtype or 'another layout'} is not lowered")


# -- randomness -------------------------------------------------------------------

def dropout(lw: Any, args, kwargs, shapes, group):
    """``native_dropout`` with p = 0 is the identity (its mask all ones);
    any other p draws random numbers."""
    p = float(args[1])
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if p == 0.0 or train is False:
        return [lw.val(args[0]), "dropout-mask"]
    raise LoweringError(f"{lw.name}: dropout with p = {p} draws random numbers: set p = 0 to "
                        f"verify (dropout with p > 0 is not lowered)")


def dropout_backward(lw: Any, args, kwargs, shapes, group):
    if lw.env.get(args[1][1]) != "dropout-mask" or float(args[2]) != 1.0:
        raise LoweringError(f"{lw.name}: dropout backward of a dropout with p > 0")
    return lw.val(args[0])


def random_fill(lw: Any, args, kwargs, shapes, group):
    raise LoweringError(f"{lw.name}: a random draw (dropout with p > 0, or bernoulli) is not "
                        f"lowered: set dropout's p = 0 to verify")


NN_HANDLERS: dict[str, Any] = {
    "aten.addmm.default": addmm,
    "aten.baddbmm.default": baddbmm,
    "aten.native_layer_norm.default": layer_norm,
    "aten.native_layer_norm_backward.default": layer_norm_backward,
    "aten.gelu.default": activation("gelu", ("approximate",)),
    "aten.gelu_backward.default": gelu_backward,
    "aten.tanh.default": activation("tanh"),
    "aten.tanh_backward.default": activation_backward_of_output("tanh"),
    "aten.sigmoid.default": activation("sigmoid"),
    "aten.sigmoid_backward.default": activation_backward_of_output("sigmoid"),
    "aten.relu.default": activation("relu"),
    "aten.threshold_backward.default": activation_backward_of_output("relu"),
    "aten.neg.default": neg,
    "aten.abs.default": abs_,
    "aten.sgn.default": sgn,
    "aten.sign.default": sgn,
    "aten.rsub.Scalar": rsub,
    "aten.rsub.Tensor": rsub,
    "aten.mse_loss.default": mse_loss,
    "aten.mse_loss_backward.default": mse_loss_backward,
    "aten.smooth_l1_loss.default": robust_loss("smooth_l1_loss"),
    "aten.smooth_l1_loss_backward.default": robust_loss_backward("smooth_l1_loss"),
    "aten.huber_loss.default": robust_loss("huber_loss"),
    "aten.huber_loss_backward.default": robust_loss_backward("huber_loss"),
    "aten._scaled_dot_product_flash_attention_for_cpu.default": sdpa,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": sdpa_backward,
    "aten.masked_fill.Scalar": masked_fill,
    "aten.masked_fill.Tensor": masked_fill,
    "aten.where.self": where,
    "aten.slice_backward.default": slice_backward,
    "aten.select.int": select,
    "aten.select_backward.default": select_backward,
    "aten.view_as_complex.default": view_as_complex,
    "aten.view_as_real.default": view_as_real,
    "aten.native_dropout.default": dropout,
    "aten.native_dropout_backward.default": dropout_backward,
    "aten.bernoulli_.float": random_fill,
    "aten.bernoulli_.Tensor": random_fill,
    "aten.bernoulli.p": random_fill,
    "aten.bernoulli.default": random_fill,
}
