"""Recipes written for torchtitan's mesh dims ("dp_replicate", "dp_shard",
"cp", "tp"), as a torchtitan user writes them, for the tower ``mlp`` of
backends/torch/zoo/stock_models.py; verified through ``--mesh``
(tests/test_mesh.py)."""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _tp(model, tp_mesh) -> None:
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                            "down": RowwiseParallel()})


def _reduce_partials(model, mesh) -> None:
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=p.placements)


def fsdp_tp(model, mesh):
    """torchtitan's layout: TP on "tp", FSDP2 on "dp_shard", or HSDP on
    ("dp_replicate", "dp_shard") when there are replicas; the loss is a
    share of the step's mean, so gradients are summed (divide factor 1)."""
    if mesh["tp"].size() > 1:
        _tp(model, mesh["tp"])
    dp = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    for module in (*model.blocks, model):
        fully_shard(module, mesh=dp)
    for module in (*model.blocks, model):
        module.set_gradient_divide_factor(1.0)
    return _reduce_partials


def ddp_on_shard_only(model, mesh):
    """A mistake of a 2-D data-parallel mesh: gradients summed over
    "dp_shard" only, so the "dp_replicate" replicas never meet."""
    if mesh["tp"].size() > 1:
        _tp(model, mesh["tp"])

    def after_backward(model, mesh) -> None:
        _reduce_partials(model, mesh)
        for p in model.parameters():
            local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            local.copy_(funcol.all_reduce(local, "sum", mesh["dp_shard"]))
    return after_backward
