"""Parallelization recipes written as ordinary PyTorch.

A recipe is ``recipe(model, mesh) -> after_backward | None``: it
parallelizes ``model`` in place on ``mesh`` (a ("dp", "tp") DeviceMesh) and
may return a function ``after_backward(model, mesh)`` that runs after
``loss.backward()`` (gradient synchronization the recipe does by hand).
The data-parallel batch split is done by the backend: rank (d, t) reads
rows [d * B/dp, (d + 1) * B/dp) of the batch.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from backends.torch.pipeline import PipelineStep


def llama_tp_plan(model, tp_mesh, norms: bool = True, vocab_parallel: bool = False) -> None:
    """torchtitan's tensor and sequence parallel plan for the Llama blocks;
    ``norms=False`` leaves the norms out (the bug of Megatron-LM issue 1446);
    ``vocab_parallel`` splits the embedding table by rows (torchtitan's
    ``RowwiseParallel`` embedding: each rank looks up the ids of its rows)."""
    embedding = (RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
                 if vocab_parallel else
                 PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)))
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": embedding,
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


def llama_plain_tp_plan(model, tp_mesh, wo_output=None) -> None:
    """Megatron's tensor parallelism without sequence parallelism: norms and
    the residual stream replicated, q/k/v, w1, w3 and the output colwise, wo
    and w2 rowwise (their outputs all-reduced to ``Replicate``).
    ``wo_output=Partial()`` leaves wo's output a partial sum (a bug)."""
    parallelize_module(model, tp_mesh, {
        "output": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=wo_output or Replicate()),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        })


def tp(model, mesh):
    """Tensor parallelism without sequence parallelism on "tp", gradients
    summed over "dp"."""
    llama_plain_tp_plan(model, mesh["tp"])
    return all_reduce_dp


def tp_rowwise_partial(model, mesh):
    """Bug: tp with attention.wo's ``RowwiseParallel`` output left
    ``Partial``: each rank adds its partial sum to the residual stream."""
    llama_plain_tp_plan(model, mesh["tp"], wo_output=Partial())
    return all_reduce_dp


def average_dp(model, mesh, dim: str = "dp", op: str = "avg") -> None:
    """all_reduce_dp with the reduce op ``op`` over mesh dim ``dim``: "avg"
    over "dp" is DDP's reduction of a per-rank mean loss."""
    group = mesh[dim]
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            p.grad = p.grad.redistribute(placements=p.placements)
        local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        local.copy_(funcol.all_reduce(local, op, group))


def ddp_avg(model, mesh):
    """DDP by hand for a per-rank mean loss (``models:llama_mean``): no
    tensor-parallel plan, gradients averaged over "dp" (ReduceOp.AVG)."""
    return average_dp


def tp_sp_avg(model, mesh):
    """tp_sp for a per-rank mean loss: gradients averaged over "dp"."""
    llama_tp_plan(model, mesh["tp"])
    return average_dp


def tp_sp_wrong_mesh_dim(model, mesh):
    """Bug: tp_sp whose data-parallel gradient sum runs over "tp" instead of
    "dp" (the replicas' gradients are never summed)."""
    llama_tp_plan(model, mesh["tp"])
    return lambda m, msh: average_dp(m, msh, dim="tp", op="sum")


def tp_sp(model, mesh):
    """Tensor and sequence parallelism on "tp", gradients summed over "dp"."""
    llama_tp_plan(model, mesh["tp"])
    return all_reduce_dp


