"""Small models for a hash router and a parameter clipped in place
(docs/soundness.md, "Plans traced from PyTorch", 128).

``HashMoeTagger``: each token's two experts are a lookup of a constant
table (a buffer) at the token ids, ``table[tokens.reshape(-1)]``, as
DeepSeek-V4's hash router chooses them; the gate weights are the router's
softmax scores gathered at those experts; the experts loop of
``routed_models.ClampedExperts`` runs on the gathered rows.

``ClippedTagger``: a projection whose weight's ``.data`` is clamped in
place in the forward under training, as Gemma 3n's AltUp clips its
prediction coefficients, at a bound the initial weights exceed (so the
clamp binds).

The recipe ``ddp_other_table`` is data parallelism by hand whose ranks
at data-parallel index 1 shift the table by one expert in their step (a
rank that routes its tokens otherwise than the single-device step: a
wrong plan).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.zoo.stock_recipes import ddp
from tests.routed_models import ClampedExperts

EXPERTS = 4


class HashMoeTagger(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int,
                 seqlen: int) -> None:
        super().__init__()
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.router = nn.Linear(hidden, EXPERTS, bias=False)
        ids = torch.arange(vocab)[:, None]
        self.table = nn.Buffer((ids + torch.arange(2)[None, :]) % EXPERTS)
        self.experts = ClampedExperts(EXPERTS, hidden, ffn, 0.3)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        flat = h.reshape(-1, h.shape[-1])
        chosen = self.table[tokens.reshape(-1)]
        weights = torch.softmax(self.router(flat), dim=-1).gather(1, chosen)
        moe = self.experts(flat, chosen, weights)
        h = h + moe.reshape(h.shape)
        logits = self.head(h).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def hash_moe_tagger(**kw) -> HashMoeTagger:
    return HashMoeTagger(**kw)


class ClippedBlock(nn.Module):
    """``h + tanh(h W^T)`` with ``W.data`` clamped in place in training."""

    CLIP = 0.2

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.coefs = nn.Linear(hidden, hidden, bias=False)
        self.clips = True  # the block clamps its own weight (else its owner does)
        with torch.no_grad():
            self.coefs.weight.mul_(4.0)  # many entries beyond the clip

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training and self.clips:
            self.coefs.weight.data.clamp_(-self.CLIP, self.CLIP)
        return h + torch.tanh(self.coefs(h))


class ClippedTagger(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int,
                 seqlen: int) -> None:
        super().__init__()
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([ClippedBlock(hidden) for _ in range(layers)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def clipped_tagger(**kw) -> ClippedTagger:
    return ClippedTagger(**kw)


class RootClippedTagger(ClippedTagger):
    """The clip as it holds under FSDP2: the root clamps each block's weight
    under ``torch.no_grad()`` as its forward begins, before any block runs,
    when the weight is still the parameter the rank holds (FSDP2's shard,
    from which every later all-gather reads, and which its optimizer
    steps); the blocks clamp nothing."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        for layer in self.layers:
            layer.clips = False

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                for layer in self.layers:
                    layer.coefs.weight.clamp_(-ClippedBlock.CLIP, ClippedBlock.CLIP)
        return super().forward(tokens, labels)


def root_clipped_tagger(**kw) -> RootClippedTagger:
    return RootClippedTagger(**kw)


def ddp_other_table(model, mesh):
    """``ddp`` with the ranks at data-parallel index 1 shifting the table by
    one expert as their step begins (a forward pre-hook: the shift is part
    of the traced step): their tokens go to other experts than the
    single-device step sends them to."""
    if mesh["dp"].get_local_rank() == 1:
        def shift(module: HashMoeTagger, _args) -> None:
            module.table = (module.table + 1) % EXPERTS
        model.register_forward_pre_hook(shift)
    return ddp(model, mesh)
