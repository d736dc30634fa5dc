"""Running sums, flips and zero padding of computed tensors, as linear-attention
layers use them (``torch.cumsum`` over the sequence, ``torch.flip``, ``F.pad``
with zeros then a slice back): a small tagger for the backend's contract."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ScanTagger(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        s = h.shape[1]
        running = torch.cumsum(self.mix(h), dim=1)
        padded = F.pad(torch.flip(running, [1]), (0, 0, 0, 2))
        h = h + torch.tanh(padded[:, :s])
        logits = self.head(h).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def scan_tagger(**kw) -> ScanTagger:
    return ScanTagger(**kw)
