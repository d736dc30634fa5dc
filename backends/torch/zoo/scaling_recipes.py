"""Recipes for the stock-layer models (``backends/torch/stock_models.py``)
under the other loss-scaling convention, and mistakes of tensor
parallelism on GPT-2's fused attention projection.

The ``*_mean`` models average their loss over the rank's own tokens, so
their gradients are dp times a share and the replicas' gradients are
averaged: FSDP2's default divide factor, or ``ReduceOp.AVG``
(docs/soundness.md, "Scaled claims"). Kept apart from
``stock_recipes.py``, which imports ``recipes.py``, so that neither module
imports the other in a cycle.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from backends.torch.zoo.recipes import all_reduce_dp, average_dp, reduce_tp_partials
from backends.torch.zoo.stock_recipes import blocks, mlp_tp_plan


def fsdp_default(model, mesh):
    """FSDP2 over "dp" (each block, then the root) with its default gradient
    divide factor: the reduce-scatter averages over the shard group."""
    for block in blocks(model):
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return None


def fsdp_tp_mlp_default(model, mesh):
    """mlp_tp_plan on "tp" (biased row-parallel projections: DTensor adds
    bias/tp to each partial sum) under FSDP2 with the default divide factor."""
    mlp_tp_plan(model, mesh["tp"])
    fsdp_default(model, mesh)
    return reduce_tp_partials


def tp_mlp_avg(model, mesh):
    """mlp_tp_plan on "tp", gradients averaged over "dp" (ReduceOp.AVG)."""
    mlp_tp_plan(model, mesh["tp"])
    return average_dp


def tp_fused_qkv_colwise(model, mesh):
    """Bug: GPT-2's fused ``c_attn`` (q, k and v side by side) split
    column-wise and ``c_proj`` row-wise, as one would for separate q, k, v
    projections. Rank t holds columns [t * 3h/tp, (t + 1) * 3h/tp) of the
    fused output, and the model's ``chunk(3)`` of that local piece is not
    rank t's heads of q, k and v (with tp 2: q's first half, q's second
    half as k, and k's first half as v)."""
    for block in blocks(model):
        parallelize_module(block, mesh["tp"], {"attn.c_attn": ColwiseParallel(),
                                               "attn.c_proj": RowwiseParallel()})
    return all_reduce_dp


def sum_then_divide(model, mesh) -> None:
    """Gradients all-reduced with SUM over "dp", then divided by the dp
    size in place: the hand-written form of AVG."""
    n = mesh["dp"].size()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.copy_(funcol.all_reduce(p.grad, "sum", mesh["dp"]))
            p.grad.div_(n)


def ddp_sum_divide(model, mesh):
    """DDP by hand for a per-rank mean loss: SUM over "dp", then / dp."""
    return sum_then_divide
