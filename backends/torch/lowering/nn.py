"""Lowerings of the kernels stock ``torch.nn`` layers run on the CPU, and of
the constants models compute (positions, masks, tables).

Each handler has the signature of ``backends.torch.lowering.registry``:
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

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.attention import (
    sdpa_inputs,
    sdpa_options,
    sdpa_scores,
    softmax_grad,
    sum_heads,
    transposed,
)
from backends.torch.lowering.constants import NEG_INF, constant_value
from backends.torch.lowering.fills import additive_mask, masked_fill
from backends.torch.lowering.ir import Complex, KernelLse, SdpaSaved
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

# -- constants ------------------------------------------------------------------


# -- linear, norms, activations -------------------------------------------------

@lowers("aten.addmm.default")
def addmm(lw: Lowerer, args, kwargs, shapes, group):
    """bias + m1 @ m2 (``nn.Linear`` with a bias)."""
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        raise LoweringError(f"{lw.name}: addmm with beta or alpha is not lowered")
    mm = lw.emit("matmul", [lw.val(args[1]), lw.val(args[2])], shapes)[0]
    return lw.emit("add", [mm, lw.val(args[0])], shapes)[0]


@lowers("aten.baddbmm.default")
def baddbmm(lw: Lowerer, args, kwargs, shapes, group):
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
        return additive_mask(lw, out, mask, shape)
    return lw.emit("add", [out, lw.val(args[0])], [shape])[0]


def _norm_dims(lw: Lowerer, x: int, normalized: Any) -> list[int]:
    nd = len(lw.shapes[x])
    k = len(normalized)
    if not 1 <= k <= nd or list(lw.shapes[x][nd - k:]) != list(normalized):
        raise LoweringError(f"{lw.name}: layer norm over {normalized} of a {list(lw.shapes[x])} tensor")
    return list(range(nd - k, nd))


def _normalized(lw: Lowerer, x: int, mean: int, rstd: int) -> int:
    """(x - mean) * rstd, once per (x, mean, rstd)."""
    key = (x, mean, rstd)
    if key not in lw.ln_y:
        shape = lw.shapes[x]
        centered = lw.emit("sub", [x, mean], [shape])[0]
        lw.ln_y[key] = lw.emit("mul", [centered, rstd], [shape])[0]
    return lw.ln_y[key]


@lowers("aten.native_layer_norm.default")
def layer_norm(lw: Lowerer, args, kwargs, shapes, group):
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


@lowers("aten.native_layer_norm_backward.default")
def layer_norm_backward(lw: Lowerer, args, kwargs, shapes, group):
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
    def lower(lw: Lowerer, args, kwargs, shapes, group):
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
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        out = lw.val(args[1])
        producer, x = lw.fw_in.get(out, ("", -1))
        if producer != op:
            raise LoweringError(f"{lw.name}: {op} backward of a value no {op} produced")
        if op == "relu" and lw.const(args[2]) != 0:
            raise LoweringError(f"{lw.name}: threshold backward with a threshold other than 0")
        return lw.emit(op, [x, lw.val(args[0])], shapes, direction="bw")[0]
    return lower


@lowers("aten.gelu_backward.default")
def gelu_backward(lw: Lowerer, args, kwargs, shapes, group):
    approximate = args[2] if len(args) > 2 else kwargs.get("approximate", "none")
    return lw.emit("gelu", [lw.val(args[1]), lw.val(args[0])], shapes,
                   {"approximate": approximate}, direction="bw")[0]


def _step_times(lw: Lowerer, y: int, t: int) -> int:
    """t * step(y), step(y) = 1 for y > 0, else 0: the relu rule's backward."""
    return lw.emit("relu", [y, t], [lw.shapes[t]], direction="bw")[0]


def _negated(lw: Lowerer, x: int) -> int:
    return lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": -1.0})[0]


def _abs(lw: Lowerer, x: int) -> int:
    """|x| = relu(x) + relu(-x) (exact: x step(x) - x step(-x))."""
    shape = [lw.shapes[x]]
    pos = lw.emit("relu", [x], shape)[0]
    return lw.emit("add", [pos, lw.emit("relu", [_negated(lw, x)], shape)[0]], shape)[0]


def _sgn_times(lw: Lowerer, x: int, t: int) -> int:
    """t * sgn(x) = t step(x) - t step(-x) (0 at 0, as torch's sgn)."""
    return lw.emit("sub", [_step_times(lw, x, t), _step_times(lw, _negated(lw, x), t)],
                   [lw.shapes[t]])[0]


