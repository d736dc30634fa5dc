"""Masked fills and selections: ``masked_fill``, ``where`` and additive
masks against constant (causal or padding) masks, shared by the families
that lower attention and comparisons."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import NEG_INF, causal_fill, constant_input, constant_value
from backends.torch.lowering.ir import Compare

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def selected(lw: Lowerer, cmp: Compare, t: int, where_true: bool, shape) -> int:
    """``t`` where ``cmp`` holds (``where_true``) or where it does not, else
    0. With step(y) = 1 for y > 0, else 0 (relu's derivative, the rule
    table's ``relu`` backward is ``g * step(y)``): x > c is step(x - c),
    x < c is step(c - x), x >= c and x <= c their complements."""
    if math.isinf(cmp.c):
        # x op ±inf of a real x is the same for every x: t, or zeros
        # (soundness.md, "Plans traced from PyTorch", 39g)
        holds = (cmp.op in ("lt", "le")) == (cmp.c > 0)
        if lw.shapes[t] != tuple(shape):
            raise LoweringError(f"{lw.name}: a where on a comparison that broadcasts is not "
                                f"lowered")
        if holds == where_true:
            return t
        return lw.emit("mul_scalar", [t], [tuple(shape)], {"value": 0.0})[0]  # t finite
    positive = cmp.op in ("gt", "le")  # gt: step(x - c); le: 1 - step(x - c)
    sign = 1.0 if positive else -1.0
    y = lw.emit("mul_scalar", [cmp.x], [lw.shapes[cmp.x]], {"value": sign})[0]
    y = lw.emit("add_scalar", [y], [lw.shapes[cmp.x]], {"value": -sign * cmp.c})[0]
    if lw.shapes[y] != tuple(shape) or lw.shapes[t] != tuple(shape):
        raise LoweringError(f"{lw.name}: a where on a comparison that broadcasts is not lowered")
    stepped = lw.emit("relu", [y, t], [shape], direction="bw")[0]
    if where_true == (cmp.op in ("gt", "lt")):
        return stepped
    return lw.emit("sub", [t, stepped], [shape])[0]


def additive_mask(lw: Lowerer, x: int, mask: np.ndarray, shape: tuple[int, ...]) -> int:
    """``x + mask`` for a constant float mask: its finite entries added as a
    constant, its -inf entries the causal mask (any other -inf pattern is
    refused: -inf is no number a plan input can hold)."""
    m = np.asarray(mask, dtype=np.float64)
    if np.any(np.isnan(m) | np.isposinf(m)):
        raise LoweringError(f"{lw.name}: an attention mask with nan or +inf entries is not lowered")
    hidden = np.isneginf(m)
    if hidden.any() and not causal_fill(hidden, shape):
        raise LoweringError(f"{lw.name}: an attention mask hiding other positions than the causal "
                            f"pattern with -inf is not lowered (a finite fill, such as "
                            f"torch.finfo(dtype).min, is)")
    finite = np.where(hidden, 0.0, m)
    if np.any(finite != 0):
        x = lw.emit("add", [x, constant_input(lw, finite)], [shape])[0]
    if hidden.any():
        x = lw.emit("causal_mask", [x], [shape])[0]
    return x


def _masked(lw: Lowerer, x: Any, hidden: np.ndarray, fill: float | None, shapes: list) -> int:
    """``x`` with the positions ``hidden`` (a constant boolean mask) set to
    ``fill``: -inf on the causal pattern is the causal mask, 0 there its
    backward; any finite fill of any constant mask is ``x * keep + fill *
    hidden``, both constants."""
    shape = tuple(shapes[0])
    causal = causal_fill(hidden, shape)
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


def masked_fill(lw: Lowerer, args, kwargs, shapes, group):
    mask = constant_value(lw, args[1])
    if mask is None:
        raise LoweringError(f"{lw.name}: masked_fill with a mask that is not a constant is not "
                            f"lowered")
    return _masked(lw, args[0], np.asarray(mask, dtype=bool), lw.const(args[2]), shapes)


def where(lw: Lowerer, args, kwargs, shapes, group):
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
