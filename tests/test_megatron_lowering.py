"""The general lowerings Megatron-Core's step needs, each on a tiny model
without Megatron (docs/soundness.md, "Plans traced from PyTorch", 35): the
lowered single-device step computes the loss and gradients torch computed
(backends/torch/check.py). Quick, in-process."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.check import check_lowering
from backends.torch.lower import lower_trace
from backends.torch.rank import run

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