@lowers("aten.abs.default")
def abs_(lw: Lowerer, args, kwargs, shapes, group):
    return _abs(lw, lw.val(args[0]))


@lowers("aten.sgn.default", "aten.sign.default")
def sgn(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.val(args[0])
    ones = lw.emit("ones", [], [lw.shapes[x]], {"shape": list(lw.shapes[x])}, direction="none")[0]
    return _sgn_times(lw, x, ones)


@lowers("aten.neg.default")
def neg(lw: Lowerer, args, kwargs, shapes, group):
    return lw.emit("mul_scalar", [lw.val(args[0])], shapes, {"value": -1.0})[0]


@lowers("aten.rsub.Scalar", "aten.rsub.Tensor")
def rsub(lw: Lowerer, args, kwargs, shapes, group):
    """other - alpha * x."""
    alpha = float(args[2] if len(args) > 2 else kwargs.get("alpha", 1))
    other = lw.const(args[1])
    if other is not None:
        scaled = lw.emit("mul_scalar", [lw.val(args[0])], shapes, {"value": -alpha})[0]
        return lw.emit("add_scalar", [scaled], shapes, {"value": other})[0]
    if alpha != 1:
        raise LoweringError(f"{lw.name}: rsub of a tensor with alpha is not lowered")
    return lw.emit("sub", [lw.val(args[1]), lw.val(args[0])], shapes)[0]


def _plus_number(sign: float):
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        """x + alpha * c (x - alpha * c) for a number c."""
        alpha = float(args[2] if len(args) > 2 else kwargs.get("alpha", 1))
        c = lw.const(args[1])
        if c is None:
            raise LoweringError(f"{lw.name}: an addition of a scalar that is not a number is "
                                f"not lowered")
        return lw.emit("add_scalar", [lw.val(args[0])], shapes, {"value": sign * alpha * c})[0]
    return lower


@lowers("aten.fill_.Scalar", "aten.fill_.Tensor", "aten.fill.Scalar", "aten.fill.Tensor")
def fill(lw: Lowerer, args, kwargs, shapes, group):
    """Every entry set to a number (ones times it) or to a one-value tensor
    (broadcast to the shape)."""
    shape = tuple(shapes[0])
    c = lw.const(args[1])
    if c is not None:
        ones = lw.emit("ones", [], [shape], {"shape": list(shape)}, direction="none")[0]
        return lw.emit("mul_scalar", [ones], [shape], {"value": c})[0]
    value = lw.val(args[1])
    if math.prod(lw.shapes[value]) != 1:
        raise LoweringError(f"{lw.name}: a fill with a tensor of more than one value")
    return lw.emit("expand", [lw.reshape(value, ())], [shape], {"shape": list(shape)})[0]


lowers("aten.add.Scalar")(_plus_number(1.0))
lowers("aten.sub.Scalar")(_plus_number(-1.0))


# -- losses ---------------------------------------------------------------------

def _reduction(lw: Lowerer, args: Any, at: int, kwargs: dict) -> int:
    reduction = int(args[at] if len(args) > at else kwargs.get("reduction", 1))
    if reduction not in (0, 1, 2):
        raise LoweringError(f"{lw.name}: loss reduction {reduction} is not lowered")
    return reduction


@lowers("aten.mse_loss.default")
def mse_loss(lw: Lowerer, args, kwargs, shapes, group):
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


@lowers("aten.mse_loss_backward.default")
def mse_loss_backward(lw: Lowerer, args, kwargs, shapes, group):
    """2 * (x - t) * g, divided by the element count for a mean."""
    g, x, t = lw.val(args[0]), lw.val(args[1]), lw.val(args[2])
    reduction = _reduction(lw, args, 3, kwargs)
    shape = lw.shapes[x]
    diff = lw.emit("sub", [x, t], [shape])[0]
    out = lw.emit("mul", [lw.emit("mul_scalar", [diff], [shape], {"value": 2.0})[0], g], [shape])[0]
    if reduction == 1:
        out = lw.emit("div", [out], [shape], {"value": float(math.prod(shape))})[0]
    return out


def _robust_parts(lw: Lowerer, args: Any, kwargs: dict, at: int, name: str) -> tuple[int, int, float]:
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


def _near(lw: Lowerer, d: int, beta: float) -> int:
    """beta - |d|: positive exactly where the loss is quadratic."""
    return lw.emit("add_scalar", [_negated(lw, _abs(lw, d))], [lw.shapes[d]], {"value": beta})[0]


def robust_loss(name: str):
    """Smooth L1 (beta) and Huber (delta) losses: elementwise
    ``|d| - beta/2 + step(beta - |d|) (d^2 / (2 beta) - |d| + beta/2)``, Huber
    that times delta, then reduced."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
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
    def lower(lw: Lowerer, args, kwargs, shapes, group):
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


@lowers("aten._scaled_dot_product_flash_attention_for_cpu.default")
def sdpa(lw: Lowerer, args, kwargs, shapes, group):
    """softmax(mask(q @ k^T * scale)) @ v (the CPU flash kernel's function);
    with fewer key-value heads than query heads (``enable_gqa``), each
    key-value head serves ``groups`` consecutive query heads."""
    if sdpa_options(lw, args, kwargs, 3)[2] is None:
        return _attention(lw, args, kwargs, shapes)
    q, keys, values, scale, scores, groups, causal, mask = sdpa_scores(lw, args, kwargs)
    scores_shape = lw.shapes[scores]
    if mask is not None:
        value = constant_value(lw, mask)
        if causal or value is None:
            raise LoweringError(f"{lw.name}: an attention mask that is not a constant (or given "
                                f"with is_causal) is not lowered")
        if value.dtype == bool:
            value = np.where(value, 0.0, NEG_INF)
        scores = additive_mask(lw, scores, value, scores_shape)
        causal = bool(np.any(np.isneginf(value)))
    elif causal:
        scores = lw.emit("causal_mask", [scores], [scores_shape])[0]
    probs = lw.emit("softmax", [scores], [scores_shape], {"dim": -1})[0]
    lw.fw_in[probs] = ("softmax", scores)
    out = lw.emit("matmul", [probs, values], [shapes[0]])[0]
    lw.sdpa[out] = SdpaSaved(q, keys, values, scale, scores, probs, causal, groups)
    if mask is not None:
        return [out, "logsumexp"]
    return [out, KernelLse(q, keys, values, scale, causal)]


def _attention(lw: Lowerer, args, kwargs, shapes) -> list[int]:
    """The kernel without a mask: the rule table's ``attention`` of the query
    and the keys and values (grouped heads repeated), its two outputs the
    kernel's two (docs/soundness.md, "Plans traced from PyTorch", 53 (c)).
    One operator on both plans, so that a ring's blocks (the same kernel
    over a key block) and the single-device attention align."""
    q, keys, values, scale, _, causal, _ = sdpa_inputs(lw, args, kwargs)
    qs, ks = lw.shapes[q], lw.shapes[keys]
    if causal and qs[-2] != ks[-2]:
        raise LoweringError(f"{lw.name}: causal attention of {qs[-2]} queries over {ks[-2]} keys "
                            f"is not lowered")
    out, lse = lw.emit("attention", [q, keys, values], [shapes[0], tuple(qs[:-1])],
                       {"scale": scale, "causal": causal})
    return [out, lse]


@lowers("verdict_cp.ring_result.default")
def ring_result(lw: Lowerer, args, kwargs, shapes, group):
    """The shim's name for a ring's merged (out, lse): the values as they
    are, recorded as the attention of the rank's query over the keys and
    values its local ones are pieces of (``Lowerer.anchors``; the build
    claims them so, and the claim is proved)."""
    out, lse, q, k, v = (lw.val(a) for a in args[:5])
    if lw.shapes[out] != tuple(shapes[0]) or lw.shapes[lse] != tuple(shapes[1]):
        raise LoweringError(f"{lw.name}: a ring's result of shapes {list(shapes[0])}, "
                            f"{list(shapes[1])} named for values of other shapes")
    lw.anchors[out] = ("out", q, k, v)
    lw.anchors[lse] = ("lse", q, k, v)
    return [out, lse]


@lowers("verdict_cp.ring_grads.default")
def ring_grads(lw: Lowerer, args, kwargs, shapes, group):
    """The shim's name for a ring backward's dq, dk and dv: the values as
    they are, recorded as the gradients of the attention of the rank's
    query over the keys and values its local ones are pieces of, at the
    rank's query, key and value rows (``Lowerer.anchors``; the build claims
    them so, and the claim is proved)."""
    dq, dk, dv, q, k, v = (lw.val(a) for a in args[:6])
    for value, shape in zip((dq, dk, dv), shapes[:3]):
        if lw.shapes[value] != tuple(shape):
            raise LoweringError(f"{lw.name}: a ring's gradients named for values of other "
                                f"shapes")
    lw.anchors[dq] = ("dq", q, k, v)
    lw.anchors[dk] = ("dk", q, k, v)
    lw.anchors[dv] = ("dv", q, k, v)
    return [dq, dk, dv]


@lowers("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
def sdpa_backward(lw: Lowerer, args, kwargs, shapes, group):
    """dv = p^T g; ds = softmax'(g v^T) (masked); dq = ds k * scale; dk = ds^T q * scale."""
    g, out = lw.val(args[0]), lw.val(args[4])
    saved = lw.sdpa.get(out)
    if saved is None:
        return _flash_backward(lw, args, kwargs, g, out)
    sdpa_options(lw, args, kwargs, 6)
    shape = lw.shapes[saved.masked]
    dv = lw.emit("matmul", [transposed(lw, saved.probs), g], [lw.shapes[saved.v]])[0]
    dp = lw.emit("matmul", [g, transposed(lw, saved.v)], [shape])[0]
    if saved.masked_probs:
        ds = softmax_grad(lw, saved.probs, dp, -1)
    else:
        ds = lw.emit("softmax", [saved.masked, dp], [shape], {"dim": -1}, direction="bw")[0]
    if saved.causal:
        ds = lw.emit("causal_mask", [-1, ds], [shape], direction="bw")[0]
    ds = lw.emit("mul_scalar", [ds], [shape], {"value": saved.scale})[0]
    dq = lw.emit("matmul", [ds, saved.k], [lw.shapes[saved.q]])[0]
    dk = lw.emit("matmul", [transposed(lw, ds), saved.q], [lw.shapes[saved.k]])[0]
    if saved.groups > 1:
        dk, dv = sum_heads(lw, dk, saved.groups), sum_heads(lw, dv, saved.groups)
    return [dq, dk, dv]


