"""torchtitan's gpt_oss under its own TP plan with the rowwise linears'
bias gradient kept whole.

    verdict torch --model titan:gpt_oss \\
        --recipe backends.torch.zoo.titan_scaled_bias:parallelize \\
        --dp 1 --tp 2 --vocab 2048 --batch 2

torchtitan 0.3.0's ``ScaledBiasRowwiseLinear`` (gpt_oss's ``attention.wo``)
adds ``bias.to_local() / tp`` to each tensor-parallel rank's partial
output, so the sum over the ranks adds the bias once; but autograd then
gives each rank ``1/tp`` of the bias's gradient, which nothing sums over
tp: every rank ends with ``1/tp`` of it (the verifier's FAIL and gloo
agree; docs/torch-backend.md, "Top-k mixtures of experts"). Its MoE scales
its experts' down bias with ``ScaleBiasForward`` instead, which divides in
the forward only. This recipe is the family's own parallelize with those
linears' forward written as the MoE's: the bias divided by tp in the
forward only (``ScaleBiasForward``'s rule), its gradient passed through
whole. It verifies at dp 1 tp 2 (gloo agrees in float64,
``scripts/gloo_float64.py``; the single-device step's ``bias / 1`` is no
node: docs/soundness.md, "Plans traced from PyTorch", 119) and at dp 2 tp 2
(gloo in float64 agrees; the experts' bias-gradient sums span the grouped
GEMM's groups whichever experts a rank's tokens chose: item 123).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class _DividedForward(torch.autograd.Function):
    """``b / n`` in the forward, the gradient passed through whole (what
    torchtitan's ``ScaleBiasForward`` computes, on a plain tensor)."""

    @staticmethod
    def forward(ctx, b: torch.Tensor, n: int) -> torch.Tensor:
        return b / n if n > 1 else b.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _forward(self, input):
    """``F.linear`` of the local weight and the bias divided by tp in the
    forward only."""
    weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
    bias = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
    return F.linear(input, weight, _DividedForward.apply(bias, self.tp_degree))


def parallelize(model: nn.Module, mesh):
    """``backends.torch.titan:parallelize`` with every
    ``ScaledBiasRowwiseLinear``'s bias gradient passed through whole."""
    from torchtitan.models.common.linear import ScaledBiasRowwiseLinear

    from backends.torch.zoo.titan import parallelize as titan_parallelize
    for module in model.modules():  # before: torchtitan wraps the forward it finds
        if isinstance(module, ScaledBiasRowwiseLinear):
            module.forward = _forward.__get__(module)
    return titan_parallelize(model, mesh)
