"""Recipes written the way users write them for the models of
``tests/outside_models.py``, loaded as ``--recipe tests.outside_mistakes:NAME``:
realistic mistakes, each of which changes the gradients of a real run
(``scripts/gloo_truth.py`` says ``differs``) and must fail naming the module
and the rank. The correct recipes are the backend's stock ones.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from backends.torch.zoo.stock_recipes import blocks


def _local_grad(p):
    if isinstance(p.grad, DTensor):
        p.grad = p.grad.redistribute(placements=p.placements)
        return p.grad._local_tensor
    return p.grad


def _reduce(params, mesh, dim: str, op: str) -> None:
    for p in params:
        if p.grad is not None:
            local = _local_grad(p)
            local.copy_(funcol.all_reduce(local, op, mesh[dim]))


def sum_blocks_only(model, mesh) -> None:
    """Bug: the data-parallel gradient sum over the repeated blocks only,
    written as ``for block in model.blocks: ...``: the embedding and the
    head keep each replica's own part."""
    _reduce((p for block in blocks(model) for p in block.parameters()), mesh, "dp", "sum")


def ddp_blocks_only(model, mesh):
    return sum_blocks_only


def average_over_tp(model, mesh) -> None:
    """Bug: the per-rank mean's gradients averaged over the wrong mesh dim
    ("tp" for "dp"): the replicas are never combined."""
    _reduce(model.parameters(), mesh, "tp", "avg")


def ddp_avg_wrong_dim(model, mesh):
    return average_over_tp


def average_then_divide(model, mesh) -> None:
    """Bug: AVG over "dp", then divided by the dp size again (the average
    written twice: once by the reduce op, once by hand)."""
    n = mesh["dp"].size()
    for p in model.parameters():
        if p.grad is not None:
            local = _local_grad(p)
            local.copy_(funcol.all_reduce(local, "avg", mesh["dp"]))
            local.div_(n)


def ddp_avg_divided_twice(model, mesh):
    return average_then_divide


def sum_over_dp(model, mesh) -> None:
    _reduce(model.parameters(), mesh, "dp", "sum")


def tp_mlp_partial_output(model, mesh):
    """Bug: the MLP split Megatron's way, but ``mlp.c_proj``'s
    ``RowwiseParallel`` output left ``Partial`` (to save the all-reduce):
    each tensor-parallel rank adds its partial sum to the residual stream."""
    for block in blocks(model):
        parallelize_module(block, mesh["tp"], {
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=Partial()),
        })
    return sum_over_dp


def sum_linear_and_embedding_only(model, mesh) -> None:
    """Bug: the data-parallel gradient sum written over the model's
    ``nn.Linear`` and ``nn.Embedding`` modules (``for m in model.modules():
    if isinstance(m, (nn.Linear, nn.Embedding))``): the convolutions keep
    each replica's own gradient."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    _reduce((p for m in layers for p in m.parameters()), mesh, "dp", "sum")


def ddp_linear_only(model, mesh):
    return sum_linear_and_embedding_only