def _flash_backward(lw: Lowerer, args, kwargs, g: int, out: int) -> list[int]:
    """The kernel's backward at an ``out`` and ``lse`` no kernel call of this
    trace produced (a ring's merged ones): ``attention_grad`` of the recorded
    gradient, query, keys, values, out and lse, the kernel's function of all
    six (docs/soundness.md, "Plans traced from PyTorch", 38 (c))."""
    q, keys, values, scale, groups, causal, mask = sdpa_inputs(
        lw, [args[1], args[2], args[3], *args[6:]], kwargs)
    if mask is not None:
        raise LoweringError(f"{lw.name}: an attention backward with a mask at an output no "
                            f"attention produced is not lowered")
    if causal and lw.shapes[q][-2] != lw.shapes[keys][-2]:
        raise LoweringError(f"{lw.name}: causal attention backward of {lw.shapes[q][-2]} queries "
                            f"over {lw.shapes[keys][-2]} keys is not lowered")
    lse = lw.val(args[5])
    if lw.shapes[lse] != tuple(lw.shapes[q][:-1]):
        raise LoweringError(f"{lw.name}: attention backward with a log-sum-exp of shape "
                            f"{list(lw.shapes[lse])}, not {list(lw.shapes[q][:-1])}")
    dq, dk, dv = lw.emit("attention_grad", [g, q, keys, values, out, lse],
                         [lw.shapes[q], lw.shapes[keys], lw.shapes[values]],
                         {"scale": scale, "causal": causal})
    if groups > 1:
        dk, dv = sum_heads(lw, dk, groups), sum_heads(lw, dv, groups)
    return [dq, dk, dv]


