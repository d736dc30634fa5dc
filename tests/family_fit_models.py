"""Small models and recipes for the mechanisms transformers' MoE families
met (docs/soundness.md, "Plans traced from PyTorch", 109): a one-row
weight cut over "tp" along its other dim and sharded over "dp" by FSDP2
(hunyuan_v1_moe's one expert), a parameter of shape ``[1, n]`` squeezed
and added in the forward (ERNIE's ``moe_statics``), and a router that
casts its input to float32 against a weight the family keeps in float32
(Inkling2's). Functions whose docstring starts with "Bug" are mistakes
that change values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from backends.torch.zoo.recipes import reduce_tp_partials
from backends.torch.zoo.stock_models import RegressionTower
from backends.torch.zoo.stock_recipes import fsdp, mlp_tp_plan


def _one_row_head_plan(model, mesh) -> None:
    """The tower's MLPs split on "tp", its one-value head ``nn.Linear(h, 1)``
    row-parallel (weight ``[1, h]`` cut along dim 1, its input replicated)."""
    mlp_tp_plan(model, mesh["tp"])
    parallelize_module(model.head, mesh["tp"], {"2": RowwiseParallel(input_layouts=Replicate())})


def fsdp_tp_one_row_head(model, mesh):
    """``_one_row_head_plan`` then FSDP2 over "dp" (divide factor 1): the
    head's one row lives on the first rank of each dp group, each tp rank
    holding its half of the columns."""
    _one_row_head_plan(model, mesh)
    fsdp(model, mesh)
    return reduce_tp_partials


def fsdp_tp_one_row_head_avg(model, mesh):
    """Bug: as ``fsdp_tp_one_row_head``, but FSDP2 averages the gradients
    over "dp" (divide factor 2) where the shared-out loss needs their sum."""
    _one_row_head_plan(model, mesh)
    fsdp(model, mesh)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(2.0)
    return reduce_tp_partials


class RowBias(RegressionTower):
    """The SwiGLU tower with a bias of shape ``[1, hidden]`` squeezed and
    added to the embeddings (ERNIE's ``moe_statics``: ``h + b.squeeze()``)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.row_bias = nn.Parameter(torch.linspace(-0.3, 0.3, kw["hidden"]).view(1, -1))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.row_bias.squeeze()
        for block in self.blocks:
            x = block(x)
        pred = self.head(x)
        target = F.embedding(labels, self.targets)
        return F.mse_loss(pred, target, reduction="sum") / (self.global_tokens or labels.numel())


def row_bias(**kw) -> RowBias:
    return RowBias(**kw)


class Float32Router(nn.Module):
    """A router as Inkling2's: its input cast to float32 by the forward,
    its weight kept in float32 by the family (``_keep_in_fp32_modules_strict``)."""

    _keep_in_fp32_modules_strict = ["router.weight"]

    def __init__(self, hidden: int = 4, experts: int = 3):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.embed = nn.Embedding(8, hidden)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        h = self.embed(input_ids)
        return F.linear(h.float(), self.router.weight)
