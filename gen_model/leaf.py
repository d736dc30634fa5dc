"""Leaf functions: model pieces the tracer keeps whole, each with its own
operator in the rule table (rotary embedding, causal mask, MoE routing),
and ``one_hot``, which the tracer lowers to the one-hot input itself.

Their torch bodies are the reference semantics that the numeric rules of
``verdict.ops.nn`` are tested against.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@torch.fx.wrap
def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, S, Hq, D] and k [B, S, Hkv, D] by cos/sin tables [S, D]."""
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return xq * c + _rotate_half(xq) * s, xk * c + _rotate_half(xk) * s


@torch.fx.wrap
def causal_mask(scores: torch.Tensor) -> torch.Tensor:
    """Scores [..., S, S] with every future key position set to -inf."""
    s_q, s_k = scores.shape[-2:]
    future = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(future, float("-inf"))


@torch.fx.wrap
def route(scores: torch.Tensor, topk: int, capacity: int) -> torch.Tensor:
    """Top-k dispatch mask [B, S, E, capacity] with a static capacity per sample.

    Tokens are taken in order, each token's experts by decreasing score; a
    token is dropped by an expert whose slots are full. The mask is a
    constant of the graph: no gradient flows through it.
    """
    b, s, e = scores.shape
    dispatch = torch.zeros(b, s, e, capacity, dtype=scores.dtype, device=scores.device)
    if scores.device.type == "meta":
        return dispatch
    order = torch.argsort(-scores.detach(), dim=-1, stable=True)[..., :topk]
    for i in range(b):
        fill = [0] * e
        for t in range(s):
            for ex in order[i, t].tolist():
                if fill[ex] < capacity:
                    dispatch[i, t, ex, fill[ex]] = 1.0
                fill[ex] += 1
    return dispatch


@torch.fx.wrap
def one_hot(labels: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Integer labels [...] as one-hot rows [..., V] of ``like``'s last size and dtype.

    In a plan, labels are a 'tokens' input, already one-hot: the tracer
    lowers this call to that input (no operator).
    """
    return F.one_hot(labels, like.shape[-1]).to(like.dtype)
