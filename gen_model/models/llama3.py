"""Llama 3: RMSNorm, rotary embedding, grouped-KV causal attention, SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gen_model import leaf
from gen_model.config import ModelConfig
from gen_model.models.loss import cross_entropy


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.wq(x).unflatten(-1, (self.n_heads, self.head_dim))
        k = self.wk(x).unflatten(-1, (self.n_kv, self.head_dim))
        v = self.wv(x).unflatten(-1, (self.n_kv, self.head_dim))
        q, k = leaf.apply_rotary_emb(q, k, cos, sin)
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        probs = torch.softmax(leaf.causal_mask(scores), dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).flatten(2)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden)
        self.feed_forward = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The block's output and its auxiliary loss (None for a dense block)."""
        h = x + self.attention(self.attention_norm(x), cos, sin)
        out = self.feed_forward(self.ffn_norm(h))
        out, aux = out if isinstance(out, tuple) else (out, None)
        return h + out, aux


def rotary_tables(seqlen: int, head_dim: int, theta: float = 500000.0):
    """cos/sin tables [S, D] (halves repeated, as rotate_half expects)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Llama3(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(
            Block(cfg, self.make_mlp(cfg, i)) for i in range(cfg.layers)
        )
        self.norm = RMSNorm(cfg.hidden)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.seqlen, cfg.head_dim)
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)
        self.seqlen = cfg.seqlen
        #: the real batch rows of a folded plan (gen_model/generate.py)
        self.loss_rows: int | None = None

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return FeedForward(cfg.hidden, cfg.ffn)

    @staticmethod
    def inputs(cfg: ModelConfig, gbs: int) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"tokens": ((gbs, cfg.seqlen, cfg.vocab), "tokens"),
                "labels": ((gbs, cfg.seqlen, cfg.vocab), "tokens")}

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the next-token logits against ``labels`` (integer
        ids in torch, one-hot in a plan), plus every MoE layer's balance loss."""
        h = self.tok_embeddings(tokens)
        aux = None
        for layer in self.layers:
            h, layer_aux = layer(h, self.rope_cos, self.rope_sin)
            if layer_aux is not None:
                aux = layer_aux if aux is None else aux + layer_aux
        logits = self.output(self.norm(h))
        count = None if self.loss_rows is None else self.loss_rows * self.seqlen
        loss = cross_entropy(logits, leaf.one_hot(labels, logits), count)
        return loss if aux is None else loss + aux