@lowers("aten.slice_backward.default")
def slice_backward(lw: Lowerer, args, kwargs, shapes, group):
    """The gradient of a slice, zero outside it: narrow's backward."""
    g = lw.val(args[0])
    sizes, dim, start, step = list(args[1]), int(args[2]), int(args[3]), int(args[5])
    dim %= len(sizes)
    start = start + sizes[dim] if start < 0 else start
    if step != 1:
        raise LoweringError(f"{lw.name}: the backward of a strided slice is not lowered")
    return lw.emit("narrow", [-1, g], shapes,
                   {"dim": dim, "start": start, "length": lw.shapes[g][dim]}, direction="bw")[0]


@lowers("aten.select.int")
def select(lw: Lowerer, args, kwargs, shapes, group):
    """``x[..., index, ...]``: a narrow of length 1, its dim dropped."""
    x = lw.val(args[0])
    shape = lw.shapes[x]
    dim = int(args[1]) % len(shape)
    index = int(args[2]) % shape[dim]
    piece = (*shape[:dim], 1, *shape[dim + 1:])
    out = lw.emit("narrow", [x], [piece], {"dim": dim, "start": index, "length": 1})[0]
    return lw.reshape(out, tuple(shapes[0]))


@lowers("aten.select_backward.default")
def select_backward(lw: Lowerer, args, kwargs, shapes, group):
    """The gradient of a select: zero outside the index (narrow's backward)."""
    sizes = list(args[1])
    dim = int(args[2]) % len(sizes)
    index = int(args[3]) % sizes[dim]
    piece = (*sizes[:dim], 1, *sizes[dim + 1:])
    g = lw.reshape(lw.val(args[0]), piece)
    return lw.emit("narrow", [-1, g], shapes, {"dim": dim, "start": index, "length": 1},
                   direction="bw")[0]


