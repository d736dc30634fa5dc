"""cp: a model whose positions matter without attention: each token's
embedding plus a learned embedding of its position, then a per-position
head and the cross-entropy summed over the step's tokens. On a rank that
holds a chunk of the sequence (a "cp" mesh dim), the positions are its
chunk's: ``position_offset`` (set by the recipe, 0 on one device) is where
the chunk starts. Left at 0 on every rank, the positions are not shifted
per context-parallel rank (tests/cp_split_recipes.py, ``cp_positions_unshifted``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PositionTagger(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del layers, heads, ffn
        self.global_tokens = 0
        self.position_offset = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seqlen, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        start = self.position_offset
        ids = torch.arange(start, start + tokens.shape[1])
        h = torch.tanh(self.embed(tokens) + self.positions(ids))
        logits = self.head(h).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def position_tagger(**kw) -> PositionTagger:
    return PositionTagger(**kw)



class TablePositionTagger(PositionTagger):
    """PositionTagger adding a fixed table of position features (a buffer
    [seqlen, hidden], as a rotary table is) in place of the learned one;
    a context-parallel recipe cuts the table along the sequence as
    ``context_parallel`` cuts the buffers it is given (torchtitan gives it
    the rotary table)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        seqlen, hidden = kw["seqlen"], kw["hidden"]
        angle = torch.arange(seqlen)[:, None] / (1 + torch.arange(hidden))[None, :]
        self.register_buffer("table", torch.sin(angle + 0.5), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(tokens) + self.table)
        logits = self.head(h).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def table_position_tagger(**kw) -> TablePositionTagger:
    return TablePositionTagger(**kw)
