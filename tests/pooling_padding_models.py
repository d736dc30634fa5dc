"""Models with whole-tensor maxima, padded pooling and circular padding,
written as users write them (``--model tests.pooling_padding_models:NAME``),
for ``tests/test_torch_pools_extrema_padding.py`` and scripts/torch_suite.py.

Each factory takes the size keywords ``layers, hidden, heads, ffn, vocab,
seqlen``; ``forward(tokens, labels)`` returns the summed cross-entropy
shared out over the step (``global_tokens``), so gradients are summed over
data-parallel replicas. The blocks carry ``mlp.c_fc``/``mlp.c_proj`` for the
stock tensor-parallel plan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _PooledBlock(nn.Module):
    """The sequence smoothed, each a residual branch: an average pooling
    with padding (``count_include_pad=False``), a max pooling with padding
    (``nn.MaxPool1d``, torch's -inf padding), a circular depthwise
    ``nn.Conv1d`` and a circular shift by two (``F.pad(..., mode="circular")``,
    the first positions reading the last); then an MLP (``mlp.c_fc``/``c_proj``, GELU)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.pool = nn.MaxPool1d(3, stride=1, padding=1)
        self.conv = nn.Conv1d(hidden, hidden, 3, padding=1, padding_mode="circular", groups=hidden)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(hidden, ffn), "c_proj": nn.Linear(ffn, hidden)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = self.norm(x).transpose(1, 2)
        smooth = F.avg_pool1d(seq, 3, stride=1, padding=1, count_include_pad=False)
        smooth = smooth + self.pool(seq) + self.conv(seq)
        smooth = smooth + 0.5 * F.pad(seq, (2, 0), mode="circular")[..., :-2]
        x = x + smooth.transpose(1, 2)
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](x)))


class PooledTagger(nn.Module):
    """Token embedding, ``_PooledBlock``s, a per-token head."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_PooledBlock(hidden, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.global_tokens = 0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), reduction="sum")
        return loss / (self.global_tokens or labels.numel())


class MaxScaledTagger(nn.Module):
    """A tagger whose projection weight is scaled by its largest magnitude
    (``w / w.abs().max()``, max-norm style) and whose head's input is
    shifted by the smallest entry of a learned offset (``offset.min()``).
    With ``over="batch"`` the features are also shifted by their smallest
    value over the whole batch (``h - h.min()``), which couples the rows:
    under data parallelism each rank shifts by the minimum of its own rows."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 over: str = "weights"):
        super().__init__()
        del layers, heads, seqlen
        self.over = over
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, ffn)
        self.offset = nn.Parameter(torch.linspace(-1.0, 1.0, ffn))
        self.head = nn.Linear(ffn, vocab)
        self.global_tokens = 0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        w = self.proj.weight
        h = torch.tanh(F.linear(x, w / w.abs().max(), self.proj.bias))
        h = h + self.offset - self.offset.min()
        if self.over == "batch":
            h = h - h.min()
        loss = F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), reduction="sum")
        return loss / (self.global_tokens or labels.numel())


def pooled_tagger(**kw) -> PooledTagger:
    return PooledTagger(**kw)


def max_scaled_tagger(**kw) -> MaxScaledTagger:
    return MaxScaledTagger(**kw)


def batch_min_tagger(**kw) -> MaxScaledTagger:
    return MaxScaledTagger(**kw, over="batch")
