"""Small torchtitan-style models for tracing: integer token ids, heads
inferred from the local width (so tensor parallelism of the attention
projections needs no change to the module), a cross-entropy loss averaged
over the tokens of the whole step.

As in torchtitan, a pipeline stage is the model with the modules of other
stages set to None (``tok_embeddings``, ``norm``, ``output``) or deleted
(``layers``): ``forward`` skips what is missing, and returns the logits
when no labels are given (a pipeline's last stage hands them to the
schedule's ``loss_fn``, which is ``Llama.loss``).

The rotary embedding rotates pairs with a constant matrix (``x @ rot``)
instead of complex numbers, and the causal mask is a constant boolean
buffer, so that every op the step runs has a rule in the rule table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    layers: int = 2
    hidden: int = 16
    heads: int = 4
    ffn: int = 32
    vocab: int = 32
    seqlen: int = 8
    batch: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_buffers(seqlen: int, head_dim: int, theta: float = 10000.0):
    """cos and sin tables [S, D] and the rotate-half matrix [D, D]."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    half = head_dim // 2
    rot = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    rot[torch.arange(half) + half, torch.arange(half)] = -1.0
    rot[torch.arange(half), torch.arange(half) + half] = 1.0
    return angles.cos(), angles.sin(), rot


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.hidden, args.hidden, bias=False)
        self.wk = nn.Linear(args.hidden, args.hidden, bias=False)
        self.wv = nn.Linear(args.hidden, args.hidden, bias=False)
        self.wo = nn.Linear(args.hidden, args.hidden, bias=False)

    def forward(self, x, cos, sin, rot, mask):
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        q = q * cos + torch.matmul(q, rot) * sin
        k = k * cos + torch.matmul(k, rot) * sin
        scores = torch.matmul(q, k.transpose(2, 3)) * (self.head_dim ** -0.5)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden)
        self.feed_forward = FeedForward(args.hidden, args.ffn)

    def forward(self, x, cos, sin, rot, mask):
        h = x + self.attention(self.attention_norm(x), cos, sin, rot, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token ids [B, S] (and labels [B, S]) -> the loss, a scalar."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.global_tokens = 0  # set by the backend: the labels of the whole step
        self.tok_embeddings = nn.Embedding(args.vocab, args.hidden)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.layers)})
        self.norm = RMSNorm(args.hidden)
        self.output = nn.Linear(args.hidden, args.vocab, bias=False)
        cos, sin, rot = rotary_buffers(args.seqlen, args.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_rot", rot, persistent=False)
        mask = torch.ones(args.seqlen, args.seqlen, dtype=torch.bool).triu(1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin, self.rope_rot, self.causal_mask)
        if self.output is None:
            return h
        logits = self.output(self.norm(h) if self.norm is not None else h)
        return logits if labels is None else self.loss(logits, labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the logits against the labels, summed and divided
        by ``global_tokens``, the label count of the whole step (every rank,
        every microbatch; the backend sets it). Each rank's, each
        microbatch's loss is then its share of the mean over all tokens."""
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def llama(**kw) -> Llama:
    return Llama(LlamaArgs(**kw))


class LlamaMean(Llama):
    """The Llama whose loss is the mean over the tokens it is given: on a
    data-parallel rank the mean over the rank's own tokens, dp times its
    share of the step's mean (the usual ``F.cross_entropy`` set-up), so the
    gradients are averaged over replicas, not summed."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return total / labels.numel()


def llama_mean(**kw) -> LlamaMean:
    return LlamaMean(LlamaArgs(**kw))
