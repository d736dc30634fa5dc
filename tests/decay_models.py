"""Decay masks as chunked linear attention writes them (Kimi Delta Attention
in transformers' ``bailing_hybrid`` and ``kimi_linear``): the differences of
a running sum of log-decays, -inf above the diagonal, then ``exp``, so the
hidden pairs weigh exactly 0. A small tagger for the backend's contract."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DecayTagger(nn.Module):
    """``out_i = sum_{j <= i} exp(g_i - g_j) v_j`` per channel, ``g`` the
    running sum of ``logsigmoid`` gates over the sequence (``dt_bias`` named
    as the families' decay bias). ``causal``: the
    mask hides the causal pattern of the last two dims (``[S, S]``, the
    channel dim moved before them) instead of broadcasting ``[S, S, 1]``
    over the channels."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 causal: bool = False):
        super().__init__()
        self.global_tokens = 0
        self.causal = causal
        self.embed = nn.Embedding(vocab, hidden)
        self.gate = nn.Linear(hidden, hidden)
        self.dt_bias = nn.Parameter(torch.linspace(-0.5, 0.5, hidden))
        self.value = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def decay(self, g: torch.Tensor) -> torch.Tensor:
        s = g.shape[1]
        strict = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        if self.causal:
            g = g.transpose(1, 2)  # [B, H, S]
            return (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(strict, float("-inf")).exp()
        diff = g.unsqueeze(-2) - g.unsqueeze(-3)  # [B, S, S, H]: g_i - g_j
        return diff.masked_fill(strict[..., None], float("-inf")).exp()

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        g = F.logsigmoid(self.gate(h) + self.dt_bias).cumsum(dim=1)
        v = self.value(h)
        decay = self.decay(g)
        if self.causal:
            mixed = (decay @ v.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)
        else:
            mixed = (decay * v.unsqueeze(1)).sum(dim=2)
        logits = self.head(h + mixed).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def decay_tagger(**kw) -> DecayTagger:
    return DecayTagger(**kw)


def causal_decay_tagger(**kw) -> DecayTagger:
    return DecayTagger(causal=True, **kw)
