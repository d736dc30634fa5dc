"""cp: a causal attention tagger whose attention is computed as a ring of two
ranks computes it, in one process: the second half of the queries attends
the first half of the keys (no mask) and its own half (causal) with the CPU
flash kernel, the two blocks merged by their log-sum-exps in PyTorch's
sigmoid form (``out - sigmoid(lse_b - lse) (out - out_b)``, ``lse -
logsigmoid(lse - lse_b)``), and the backward runs the kernel's backward per
block at the merged out and lse, as CP's ring does. Its lowering is checked
against torch's loss and gradients (tests/test_cp_lowering.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

aten = torch.ops.aten


def _block(q, k, v, causal: bool):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


class TwoBlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, other_lse: bool = False):
        half = q.shape[2] // 2
        (q0, q1), (k0, k1), (v0, v1) = (t.split(half, dim=2) for t in (q, k, v))
        out0, lse0 = _block(q0, k0, v0, True)
        out, lse = _block(q1, k0, v0, False)
        out_b, lse_b = _block(q1, k1, v1, True)
        lse, lse_b = lse.unsqueeze(-1), lse_b.unsqueeze(-1)
        shift = lse0.unsqueeze(-1) if other_lse else lse
        out = out - torch.sigmoid(lse_b - shift) * (out - out_b)
        lse = (lse - F.logsigmoid(lse - lse_b)).squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        return torch.cat([out0, out], dim=2)

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        half = q.shape[2] // 2
        (q0, q1), (k0, k1), (v0, v1) = (t.split(half, dim=2) for t in (q, k, v))
        g0, g1 = g.split(half, dim=2)
        out0, lse0 = _block(q0, k0, v0, True)
        dq0, dk0, dv0 = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g0, q0, k0, v0, out0, lse0, 0.0, True)
        dq1, dk0b, dv0b = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g1, q1, k0, v0, out, lse, 0.0, False)
        dq1b, dk1, dv1 = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g1, q1, k1, v1, out, lse, 0.0, True)
        return (torch.cat([dq0, dq1 + dq1b], dim=2), torch.cat([dk0 + dk0b, dk1], dim=2),
                torch.cat([dv0 + dv0b, dv1], dim=2), None)


class RingTagger(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.global_tokens = 0
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.head = nn.Linear(hidden, vocab)
        #: attention as a ring of two computes it (else one SDPA call)
        self.ring = True
        self.fault = ""
        #: the one-call attention is causal (else every key is seen)
        self.causal = True
        #: query heads per key and value head (``enable_gqa``: the keys
        #: and values are the first heads // kv_groups heads)
        self.kv_groups = 1

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(h).chunk(3, dim=-1))
        if self.kv_groups > 1:
            k, v = (t[:, : self.heads // self.kv_groups] for t in (k, v))
        y = TwoBlockAttention.apply(q, k, v, self.fault == "other_lse") if self.ring else \
            F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           enable_gqa=self.kv_groups > 1)
        y = y.transpose(1, 2).reshape(b, s, d)
        logits = self.head(h + y).flatten(0, 1)
        return self.loss(logits, labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


class AnswerTagger(RingTagger):
    """The SDPA tagger trained on the answer only: the labels of the first
    quarter of the sequence (the prompt) ignored (-100), so that at cp 4
    context-parallel rank 0 holds no target (Megatron-LM PR 7498's
    mechanism, on the main loss). The loss divides the kept labels' sum by
    their count: over the whole step, the count all-reduced over
    ``count_group`` (set by the recipe), or, as ``rank_mean`` ships, by
    the rank's own count (clamped to 1 on a rank that has none).
    ``position_offset``: where the rank's chunk starts (set by the
    recipe)."""

    def __init__(self, rank_mean: bool = False, **kw):
        super().__init__(**kw)
        self.ring = False
        self.prompt = kw["seqlen"] // 4
        self.position_offset = 0
        self.count_group = None
        self.rank_mean = rank_mean

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        start = self.position_offset
        positions = torch.arange(start, start + labels.shape[1]).repeat(labels.shape[0], 1)
        target = labels.masked_fill(positions < self.prompt, -100).flatten()
        total = F.cross_entropy(logits, target, reduction="sum", ignore_index=-100)
        count = (target != -100).sum()
        if self.rank_mean:
            return total / count.clamp(min=1)
        if self.count_group is not None:
            dist.all_reduce(count, group=self.count_group)
        return total / count


def answer_tagger(**kw) -> AnswerTagger:
    return AnswerTagger(**kw)


def answer_tagger_rank_mean(**kw) -> AnswerTagger:
    """Bug: each context-parallel rank's loss the mean over its own kept
    labels (a rank with none: its sum over a count clamped to 1)."""
    return AnswerTagger(rank_mean=True, **kw)


def ring_tagger(**kw) -> RingTagger:
    return RingTagger(**kw)


def sdpa_tagger(**kw) -> RingTagger:
    """The tagger with one SDPA call: the single-device step of ring_ddp."""
    model = RingTagger(**kw)
    model.ring = False
    return model


def sdpa_gqa_tagger(**kw) -> RingTagger:
    """The SDPA tagger with grouped-query attention: two query heads per
    key and value head (``enable_gqa``), as torchtitan's Qwen3 runs it."""
    model = sdpa_tagger(**kw)
    model.kv_groups = 2
    return model


def sdpa_encoder(**kw) -> RingTagger:
    """The tagger with one SDPA call that sees every key (not causal)."""
    model = sdpa_tagger(**kw)
    model.causal = False
    return model


def ring_ddp(model, mesh):
    """Data parallelism by hand over "dp", each rank's attention computed as a
    ring of two computes it, against the single-device SDPA. Refused today
    (exit 2): the backend aligns every parallel value with a single-device
    one, and a block's softmax over part of each row is a piece of none
    (docs/torch-backend.md, "Context parallelism")."""
    from backends.torch.zoo.recipes import all_reduce_dp
    model.ring = True
    return all_reduce_dp


def ring_ddp_wrong_merge(model, mesh):
    """ring_ddp with the second block merged against another block's
    log-sum-exp (the first query half's: sigmoid(lse_b - lse0) instead of
    sigmoid(lse_b - lse))."""
    from backends.torch.zoo.recipes import all_reduce_dp
    model.ring = True
    model.fault = "other_lse"
    return all_reduce_dp


class GatherTagger(nn.Module):
    """A fixed table of positions (a buffer, as a rotary table is) gathered along the sequence (dim 1) at
    positions computed from the ids (the last position where a token id is
    at least 5, else the first), the way torchtitan's rotary table is gathered at a rank's
    positions: its lowering (``counts.gather`` along a dim other than the
    last) is checked against torch (tests/test_cp_torch_balance.py)."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del layers, heads, ffn
        self.embed = nn.Embedding(vocab, hidden)
        self.register_buffer("table", torch.randn(seqlen, hidden), persistent=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        positions = (tokens >= 5).long() * (s - 1)
        table = self.table[None, :, :].expand(b, -1, -1)
        rows = table.gather(1, positions[:, :, None].expand(b, s, table.shape[-1]))
        logits = self.head(torch.tanh(self.embed(tokens) + rows)).flatten(0, 1)
        return F.cross_entropy(logits, labels.flatten(), reduction="sum") / labels.numel()


def gather_tagger(**kw) -> GatherTagger:
    return GatherTagger(**kw)
