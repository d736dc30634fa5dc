"""Rows written at a recorded permutation into a fresh tensor
(``out[perm] = y``, transformers' expert-parallel unpermutation) and rows
added back at a recorded index that repeats (the backward of ``x[idx]``
when its gradient is a computed tensor): the lowered single-device step
computes the loss and gradients torch computed (docs/soundness.md, "Plans
traced from PyTorch", 54). Quick, in-process."""

from __future__ import annotations

import torch
from torch import nn

from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"layers": 1, "hidden": 6, "heads": 2, "ffn": 8, "vocab": 10, "seqlen": 4}


class Permuted(nn.Module):
    """Rows picked with repeats at a constant index, mixed across rows (a
    cumulative sum: no row-wise op), written back at a constant permutation
    into an empty tensor, and summed per token."""

    def __init__(self, **_sizes: int):
        super().__init__()
        h, v = SIZES["hidden"], SIZES["vocab"]
        self.embed = nn.Embedding(v, h)
        self.w = nn.Parameter(torch.randn(h, h) / h)
        self.out = nn.Linear(h, v, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(0, 1)  # [T, h]
        t = x.shape[0]
        order = torch.argsort(torch.arange(2 * t) * 7 % (2 * t))  # a constant permutation
        pairs = x[order // 2] @ self.w  # each token twice, rows in another order
        mixed = torch.cumsum(pairs, 0)
        back = torch.empty_like(mixed)
        back[order] = mixed
        y = back.view(t, 2, -1).sum(1)
        logits = self.out(y)
        return nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum")


def permuted(**sizes: int) -> Permuted:
    return Permuted(**sizes)


def test_rows_at_a_permutation_and_repeated_rows_added_back_lower_exactly() -> None:
    spec = {"model": f"{__name__}:permuted", "model_kwargs": SIZES, "recipe": "", "dp": 1,
            "tp": 1, "pp": 1, "batch": 2, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"],
            "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    ops = {ev[0] for ev in trace["events"]}
    assert "aten.index_put_.default" in ops
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert "w" in check.grads and "embed.weight" in check.grads
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences
