"""A decoder whose attention joins its keys with tensors of no entries and
whose blocks read a two-entry parameter through ``unbind`` (docs/
soundness.md, "Plans traced from PyTorch", 110): DeepSeek-V4's heavily
compressed attention over fewer tokens than its window makes
``new_zeros((b, 0, d))``, unsqueezes it and joins it to the keys by a
``cat``; HY-V4's hyper-connections read ``scale.unbind(0)``, whose
backward stacks two scalars into the gradient of ``scale``. The blocks
follow the names the stock recipes parallelize (``attn.q_proj`` ...
``o_proj``, ``mlp.c_fc``/``c_proj``, ``layers``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.outside_models import _share


class CompressedAttention(nn.Module):
    """q, k, v, o projections; the keys and values joined along the
    sequence with a compression of no windows (no entries) and an empty
    slice of the keys, as a reshaped and scaled tensor of no entries."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        h = q.shape[1]
        compressed = k.new_zeros((b, 0, self.head_dim)).unsqueeze(1).expand(b, h, 0, self.head_dim)
        unused = (k[:, :, :0] * 2.0).reshape(b, h, 0, self.head_dim)  # an empty slice, computed on
        k = torch.cat([k, compressed, unused], dim=2)
        v = torch.cat([v, compressed], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class ScaledBlock(nn.Module):
    """Pre-norm attention and MLP; the MLP's input and output scaled by the
    two entries of ``scale`` read with ``unbind``."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.attn = CompressedAttention(hidden, heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.scale = nn.Parameter(torch.tensor([0.7, 1.3]))
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(hidden, ffn)
        self.mlp.c_proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        pre, post = self.scale.unbind(0)
        h = F.gelu(self.mlp.c_fc(self.post_attention_layernorm(x) * pre))
        return x + self.mlp.c_proj(h) * post


class NoEntriesLM(nn.Module):
    """A tower of ``ScaledBlock``s, a head; the cross-entropy summed over
    the rank's tokens, its share of the step's."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del seqlen
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ScaledBlock(hidden, heads, ffn) for _ in range(layers))
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


def no_entries_lm(**kw) -> NoEntriesLM:
    return NoEntriesLM(**kw)
