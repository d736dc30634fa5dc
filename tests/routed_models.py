"""A token tagger whose feed-forward routes each token to its top-2 of four
experts and runs an experts loop on the gathered rows (``x[token_idx]``,
``index_add_`` back), each expert with biases and an activation clamped
at a small limit, so that the clamps bind on many entries: the interleaved
gate/up columns (``[..., ::2]``, ``[..., 1::2]``), ``clamp`` with one bound
and with two, ``sigmoid``, ``tanh`` and a ``where`` on a comparison, all
on gathered rows; their backward (``slice_backward``, ``sigmoid_backward``,
``tanh_backward``, clamp's mask ``(x >= lo) & (x <= hi)``) and each bias's
gradient, a sum over the gathered rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ClampedExperts(nn.Module):
    """Experts on gathered rows with a clamped, interleaved gated unit."""

    def __init__(self, experts: int, hidden: int, ffn: int, limit: float) -> None:
        super().__init__()
        self.experts = experts
        self.limit = limit
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * ffn) / hidden ** 0.5)
        self.gate_up_bias = nn.Parameter(torch.randn(experts, 2 * ffn) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, ffn, hidden) / ffn ** 0.5)
        self.down_bias = nn.Parameter(torch.randn(experts, hidden) * 0.1)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        kept = torch.where(gate > -self.limit, gate, 0.0)
        return (up + 1) * kept * torch.sigmoid(1.7 * gate) + torch.tanh(up)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = F.one_hot(index, num_classes=self.experts).permute(2, 1, 0)
        for e in range(self.experts):
            slot, token = torch.where(mask[e])
            rows = x[token]
            h = self._act(rows @ self.gate_up[e] + self.gate_up_bias[e])
            y = h @ self.down[e] + self.down_bias[e]
            out.index_add_(0, token, y * weights[token, slot, None])
        return out


class ClampedMoeTagger(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 limit: float = 0.3, experts: type[nn.Module] = ClampedExperts) -> None:
        super().__init__()
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.router = nn.Linear(hidden, 4)
        self.experts = experts(4, hidden, ffn, limit)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        flat = h.reshape(-1, h.shape[-1])
        top, index = torch.topk(self.router(flat), 2, dim=-1)
        moe = self.experts(flat, index, torch.softmax(top, dim=-1))
        h = h + moe.reshape(h.shape)
        logits = self.head(h).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def clamped_moe_tagger(**kw) -> ClampedMoeTagger:
    return ClampedMoeTagger(**kw)
