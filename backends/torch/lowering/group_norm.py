"""Lowering of ``nn.GroupNorm`` (``aten.native_group_norm`` and its
backward) as a layer norm over each group: the input ``(N, C, *S)``
viewed as ``(N, G, C / G * prod(S))``, normalized over the last dim
(``mean``, the mean square of the centered values plus eps, ``rsqrt``),
viewed back and scaled and shifted per channel. The backward is the layer
norm's (``nn.layer_norm_backward``'s formula) over the same view,
the weight's and bias's gradients summed over the batch and the positions.
Every step is a rule of the table (docs/soundness.md, "Plans traced from
PyTorch", 5: the stock layer's own function, checked against autograd in
float64 by the tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _grouped(lw: Lowerer, x: int, groups: int) -> tuple[int, int, int]:
    """x viewed as (N, G, D)."""
    shape = lw.shapes[x]
    if len(shape) < 2 or groups <= 0 or shape[1] % groups:
        raise LoweringError(f"{lw.name}: a group norm of {groups} groups over {list(shape)} "
                            f"is not lowered")
    n = shape[0]
    d = 1
    for s in shape[1:]:
        d *= s
    return n, groups, d // groups


def _per_channel(lw: Lowerer, p: int, shape: tuple[int, ...]) -> int:
    """A (C,) parameter broadcast to ``shape`` (N, C, *S)."""
    p = lw.reshape(p, (shape[1],) + (1,) * (len(shape) - 2))
    return lw.emit("expand", [p], [shape], {"shape": list(shape)})[0]


@lowers("aten.native_group_norm.default")
def group_norm(lw: Lowerer, args, kwargs, shapes, group):
    """``native_group_norm(x, w, b, N, C, HxW, G, eps)`` -> (y, mean, rstd)."""
    x = lw.val(args[0])
    weight, bias, groups, eps = args[1], args[2], int(args[6]), float(args[7])
    shape = lw.shapes[x]
    view = _grouped(lw, x, groups)
    row = (*view[:2], 1)
    xg = lw.reshape(x, view)
    mean = lw.emit("mean", [xg], [row], {"dim": [2], "keepdim": True})[0]
    centered = lw.emit("sub", [xg, mean], [view])[0]
    var = lw.emit("mean", [lw.emit("mul", [centered, centered], [view])[0]], [row],
                  {"dim": [2], "keepdim": True})[0]
    rstd = lw.emit("rsqrt", [lw.emit("add_scalar", [var], [row], {"value": eps})[0]], [row])[0]
    y = lw.reshape(lw.emit("mul", [centered, rstd], [view])[0], shape)
    if weight is not None:
        y = lw.emit("mul", [y, _per_channel(lw, lw.val(weight), shape)], [shape])[0]
    if bias is not None:
        y = lw.emit("add", [y, _per_channel(lw, lw.val(bias), shape)], [shape])[0]
    return [y, lw.reshape(mean, tuple(shapes[1])), lw.reshape(rstd, tuple(shapes[2]))]


@lowers("aten.native_group_norm_backward.default")
def group_norm_backward(lw: Lowerer, args, kwargs, shapes, group):
    """dx = rstd (gy - mean(gy) - y mean(gy y)) per group, gy = g w;
    dw = sum(g y), db = sum(g) over the batch and the positions."""
    g, x = lw.val(args[0]), lw.val(args[1])
    weight, groups, mask = args[4], int(args[8]), list(args[9])
    shape = lw.shapes[x]
    view = _grouped(lw, x, groups)
    row = (*view[:2], 1)
    mean, rstd = lw.reshape(lw.val(args[2]), row), lw.reshape(lw.val(args[3]), row)
    xg = lw.reshape(x, view)
    y = lw.emit("mul", [lw.emit("sub", [xg, mean], [view])[0], rstd], [view])[0]
    outs: list[Any] = [None, None, None]
    if mask[0]:
        gy = g if weight is None else lw.emit(
            "mul", [g, _per_channel(lw, lw.val(weight), shape)], [shape])[0]
        gy = lw.reshape(gy, view)
        m1 = lw.emit("mean", [gy], [row], {"dim": [2], "keepdim": True})[0]
        m2 = lw.emit("mean", [lw.emit("mul", [gy, y], [view])[0]], [row],
                     {"dim": [2], "keepdim": True})[0]
        inner = lw.emit("sub", [lw.emit("sub", [gy, m1], [view])[0],
                                lw.emit("mul", [y, m2], [view])[0]], [view])[0]
        outs[0] = lw.reshape(lw.emit("mul", [inner, rstd], [view])[0], shape)
    lead = [0, *range(2, len(shape))]
    if mask[1] and weight is not None:
        gyhat = lw.emit("mul", [g, lw.reshape(y, shape)], [shape])[0]
        outs[1] = lw.emit("sum", [gyhat], [(shape[1],)], {"dim": lead, "keepdim": False})[0]
    if mask[2]:
        outs[2] = lw.emit("sum", [g], [(shape[1],)], {"dim": lead, "keepdim": False})[0]
    return outs


