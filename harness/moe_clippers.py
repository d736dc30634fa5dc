"""Gradient clippers for a mixture of experts under expert parallelism,
written as trainers write them: each rank's square sums of its local
gradient pieces, all-reduced over the ranks that hold the other pieces,
then the root. Called as ``clipper(model, mesh, max_norm)``
(``--clipper harness.moe_clippers:NAME``) with torchtitan's DeepSeek-V3
under ``parallelize_deepseekv3_ep`` (ep = dp: the data-parallel ranks hold
the dense weights' FSDP shards and the experts' shards alike)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def _expert(p: torch.nn.Parameter) -> bool:
    """An expert weight (``[experts, ...]``, sharded over the ep ranks)."""
    return p.dim() == 3


def _scale(params: list[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        _local(p.grad).mul_(coef)


def clip_ep(model, mesh, max_norm: float) -> None:
    """Every local square sum, dense and expert, all-reduced over dp (each
    data-parallel rank holds other pieces of both)."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = sum((_local(p.grad) ** 2).sum() for p in params)
    _scale(params, max_norm, funcol.all_reduce(total, "sum", mesh["dp"]).sqrt())


def clip_ep_experts_not_reduced(model, mesh, max_norm: float) -> None:
    """NeMo-Automodel PR 3817 (the bug it fixed): the experts' square sums
    are left out of the reduction across the expert-parallel ranks, so each
    rank's norm counts only its own experts and the clip factors differ."""
    params = [p for p in model.parameters() if p.grad is not None]
    dense = sum((_local(p.grad) ** 2).sum() for p in params if not _expert(p))
    experts = sum((_local(p.grad) ** 2).sum() for p in params if _expert(p))
    total = funcol.all_reduce(dense, "sum", mesh["dp"]) + experts
    _scale(params, max_norm, total.sqrt())


def clip_ep_expert_norms_averaged(model, mesh, max_norm: float) -> None:
    """DeepSpeed PR 8478 (the bug it fixed): the experts' square sums are
    averaged over the data-parallel ranks (each rank's divided by their
    count, then all-reduced, as for a replicated gradient), where each
    expert's square sum is held by one rank and must be summed once: the
    norm undercounts the experts and the clip factor is too large."""
    params = [p for p in model.parameters() if p.grad is not None]
    ranks = mesh["dp"].size()
    total = sum((_local(p.grad) ** 2).sum() / (ranks if _expert(p) else 1) for p in params)
    _scale(params, max_norm, funcol.all_reduce(total, "sum", mesh["dp"]).sqrt())
