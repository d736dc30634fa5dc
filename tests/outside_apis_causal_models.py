"""Small models written as a user writes them (a third set), loaded with
``--model tests.outside_apis_causal_models:NAME`` (``forward(tokens,
labels)`` returning a scalar loss; the size keywords of the CLI).

- ``tied_causal_lm``: a GPT-like decoder: causal attention through
  ``F.scaled_dot_product_attention(is_causal=True)``, an MLP with
  ``nn.GELU(approximate="tanh")``, the output head tied to the token
  embedding (``head.weight = tok.weight``); the next token's labels padded
  with ``-100`` and ``F.cross_entropy(ignore_index=-100,
  label_smoothing=0.1)``, the mean over the rank's kept tokens. Setting
  ``activation_checkpointing`` runs each block under
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
- ``mha_pooled_classifier``: ``nn.MultiheadAttention(batch_first=True)``
  blocks, attention pooling written with ``torch.einsum`` (a learned query
  scoring each position, the softmax's weighted sum), 4 classes, the mean
  over the rank's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CLASSES = 4


class CausalAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)
                   for t in (self.q(x), self.k(x), self.v(x)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class DecoderBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = Mlp(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TiedCausalLM(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.activation_checkpointing = False
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seqlen, hidden)
        self.blocks = nn.ModuleList(DecoderBlock(hidden, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing \
                else block(x)
        logits = self.head(self.ln_f(x))
        # next-token targets; the last position has none
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                               label_smoothing=0.1)


class MhaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(approximate="tanh"),
                                nn.Linear(ffn, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class MhaPooledClassifier(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seqlen, hidden) * 0.02)
        self.blocks = nn.ModuleList(MhaBlock(hidden, heads, ffn) for _ in range(layers))
        self.query = nn.Parameter(torch.randn(hidden) * 0.1)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        weights = torch.einsum("bsh,h->bs", x, self.query).softmax(dim=-1)
        pooled = torch.einsum("bs,bsh->bh", weights, x)
        return F.cross_entropy(self.head(pooled), labels[:, 0] % CLASSES)


def tied_causal_lm(**kw) -> TiedCausalLM:
    return TiedCausalLM(**kw)


def mha_pooled_classifier(**kw) -> MhaPooledClassifier:
    return MhaPooledClassifier(**kw)
