"""The scores of ``scaled_dot_product_attention`` (grouped-query heads
repeated) and the softmax's backward, shared by the attention handlers and
the masked-attention refinements."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def transposed(lw: Lowerer, x: int) -> int:
    shape = list(lw.shapes[x])
    shape[-1], shape[-2] = shape[-2], shape[-1]
    nd = len(shape)
    return lw.emit("transpose", [x], [shape], {"dim0": nd - 2, "dim1": nd - 1})[0]


def sdpa_options(lw: Lowerer, args: Any, kwargs: dict, at: int) -> tuple[float, bool, Any]:
    dropout = float(args[at] if len(args) > at else kwargs.get("dropout_p", 0.0))
    causal = bool(args[at + 1] if len(args) > at + 1 else kwargs.get("is_causal", False))
    if dropout != 0.0:
        raise LoweringError(f"{lw.name}: scaled_dot_product_attention with dropout_p = {dropout} "
                            f"draws random numbers: set it to 0 (dropout is not lowered)")
    return dropout, causal, kwargs.get("attn_mask")


def _repeat_heads(lw: Lowerer, x: int, groups: int) -> int:
    """``[B, H, S, D]`` with each head repeated ``groups`` times in place
    (``repeat_interleave(groups, dim=1)``): unflatten, expand, flatten."""
    b, h, s, d = lw.shapes[x]
    wide = (b, h, groups, s, d)
    x = lw.emit("expand", [lw.reshape(x, (b, h, 1, s, d))], [wide], {"shape": list(wide)})[0]
    return lw.reshape(x, (b, h * groups, s, d))


def sum_heads(lw: Lowerer, g: int, groups: int) -> int:
    """The backward of ``_repeat_heads``: each group of heads summed."""
    b, hq, s, d = lw.shapes[g]
    g = lw.reshape(g, (b, hq // groups, groups, s, d))
    return lw.emit("sum", [g], [(b, hq // groups, s, d)], {"dim": [2], "keepdim": False})[0]


def sdpa_inputs(lw: Lowerer, args, kwargs) -> tuple[int, int, int, float, int, bool, Any]:
    """The CPU flash kernel's arguments ``q, k, v, dropout_p, is_causal``:
    (q, the keys and values with each key-value head repeated for its query
    heads, scale, groups, is_causal, the attn_mask argument)."""
    q, k, v = (lw.val(a) for a in args[:3])
    _, causal, mask = sdpa_options(lw, args, kwargs, 3)
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
    return q, keys, values, scale, groups, causal, mask


def sdpa_scores(lw: Lowerer, args, kwargs) -> tuple[int, int, int, float, int, int, bool, Any]:
    """``q @ k^T * scale`` of the CPU flash kernel's arguments: (q, the keys
    and values with each key-value head repeated for its query heads, scale,
    scores, groups, is_causal, the attn_mask argument)."""
    q, keys, values, scale, groups, causal, mask = sdpa_inputs(lw, args, kwargs)
    qs, ks = lw.shapes[q], lw.shapes[keys]
    scores_shape = (*qs[:3], ks[2])
    scores = lw.emit("matmul", [q, transposed(lw, keys)], [scores_shape])[0]
    scores = lw.emit("mul_scalar", [scores], [scores_shape], {"value": scale})[0]
    if causal and scores_shape[-1] != scores_shape[-2]:
        raise LoweringError(f"{lw.name}: causal attention of {scores_shape[-2]} queries over "
                            f"{scores_shape[-1]} keys is not lowered")
    return q, keys, values, scale, scores, groups, causal, mask


def softmax_grad(lw: Lowerer, p: int, g: int, dim: int) -> int:
    """The softmax backward written on its probabilities ``p``: ``p * g -
    p * sum(p * g)`` along ``dim`` (the derivative of ``p = K exp(x) /
    sum(K exp(x))`` for any constant K, so of a masked softmax too)."""
    shape = lw.shapes[p]
    dim %= len(shape)
    row = [*shape[:dim], 1, *shape[dim + 1:]]
    pg = lw.emit("mul", [p, g], [shape])[0]
    total = lw.emit("sum", [pg], [row], {"dim": dim, "keepdim": True})[0]
    return lw.emit("sub", [pg, lw.emit("mul", [p, total], [shape])[0]], [shape])[0]
