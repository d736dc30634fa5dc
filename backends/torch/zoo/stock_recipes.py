"""Recipes for the stock-layer models (``backends/torch/stock_models.py``),
written as ordinary PyTorch, and model-independent ones.

A recipe is ``recipe(model, mesh) -> after_backward | None``
(docs/torch-backend.md). The models' losses are shares of the step's mean
(``loss="share"``), so gradients are summed over data-parallel replicas.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from backends.torch.zoo.recipes import all_reduce_dp, hsdp_mesh, reduce_tp_partials


def blocks(model) -> list:
    """The repeated blocks of a model: ``h`` (GPT-2), ``blocks`` (the tower),
    ``layers`` (Llama), or the layers of an ``nn.TransformerEncoder`` ``encoder``."""
    if isinstance(getattr(model, "encoder", None), nn.TransformerEncoder):
        return list(model.encoder.layers)
    for name in ("h", "blocks", "layers"):
        found = getattr(model, name, None)
        if found is not None:
            return list(found.values()) if hasattr(found, "values") else list(found)
    raise ValueError("the model has no h, blocks or layers to parallelize")


def ddp(model, mesh):
    """Data parallelism by hand: every gradient summed over "dp" after the
    backward (what DDP does); the "tp" ranks, if any, compute the same."""
    return all_reduce_dp


def fsdp(model, mesh):
    """FSDP2 over "dp": each block, then the root; the gradients of the
    shared-out loss are summed (divide factor 1)."""
    for block in blocks(model):
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for module in (model, *blocks(model)):
        module.set_gradient_divide_factor(1.0)
    return None


def hsdp(model, mesh):
    """FSDP2's hybrid sharding over "dp" (two replicas of dp / 2 shards):
    each block, then the root; gradients summed (divide factor 1)."""
    dp_mesh = hsdp_mesh(mesh)
    for block in blocks(model):
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for module in (model, *blocks(model)):
        module.set_gradient_divide_factor(1.0)
    return None


def mlp_tp_plan(model, tp_mesh) -> None:
    """Megatron's MLP split on "tp": the first projections column-parallel,
    the last row-parallel (GPT-2's ``mlp.c_fc``/``mlp.c_proj``, the tower's
    ``gate``/``up``/``down``)."""
    for block in blocks(model):
        if hasattr(block, "mlp"):
            plan = {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
        else:
            plan = {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(block, tp_mesh, plan)


def tp_mlp(model, mesh):
    """mlp_tp_plan on "tp", gradients summed over "dp"."""
    mlp_tp_plan(model, mesh["tp"])
    return all_reduce_dp


def fsdp_tp_mlp(model, mesh):
    """mlp_tp_plan on "tp" and FSDP2 over "dp" (divide factor 1)."""
    mlp_tp_plan(model, mesh["tp"])
    fsdp(model, mesh)
    return reduce_tp_partials


def attention_tp_plan(model, tp_mesh) -> None:
    """Megatron's attention split by heads on "tp": separate q, k, v
    projections column-parallel (each rank computes its heads' queries,
    keys and values; grouped-query keeps its ratio), the output projection
    row-parallel; and the MLP as in ``mlp_tp_plan``."""
    for block in blocks(model):
        attn = block.attn
        out = "attn.o_proj" if hasattr(attn, "o_proj") else "attn.c_proj"
        plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), out: RowwiseParallel()}
        if hasattr(block, "mlp"):
            plan.update({"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
        else:
            plan.update({"gate": ColwiseParallel(), "up": ColwiseParallel(),
                         "down": RowwiseParallel()})
        parallelize_module(block, tp_mesh, plan)


def tp_attention(model, mesh):
    """attention_tp_plan on "tp", gradients summed over "dp": the correct
    tensor-parallel attention for a model with separate q, k, v projections
    (GPT-2 with ``attention="split"``, the grouped-query decoder)."""
    attention_tp_plan(model, mesh["tp"])
    return all_reduce_dp


def tp_attention_no_dp_sum(model, mesh):
    """Bug: attention_tp_plan on "tp" and no gradient reduction over "dp"
    (each replica keeps the gradient of its own rows)."""
    attention_tp_plan(model, mesh["tp"])
    return reduce_tp_partials


def fsdp_tp_attention(model, mesh):
    """attention_tp_plan on "tp" and FSDP2 over "dp" (divide factor 1)."""
    attention_tp_plan(model, mesh["tp"])
    fsdp(model, mesh)
    return reduce_tp_partials


def all_reduce_weights_only(model, mesh) -> None:
    """Bug: the data-parallel sum restricted to parameters named ``weight``
    (a filter by name), so every bias keeps its own replica's gradient."""
    group = mesh["dp"]
    for name, p in model.named_parameters():
        if p.grad is not None and name.endswith("weight"):
            p.grad.copy_(funcol.all_reduce(p.grad, "sum", group))


def ddp_weights_only(model, mesh):
    """ddp with the bug of all_reduce_weights_only."""
    return all_reduce_weights_only

