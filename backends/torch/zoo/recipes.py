"""Parallelization recipes written as ordinary PyTorch.

A recipe is ``recipe(model, mesh) -> after_backward | None``: it
parallelizes ``model`` in place on ``mesh`` (a ("dp", "tp") DeviceMesh) and
may return a function ``after_backward(model, mesh)`` that runs after
``loss.backward()`` (gradient synchronization the recipe does by hand).
The data-parallel batch split is done by the backend: rank (d, t) reads
rows [d * B/dp, (d + 1) * B/dp) of the batch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from backends.torch.tracer.pipeline import PipelineStep


def llama_tp_plan(model, tp_mesh, norms: bool = True, vocab_parallel: bool = False,
                  loss_parallel: bool = False) -> None:
    """torchtitan's tensor and sequence parallel plan for the Llama blocks;
    ``norms=False`` leaves the norms out (the bug of Megatron-LM issue 1446);
    ``vocab_parallel`` splits the embedding table by rows (torchtitan's
    ``RowwiseParallel`` embedding: each rank looks up the ids of its rows);
    ``loss_parallel`` leaves the logits sharded along the vocabulary, a
    DTensor, for DTensor's ``loss_parallel()`` cross-entropy."""
    embedding = (RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
                 if vocab_parallel else
                 PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)))
    root = {
        "tok_embeddings": embedding,
        "norm": SequenceParallel(),
        "output": (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False) if loss_parallel else
                   ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())),
    }
    # a pipeline stage holds some of these modules (the others are None)
    parallelize_module(model, tp_mesh, {k: v for k, v in root.items()
                                        if getattr(model, k) is not None})
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