# -- complex numbers (rotary embeddings written with view_as_complex) -------------


@lowers("aten.view_as_complex.default")
def view_as_complex(lw: Lowerer, args, kwargs, shapes, group):
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


@lowers("aten.view_as_real.default")
def view_as_real(lw: Lowerer, args, kwargs, shapes, group):
    """The parts stacked in a last dim of 2."""
    c = lw.env.get(args[0][1])
    if not isinstance(c, Complex):
        raise LoweringError(f"{lw.name}: view_as_real of a complex tensor not lowered as one")
    shape = lw.shapes[c.re]
    parts = [lw.reshape(p, (*shape, 1)) for p in (c.re, c.im)]
    return lw.emit("cat", parts, shapes, {"dim": len(shape)})[0]


# -- randomness -------------------------------------------------------------------

@lowers("aten.native_dropout.default")
def dropout(lw: Lowerer, args, kwargs, shapes, group):
    """``native_dropout`` with p = 0 is the identity (its mask all ones);
    any other p draws random numbers."""
    p = float(args[1])
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if p == 0.0 or train is False:
        return [lw.val(args[0]), "dropout-mask"]
    raise LoweringError(f"{lw.name}: dropout with p = {p} draws random numbers: set p = 0 to "
                        f"verify (dropout with p > 0 is not lowered)")


@lowers("aten.native_dropout_backward.default")
def dropout_backward(lw: Lowerer, args, kwargs, shapes, group):
    if lw.env.get(args[1][1]) != "dropout-mask" or float(args[2]) != 1.0:
        raise LoweringError(f"{lw.name}: dropout backward of a dropout with p > 0")
    return lw.val(args[0])


@lowers("aten.bernoulli_.float", "aten.bernoulli_.Tensor", "aten.bernoulli.p", "aten.bernoulli.default")
def random_fill(lw: Lowerer, args, kwargs, shapes, group):
    raise LoweringError(f"{lw.name}: a random draw (dropout with p > 0, or bernoulli) is not "
                        f"lowered: set dropout's p = 0 to verify")



lowers("aten.gelu.default")(activation('gelu', ('approximate',)))
lowers("aten.tanh.default")(activation('tanh'))
lowers("aten.tanh_backward.default")(activation_backward_of_output('tanh'))
lowers("aten.sigmoid.default")(activation('sigmoid'))
lowers("aten.sigmoid_backward.default")(activation_backward_of_output('sigmoid'))
lowers("aten.relu.default")(activation('relu'))
@lowers("aten.threshold_backward.default")
def threshold_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``threshold_backward(grad, y, 0)``: ``grad`` where ``y > 0``, else 0
    (its definition). Of a value relu produced, the relu rule's backward on
    relu's input (the node the single-device step writes); of any other
    value (relu's output read through another value: a view, a gather, a
    pending value materialized again), the same rule on ``y`` itself,
    ``grad * step(y)``, which is the definition, and equal to the former
    where ``y = relu(x)``: ``relu(x) > 0`` iff ``x > 0`` (docs/soundness.md,
    "Plans traced from PyTorch", 133)."""
    if lw.const(args[2]) != 0:
        raise LoweringError(f"{lw.name}: threshold backward with a threshold other than 0")
    y = lw.val(args[1])
    producer, x = lw.fw_in.get(y, ("", -1))
    at = x if producer == "relu" else y
    return lw.emit("relu", [at, lw.val(args[0])], shapes, direction="bw")[0]
lowers("aten.smooth_l1_loss.default")(robust_loss('smooth_l1_loss'))
lowers("aten.smooth_l1_loss_backward.default")(robust_loss_backward('smooth_l1_loss'))
lowers("aten.huber_loss.default")(robust_loss('huber_loss'))
lowers("aten.huber_loss_backward.default")(robust_loss_backward('huber_loss'))
lowers("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")(masked_fill)
