"""A rotary decoder whose table is computed per batch row from positions
laid out (axes, batch, sequence), as multimodal rotary embeddings lay
them out (M-RoPE; Cohere Compass's text model): the table is a constant
whose batch dim is dim 1, equal on every row, so a rank's rows of it are
a piece of the single-device table at a "tp" cut and at a "dp" cut alike
(docs/soundness.md, "Plans traced from PyTorch", 68). The blocks follow
the names the stock recipes parallelize (``attn.q_proj`` ... ``o_proj``,
``mlp.c_fc``/``c_proj``, ``layers``).

``row_offset_rotary_lm`` is the mistake: each row's positions are offset
by the row's index in the rank's batch, so a data-parallel rank's rows get
the angles of the first rows of the step, not their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.outside_models import _share, rotate_half


class AxesRotaryAttention(nn.Module):
    """q, k, v, o projections; the rotary angles of two position axes,
    every other frequency taken from the second axis by a strided
    in-place write (Cohere Compass's ``recomposition_frequencies``)."""

    def __init__(self, hidden: int, heads: int, row_offset: bool):
        super().__init__()
        self.head_dim = hidden // heads
        self.row_offset = row_offset
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def table(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        positions = torch.arange(s).view(1, 1, -1).expand(2, b, -1)
        if self.row_offset:
            positions = positions + torch.arange(b).view(1, -1, 1)
        freqs = positions[..., None].float() * self.inv_freq.float()
        return self.recompose(freqs.cos() * 1.0, x), self.recompose(freqs.sin() * 1.0, x)

    @staticmethod
    def recompose(freqs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        first = freqs[0]
        first[..., 1::2] = freqs[1, ..., 1::2]
        return torch.cat((first, first), dim=-1).to(x.dtype).unsqueeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.table(x)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class AxesRotaryBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, row_offset: bool):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.attn = AxesRotaryAttention(hidden, heads, row_offset)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(hidden, ffn)
        self.mlp.c_proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.post_attention_layernorm(x))))


class AxesRotaryLM(nn.Module):
    """A tower of ``AxesRotaryBlock``s, a head; the cross-entropy summed
    over the rank's tokens, its share of the step's."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 row_offset: bool = False):
        super().__init__()
        del seqlen
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(AxesRotaryBlock(hidden, heads, ffn, row_offset)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.global_tokens = 0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x)).flatten(0, 1)
        loss = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return _share(loss, self, labels.numel())


def batch_second_rotary_lm(**kw) -> AxesRotaryLM:
    return AxesRotaryLM(**kw)


def row_offset_rotary_lm(**kw) -> AxesRotaryLM:
    return AxesRotaryLM(**kw, row_offset=True)
