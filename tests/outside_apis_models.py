"""Small models written as a user writes them, loaded with
``--model tests.outside_apis_models:NAME`` (``forward(tokens, labels)``
returning a scalar loss; the size keywords of the CLI).

- ``bert_classifier``: a BERT-like encoder (bidirectional attention through
  SDPA, separate q/k/v projections, post-embedding LayerNorm, pre-norm
  blocks, ``nn.Dropout(0.0)``), an embedding with ``padding_idx=0``, a
  tanh pooler on the first position and a 4-class head; the loss is the
  mean cross-entropy over the rank's rows.
- ``vit_classifier``: a ViT-like encoder on token embeddings cut into
  patches of two positions, a learned class token prepended with
  ``torch.cat``, learned positions as an ``nn.Parameter``; 4 classes, the
  mean over the rank's rows.
- ``encoder_tagger``: the BERT-like encoder with an untied vocabulary head,
  the mean cross-entropy over the rank's tokens (for ``loss_parallel``).
- ``staged_tagger``: the same encoder written for pipelining as torchtitan
  writes stages (``tok``, a ``layers`` dict, ``norm``, ``head`` that a
  stage may set to None); without labels it returns the logits, with them
  the cross-entropy summed and divided by ``global_tokens`` (the rank's
  share of the step's mean).

Attention reads its shapes from the tensors (``reshape(b, s, -1, head_dim)``),
so a DTensor activation (``use_local_output=False``) runs the same code
(``reshape``: a DTensor gathered along the sequence is no ``view`` of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 4


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention with separate projections."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, s, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.o(out.transpose(1, 2).contiguous().reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm1(x)))``, ``x + drop(mlp(norm2(x)))``."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden, ffn)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class BertClassifier(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, padding_idx=0)
        self.pos = nn.Embedding(seqlen, hidden)
        self.emb_norm = nn.LayerNorm(hidden)
        self.blocks = nn.ModuleList(EncoderBlock(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, CLASSES)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.emb_norm(self.embed(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        pooled = torch.tanh(self.pooler(self.norm(x)[:, 0]))
        return F.cross_entropy(self.classifier(pooled), labels[:, 0] % CLASSES)


class VitClassifier(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 patch: int = 2):
        super().__init__()
        self.patch = patch
        self.embed = nn.Embedding(vocab, hidden)
        self.patch_proj = nn.Linear(patch * hidden, hidden)
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, seqlen // patch + 1, hidden) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        patches = self.embed(tokens).reshape(b, s // self.patch, -1)
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.patch_proj(patches)], dim=1)
        x = x + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)[:, 0]), labels[:, 0] % CLASSES)


class EncoderTagger(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, padding_idx=0)
        self.blocks = nn.ModuleList(EncoderBlock(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class StagedTagger(nn.Module):
    """Stages are this module with the other stages' parts removed."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.global_tokens = 0
        self.hidden, self.vocab_size = hidden, vocab
        self.tok = nn.Embedding(vocab, hidden, padding_idx=0)
        self.layers = nn.ModuleDict({str(i): EncoderBlock(hidden, heads, ffn) for i in range(layers)})
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(tokens) if self.tok is not None else tokens
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x if labels is None else self.loss(x, labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return total / self.global_tokens


def bert_classifier(**kw) -> BertClassifier:
    return BertClassifier(**kw)


def vit_classifier(**kw) -> VitClassifier:
    return VitClassifier(**kw)


def encoder_tagger(**kw) -> EncoderTagger:
    return EncoderTagger(**kw)


def staged_tagger(**kw) -> StagedTagger:
    return StagedTagger(**kw)