def tp_sp_vocab(model, mesh):
    """tp_sp with the vocabulary-parallel embedding."""
    llama_tp_plan(model, mesh["tp"], vocab_parallel=True)
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
    over "dp" (each block, then the root). The loss is divided by the token
    count of the whole step, so the replicas' gradients are summed: the
    gradient divide factor is 1."""
    llama_tp_plan(model, mesh["tp"])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    if divide_factor is not None:
        for module in (model, *model.layers.values()):
            module.set_gradient_divide_factor(divide_factor)
    return reduce_tp_partials


def fsdp_tp_block_left_out(model, mesh):
    """fsdp_tp with the last block left out of its own ``fully_shard``: the
    root's ``fully_shard`` then owns its parameters, which are sharded,
    gathered and reduced with the root's. A mistake that changes no value
    (only when the block's parameters are gathered and freed)."""
    llama_tp_plan(model, mesh["tp"])
    blocks = list(model.layers.values())
    for block in blocks[:-1]:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for module in (model, *blocks[:-1]):
        module.set_gradient_divide_factor(1.0)
    return reduce_tp_partials


def fsdp_tp_default_divide(model, mesh):
    """fsdp_tp keeping FSDP's default divide factor (the data-parallel size):
    with a loss already divided by the whole step's token count, every
    gradient is 1/dp of the single-device one."""
    return fsdp_tp(model, mesh, divide_factor=None)


def keep_stage(model, stage: int, stages: int) -> None:
    """Keep, in place, the modules of pipeline stage ``stage`` of ``stages``
    (torchtitan's split: contiguous layers, the embedding on the first stage,
    the final norm and output on the last)."""
    names = list(model.layers.keys())
    if len(names) % stages:
        raise ValueError(f"{len(names)} layers do not split into {stages} stages")
    per = len(names) // stages
    for name in names[:stage * per] + names[(stage + 1) * per:]:
        del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != stages - 1:
        model.norm = None
        model.output = None


def pipeline(model, mesh, schedule_class, microbatches: int = 2, scale_grads: bool = False,
             accumulation: int = 1) -> PipelineStep:
    """Pipeline parallelism on "pp" with ``schedule_class`` (GPipe, 1F1B) and
    ``microbatches`` per step; gradients summed over "dp". Each
    microbatch's loss is its share of the step's mean (the model divides by
    the step's token count), so the microbatches' gradients are summed:
    ``scale_grads=False``, as PyTorch's documentation says for such losses."""
    pp = mesh["pp"]
    stage, stages = pp.get_local_rank(), pp.size()
    args = model.args
    keep_stage(model, stage, stages)

    def schedule(tokens):
        rows = tokens.shape[0] // microbatches
        hidden = torch.empty(rows, args.seqlen, args.hidden, dtype=torch.float64,
                             requires_grad=True)
        first = tokens[:rows] if stage == 0 else hidden
        last = torch.empty(rows, args.seqlen, args.vocab, dtype=torch.float64, requires_grad=True)
        pp_stage = PipelineStage(model, stage, stages, torch.device("cpu"), input_args=first,
                                 output_args=last if stage == stages - 1 else hidden,
                                 group=pp.get_group())
        return schedule_class(pp_stage, microbatches, loss_fn=model.loss, scale_grads=scale_grads)

    after = all_reduce_dp if mesh["dp"].size() > 1 else None
    return PipelineStep(schedule, accumulation, after)


def pp_gpipe_scale_grads(model, mesh):
    """GPipe with ``scale_grads=True``: the schedule divides the summed
    gradients by the microbatch count, right for a loss that is the mean
    over each microbatch's tokens (``models:llama_mean``)."""
    return pipeline(model, mesh, ScheduleGPipe, scale_grads=True)


def pp_1f1b_scale_grads(model, mesh):
    """1F1B with ``scale_grads=True`` (see pp_gpipe_scale_grads)."""
    return pipeline(model, mesh, Schedule1F1B, scale_grads=True)


def pp_gpipe(model, mesh):
    """Two microbatches through the GPipe schedule."""
    return pipeline(model, mesh, ScheduleGPipe)


def pp_1f1b(model, mesh):
    """Two microbatches through the 1F1B schedule."""
    return pipeline(model, mesh, Schedule1F1B)


def pp_accumulate(model, mesh):
    """GPipe with two gradient accumulation steps of two microbatches each:
    the gradients of all four sum in ``.grad`` (``scale_grads=False``, the
    fix of torchtitan PR 1732)."""
    return pipeline(model, mesh, ScheduleGPipe, accumulation=2)


def pp_accumulate_scale_grads(model, mesh):
    """Bug (torchtitan issue 1733): pp_accumulate with the schedule's default
    ``scale_grads=True``, which divides the gradients accumulated so far by
    the microbatch count at the end of every step: with accumulation, a
    moving average instead of a sum."""
    return pipeline(model, mesh, ScheduleGPipe, accumulation=2, scale_grads=True)
