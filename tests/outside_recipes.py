"""Recipes written as users write them with PyTorch's parallel APIs."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel


def ddp_module(model, mesh):
    """DDP wrapping the model."""
    return DistributedDataParallel(model, process_group=mesh["dp"].get_group())