def hsdp_mesh(mesh, replicas: int = 2):
    """The 2-D data-parallel mesh of HSDP: "dp" unflattened into
    ("dp_replicate", "dp_shard"), ``replicas`` replicas of dp / replicas
    shards (data-parallel rank d is replica d // shards, shard d % shards)."""
    dp = mesh["dp"].size()
    if dp % replicas:
        raise ValueError(f"dp {dp} is not a multiple of {replicas} replicas")
    full = mesh._unflatten("dp", (replicas, dp // replicas), ("dp_replicate", "dp_shard"))
    return full["dp_replicate", "dp_shard"]


def hsdp(model, mesh, replicas: int = 2, divide_factor: float | None = 1.0):
    """HSDP with TP: torchtitan's TP+SP plan on "tp" and FSDP2's hybrid
    sharding over "dp" (``fully_shard`` on a 2-D mesh: each gradient
    reduce-scattered over the shards, then all-reduced over the replicas).
    The loss is the step's mean shared out, so the gradient divide factor
    is 1. Without tensor parallelism (tp 1) no TP plan is applied, so every
    parameter is on the 2-D mesh (gradient clipping stacks their norms)."""
    if mesh["tp"].size() > 1:
        llama_tp_plan(model, mesh["tp"])
    dp_mesh = hsdp_mesh(mesh, replicas)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if divide_factor is not None:
        for module in (model, *model.layers.values()):
            module.set_gradient_divide_factor(divide_factor)
    return reduce_tp_partials


def replicate_fp32(model, mesh, reduce_dtype: torch.dtype | None = torch.float32):
    """Data parallelism as FSDP2 with one shard per replica (HSDP with dp
    replicas of one shard, the layout of torch's FSDP2-based
    ``replicate``), gradients reduced in float32
    (``MixedPrecisionPolicy(reduce_dtype=torch.float32)``), for a per-rank
    mean loss: the gradient divide factor is set to dp, so the replicas'
    gradients are averaged. FSDP2 then folds the factor into the shard
    group's reduce-scatter (``PREMUL_SUM``), which a group of one rank
    skips: torch divides explicitly there (pytorch PR 167178)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    dp = mesh["dp"].size()
    dp_mesh = hsdp_mesh(mesh, replicas=dp)
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    for module in (model, *model.layers.values()):
        module.set_gradient_divide_factor(float(dp))
    return None


def replicate_fp64(model, mesh):
    """replicate_fp32 reducing in the parameters' float64: FSDP2 then divides
    by the factor itself (a pre-division of the reduce-scatter's input and
    a post-division), and the size-1 branch that PR 167178 added divides by
    it once more."""
    return replicate_fp32(model, mesh, reduce_dtype=None)


def fsdp_tp_default_divide(model, mesh):
    """fsdp_tp keeping FSDP's default divide factor (the data-parallel size):
    with a loss already divided by the whole step's token count, every
    gradient is 1/dp of the single-device one."""
    return fsdp_tp(model, mesh, divide_factor=None)


def stage_layers(model, stage: int, stages: int) -> list[str]:
    """The layer names of pipeline stage ``stage`` of ``stages`` (torchtitan's
    split: contiguous layers, equally many per stage), named as in the full
    model (``model.args.layers`` of them) also after stages were dropped."""
    total = model.args.layers
    if total % stages:
        raise ValueError(f"{total} layers do not split into {stages} stages")
    per = total // stages
    return [str(i) for i in range(stage * per, (stage + 1) * per)]


def keep_stages(model, held: list[int], stages: int) -> None:
    """Keep, in place, the modules of the pipeline stages ``held`` of
    ``stages``: their layers, the embedding if stage 0 is held, the final
    norm and output if the last is."""
    keep = {n for s in held for n in stage_layers(model, s, stages)}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if 0 not in held:
        model.tok_embeddings = None
    if stages - 1 not in held:
        model.norm = None
        model.output = None


def keep_stage(model, stage: int, stages: int) -> None:
    """Keep, in place, the modules of pipeline stage ``stage`` of ``stages``."""
    keep_stages(model, [stage], stages)


def stage_module(model, stage: int, stages: int):
    """Stage ``stage`` of a model that keeps several stages (``keep_stages``):
    a module sharing the model's submodules and parameters, with the other
    stages' modules left out (torchtitan builds one such module per stage)."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.layers = nn.ModuleDict({n: model.layers[n] for n in stage_layers(model, stage, stages)})
    if stage != 0:
        view.tok_embeddings = None
    if stage != stages - 1:
        view.norm = None
        view.output = None
    return view


#: which stages rank r of a pipeline of pp ranks holds, with v stages per rank
STAGE_STYLES = {
    "loop": lambda r, pp, v: [r + k * pp for k in range(v)],  # interleaved, looped BFS
    "v": lambda r, pp, v: [r, 2 * pp - 1 - r],  # ZBV, DualPipeV: a V of two stages
}


def pipeline(model, mesh, schedule_class, microbatches: int = 2, scale_grads: bool = False,
             accumulation: int = 1, tp: bool = False, per_rank: int = 1,
             style: str = "loop") -> PipelineStep:
    """Pipeline parallelism on "pp" with ``schedule_class`` and
    ``microbatches`` per step; gradients summed over "dp". Each
    microbatch's loss is its share of the step's mean (the model divides by
    the step's token count), so the microbatches' gradients are summed:
    ``scale_grads=False``, as PyTorch's documentation says for such losses.

    ``per_rank`` stages per rank (interleaved and zero-bubble schedules take
    a list of stages), placed by ``style`` (``STAGE_STYLES``); ``tp`` applies
    the tensor and sequence parallel plan on "tp" inside every stage, whose
    activations are then cut along the sequence between stages."""
    pp = mesh["pp"]
    rank, size = pp.get_local_rank(), pp.size()
    stages = size * per_rank
    held = STAGE_STYLES[style](rank, size, per_rank) if per_rank > 1 else [rank]
    args = model.args
    keep_stages(model, held, stages)
    if tp:
        llama_tp_plan(model, mesh["tp"])
    seq = args.seqlen // mesh["tp"].size() if tp else args.seqlen
    modules = [stage_module(model, s, stages) if per_rank > 1 else model for s in held]

    def schedule(tokens):
        rows = tokens.shape[0] // microbatches
        hidden = torch.empty(rows, seq, args.hidden, dtype=torch.float64, requires_grad=True)
        last = torch.empty(rows, args.seqlen, args.vocab, dtype=torch.float64, requires_grad=True)
        built = [PipelineStage(module, s, stages, torch.device("cpu"),
                               input_args=tokens[:rows] if s == 0 else hidden,
                               output_args=last if s == stages - 1 else hidden,
                               group=pp.get_group())
                 for s, module in zip(held, modules)]
        first = built if per_rank > 1 else built[0]
        return schedule_class(first, microbatches, loss_fn=model.loss, scale_grads=scale_grads)

    if mesh["dp"].size() > 1:
        after = all_reduce_dp
    elif tp:
        after = reduce_tp_partials
    else:
        after = None
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


def pp_tp(model, mesh):
    """1F1B over "pp" with the tensor and sequence parallel plan on "tp" inside
    each stage (torchtitan's 3-D recipe without FSDP): the activations a
    stage sends are its sequence shard."""
    return pipeline(model, mesh, Schedule1F1B, tp=True)


def pp_interleaved_1f1b(model, mesh):
    """Interleaved 1F1B: two stages per rank, looped (rank r holds stages r
    and r + pp), four microbatches."""
    return pipeline(model, mesh, ScheduleInterleaved1F1B, microbatches=4, per_rank=2)


def pp_looped_bfs(model, mesh):
    """Looped BFS: two stages per rank, looped, all forwards of a stage
    before the next."""
    return pipeline(model, mesh, ScheduleLoopedBFS, microbatches=4, per_rank=2)


def pp_interleaved_zero_bubble(model, mesh):
    """Interleaved zero bubble: two looped stages per rank, the backward split
    into the input gradient and the weight gradient, run apart."""
    return pipeline(model, mesh, ScheduleInterleavedZeroBubble, microbatches=4, per_rank=2)


def pp_zbv(model, mesh):
    """ZBV zero bubble: a V of two stages per rank (r and 2 pp - 1 - r), the
    backward split into input and weight gradients."""
    return pipeline(model, mesh, ScheduleZBVZeroBubble, microbatches=4, per_rank=2, style="v")


def clip_grad_norm(model, mesh, max_norm: float) -> None:
    """Clip the gradients by their total norm, as torchtitan does: the norm
    of the DTensor gradients made whole (``full_tensor``), then, with
    pipeline stages, the stages' squared norms summed across "pp" (the fix
    of torchtitan PR 649: each stage holds only its own gradients)."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if mesh["pp"].size() > 1:
        total = funcol.all_reduce(total ** 2, "sum", mesh["pp"]) ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


class ContextParallelRefused(RuntimeError):
    """PyTorch's context parallelism is not traced yet."""


def cp_sdpa(model, mesh):
    """Context parallelism with PyTorch's own
    ``torch.distributed.tensor.experimental.context_parallel``: refused. Its
    ring runs on the CPU through ``backends.torch.cp_shim`` and its ops are
    lowered (the CPU kernel's log-sum-exp and backward, the merge), and the
    batch is cut along the sequence over a "cp" mesh dim (``rank.py``), but
    the claims of the ring's intermediates are not traced yet (a block's
    softmax over part of a row is a piece of no single-device tensor: the
    backend aligns every value with one, docs/torch-backend.md)."""
    raise ContextParallelRefused(
        "context_parallel is not traced yet: its ring runs on the CPU (backends/torch/cp_shim.py) "
        "and the sequence is cut over a cp mesh dim, but the ring's block intermediates (pieces "
        "of no single-device tensor) are not claimed")


def pp_dualpipev(model, mesh):
    """DualPipeV: a V of two stages per rank, the forward of one microbatch
    overlapped with the backward of another in one action."""
    return pipeline(model, mesh, ScheduleDualPipeV, microbatches=4, per_rank=2, style="v")


def tp_sp_loss_parallel(model, mesh):
    """tp_sp with torchtitan's loss parallelism: the logits stay sharded along
    the vocabulary and the cross-entropy runs under DTensor's
    ``loss_parallel()``, entered around forward and backward (the model's
    ``train_context``, as torchtitan's trainer does)."""
    from torch.distributed.tensor.parallel import loss_parallel
    llama_tp_plan(model, mesh["tp"], loss_parallel=True)
    model.train_context = loss_parallel
    return all_reduce_dp


def tp_sp_loss_parallel_partial_as_replicate(model, mesh):
    """tp_sp_loss_parallel with the bug of torchtitan PR 3412: the norms'
    and the output's Partial(sum) gradients relabelled Replicate, never
    reduced (reduce_grads_relabelled)."""
    tp_sp_loss_parallel(model, mesh)
    return reduce_grads_relabelled
