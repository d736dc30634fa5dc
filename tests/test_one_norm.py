"""The 1-norm along dims (``lowering/arithmetic.py`` ``_one_norm_along``;
docs/soundness.md, "Plans traced from PyTorch", 117): ``sum(|x|, dims)``,
compared with PyTorch's values and gradients, signs of both kinds; DBRX's
router divides its top weights by it."""

from __future__ import annotations

import torch
from torch import nn

from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"hidden": 4, "vocab": 10, "seqlen": 4}


class OneNormed(nn.Module):
    """Embedded tokens, projected, divided by their 1-norm along the last
    dim (with entries of both signs), and a square loss."""

    def __init__(self, **_sizes: int):
        super().__init__()
        self.embed = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.proj = nn.Linear(SIZES["hidden"], SIZES["hidden"], bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(tokens))
        out = h / (torch.norm(h, p=1, dim=-1, keepdim=True) + 1.0)
        return (out * out).sum() + torch.linalg.vector_norm(h, ord=1, dim=(0, 1)).sum()


def one_normed(**sizes: int) -> OneNormed:
    return OneNormed(**sizes)


def test_one_norm_lowers_exactly() -> None:
    spec = {"model": f"{__name__}:one_normed", "model_kwargs": {}, "recipe": "", "dp": 1,
            "tp": 1, "pp": 1, "batch": 3, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"],
            "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads, "no gradient was compared"
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences
