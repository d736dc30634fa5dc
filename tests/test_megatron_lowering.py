"""The general lowerings Megatron-Core's step needs, each on a tiny model
without Megatron (docs/soundness.md, "Plans traced from PyTorch", 35): the
lowered single-device step computes the loss and gradients torch computed
(backends/torch/tracer/check.py). Quick, in-process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.errors import LoweringError
from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 12, "vocab": 10, "seqlen": 4}


class SeqFirst(nn.Module):
    """Embedding, activations ``[s, b, h]`` as Megatron lays them out, a
    projection through ``view(s * b, h) @ w`` with a bias, scores from
    ``baddbmm`` of an uninitialized buffer with beta 0, a tensor whose
    ``.data`` is reassigned, a zeroed buffer accumulated into, and a
    cross-entropy summed over tokens."""

    def __init__(self, **_sizes: int):
        super().__init__()
        h, v = SIZES["hidden"], SIZES["vocab"]
        self.embed = nn.Embedding(v, h)
        self.w = nn.Parameter(torch.randn(h, h) / h)
        self.bias = nn.Parameter(torch.randn(h) / h)
        self.out = nn.Linear(h, v, bias=False)
        self.sequence_first = True

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(0, 1)  # [s, b, h]
        s, b, h = x.shape
        y = (x.reshape(s * b, h) @ self.w + self.bias).view(s, b, h)
        # the .data of a fresh tensor set to y's (Megatron's make_viewless_tensor)
        viewless = torch.empty((1,), dtype=y.dtype)
        viewless.data = y.data
        y = y + 0 * viewless.sum()
        q = y.permute(1, 0, 2)  # [b, s, h]
        buffer = torch.empty(b, s, s, dtype=y.dtype)
        scores = torch.baddbmm(buffer, q, q.transpose(1, 2), beta=0.0, alpha=0.5)
        mixed = torch.softmax(scores, dim=-1) @ q
        acc = torch.empty(b, s, h, dtype=y.dtype)
        acc.zero_()
        acc.add_(mixed)
        logits = self.out(acc)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def seq_first(**sizes: int) -> SeqFirst:
    return SeqFirst(**sizes)


def _single(model: str) -> dict:
    spec = {"model": model, "model_kwargs": SIZES, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 2, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"], "seed": 0,
            "parallel": False, "keep_values": True}
    return run(spec, 0)


def test_sequence_first_buffers_and_reassigned_data_lower_exactly() -> None:
    trace = _single(f"{__name__}:seq_first")
    assert trace["sequence_first"]
    low = lower_trace(trace, SIZES["vocab"])
    ops = {n.op for n in low.nodes}
    assert "einsum" in ops, "the merged [s * b, h] matmul is kept 3-d"
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads, "no gradient was compared"
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences


class TwoShardCrossEntropy(torch.autograd.Function):
    """A cross-entropy over logits ``[s, b, V]`` computed shard by shard of the
    vocabulary, as a vocabulary-parallel one computes it on each rank (rows
    ``[lo, hi)``; here both shards in one process, their maxima and sums
    combined without a collective): labels compared, shifted and masked, the
    logit at each label picked and zeroed outside the shard, the backward's
    ``g2d[arange(n), local] -= 1 - mask.float()`` written back. With
    ``zero_picks=False`` the out-of-range picks are left as they are: the
    logit at column 0, not the label's."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor,  # type: ignore[override]
                zero_picks: bool = True) -> torch.Tensor:
        shards = logits.chunk(2, dim=-1)
        width = shards[0].shape[-1]
        top = torch.maximum(shards[0].max(dim=-1)[0], shards[1].max(dim=-1)[0])
        picked, sums, saved = [], [], []
        for k, shard in enumerate(shards):
            lo, hi = k * width, (k + 1) * width
            x = shard.contiguous() - top.unsqueeze(-1)  # a rank's own shard
            mask = (target < lo) | (target >= hi)
            local = target.clone() - lo
            local[mask] = 0
            rows = torch.arange(x.shape[0] * x.shape[1])
            pick = x.view(-1, width)[rows, local.view(-1)].clone().view_as(target)
            if zero_picks:
                pick[mask] = 0.0
            torch.exp(x, out=x)
            sums.append(x.sum(dim=-1))
            picked.append(pick)
            saved += [x, mask, local]
        total = sums[0] + sums[1]
        ctx.save_for_backward(total, *saved)
        return (torch.log(total) - picked[0] - picked[1]).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        total, *saved = ctx.saved_tensors
        parts = []
        for k in range(2):
            x, mask, local = saved[3 * k:3 * k + 3]
            soft = x / total.unsqueeze(-1)
            g2d = soft.view(-1, soft.shape[-1])
            rows = torch.arange(g2d.shape[0])
            g2d[rows, local.view(-1)] -= 1.0 - mask.view(-1).float()
            parts.append(g2d.view_as(x) * grad)
        return torch.cat(parts, dim=-1), None, None


class ShardedLoss(nn.Module):
    """Embedding, ``[s, b, h]`` activations, logits, the loss above."""

    def __init__(self, zero_picks: bool = True, **_sizes: int):
        super().__init__()
        self.embed = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.out = nn.Linear(SIZES["hidden"], SIZES["vocab"], bias=False)
        self.zero_picks = zero_picks

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.out(torch.tanh(self.embed(tokens))).transpose(0, 1).contiguous()  # [s, b, V]
        return TwoShardCrossEntropy.apply(logits, labels.transpose(0, 1).contiguous(),
                                          self.zero_picks)


def sharded_loss(**sizes: int) -> ShardedLoss:
    return ShardedLoss(**sizes)


def unzeroed_picks(**sizes: int) -> ShardedLoss:
    return ShardedLoss(zero_picks=False, **sizes)


def test_a_cross_entropy_by_vocabulary_shards_lowers_exactly() -> None:
    """The label rules (comparisons, shift, mask, pick, the backward's update)
    on code that is not Megatron's: shards [0, 5) and [5, 10) in one process."""
    trace = _single(f"{__name__}:sharded_loss")
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads, "no gradient was compared"
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences


def test_picks_not_zeroed_outside_the_shard_are_refused() -> None:
    trace = _single(f"{__name__}:unzeroed_picks")
    with pytest.raises(LoweringError, match="label mask, local labels or pick"):
        lower_trace(trace, SIZES["vocab"])
