"""``threshold_backward(grad, y, 0)`` of a value no relu produced
(``backends/torch/lowering/nn.py``): lowered by its definition, ``grad``
where ``y > 0``, compared with PyTorch's values."""

from __future__ import annotations

import torch
from torch import nn

from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"hidden": 4, "vocab": 10, "seqlen": 4}


class _Gate(torch.autograd.Function):
    """Identity forward on x; backward passes the gradient where ``y > 0``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, y, 0), None


class Gated(nn.Module):
    def __init__(self, **_sizes: int):
        super().__init__()
        self.embed = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.proj = nn.Linear(SIZES["hidden"], SIZES["hidden"], bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(tokens))
        squared = torch.relu(h) ** 2  # nemotron_h's relu2
        gated = _Gate.apply(h, (h * 3.0).detach())  # a value no relu produced
        return (squared * squared + gated * gated).sum()


def gated(**sizes: int) -> Gated:
    return Gated(**sizes)


def test_threshold_backward_of_any_value_lowers_exactly() -> None:
    spec = {"model": f"{__name__}:gated", "model_kwargs": {}, "recipe": "", "dp": 1,
            "tp": 1, "pp": 1, "batch": 3, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"],
            "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    ops = [ev[0] for ev in trace["events"]]
    assert ops.count("aten.threshold_backward.default") == 2, ops
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads, "no gradient was compared"
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences
