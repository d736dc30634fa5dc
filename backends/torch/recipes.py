"""Parallelization recipes written as ordinary PyTorch.

A recipe is ``recipe(model, mesh) -> after_backward | None``: it
parallelizes ``model`` in place on ``mesh`` (a ("dp", "tp") DeviceMesh) and
may return a function ``after_backward(model, mesh)`` that runs after
``loss.backward()`` (gradient synchronization the recipe does by hand).
The data-parallel batch split is done by the backend: rank (d, t) reads
rows [d * B/dp, (d + 1) * B/dp) of the batch.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def llama_tp_plan(model, tp_mesh, norms: bool = True) -> None:
    """torchtitan's tensor and sequence parallel plan for the Llama blocks;
    ``norms=False`` leaves the norms out (the bug of Megatron-LM issue 1446)."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if not norms:
            del plan["attention_norm"], plan["ffn_norm"]
        parallelize_module(block, tp_mesh, plan)


def all_reduce_dp(model, mesh) -> None:
    """Reduce tensor-parallel partial gradients to their parameter's
    placements (what the optimizer step or gradient clipping does first),
    then sum every gradient over the data-parallel replicas (what DDP does)."""
    group = mesh["dp"]
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            p.grad = p.grad.redistribute(placements=p.placements)
        local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        local.copy_(funcol.all_reduce(local, "sum", group))


def tp_sp(model, mesh):
    """Tensor and sequence parallelism on "tp", gradients summed over "dp"."""
    llama_tp_plan(model, mesh["tp"])
    return all_reduce_dp


def reduce_grads_relabelled(model, mesh) -> None:
    """Bug (torchtitan PR 3412): a Partial(sum) gradient relabelled Replicate
    instead of reduced, so its tensor-parallel reduction never runs."""
    group = mesh["dp"]
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            p.grad = DTensor.from_local(p.grad.to_local(), p.device_mesh, p.placements)
        local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        local.copy_(funcol.all_reduce(local, "sum", group))


def tp_sp_partial_as_replicate(model, mesh):
    """tp_sp with the bug of torchtitan PR 3412 (see reduce_grads_relabelled)."""
    llama_tp_plan(model, mesh["tp"])
    return reduce_grads_relabelled


def tp_sp_norm_not_parallel(model, mesh):
    """Bug (Megatron-LM issue 1446): under sequence parallelism the norm
    weights are left out of the plan, so each tensor-parallel rank keeps the
    gradient of its own sequence shard and it is never summed across them."""
    llama_tp_plan(model, mesh["tp"], norms=False)
    return all_reduce_dp


def reduce_tp_partials(model, mesh) -> None:
    """Reduce tensor-parallel partial gradients to their parameter's placements."""
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=p.placements)


def fsdp_tp(model, mesh, divide_factor: float | None = 1.0):
    """torchtitan's 2-D recipe: tensor and sequence parallelism on "tp", FSDP2
    over "dp" (each block, then the root). The losses are sums, so the
    gradient divide factor is 1."""
    llama_tp_plan(model, mesh["tp"])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    if divide_factor is not None:
        for module in (model, *model.layers.values()):
            module.set_gradient_divide_factor(divide_factor)
    return reduce_tp_partials


def fsdp_tp_default_divide(model, mesh):
    """fsdp_tp keeping FSDP's default divide factor (the data-parallel size):
    with a sum loss, every gradient is 1/dp of the single-device one."""
    return fsdp_tp(model, mesh, divide_factor=None)
