"""Recipes and gradient clippers written as a user writes them with
PyTorch's own APIs, for the models of ``tests/outside_apis_models.py``
(``--recipe tests.outside_apis_recipes:NAME``, mesh dims ``("pp", "dp",
"tp")``; ``--clipper tests.outside_apis_recipes:NAME``).

The classifiers and ``encoder_tagger`` return the mean over the rank's own
rows or tokens, so data parallelism averages; ``staged_tagger`` returns
the rank's share of the step's mean, so its microbatches' and replicas'
gradients are summed. Functions whose docstring starts with "Bug" are
mistakes that change values.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from backends.torch.tracer.pipeline import OwnSchedule, PipelineStep

# -- FSDP2 ----------------------------------------------------------------------------------


def _fsdp(model: nn.Module, mesh, reshard: bool, root: bool = True,
          float32: bool = True) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32) \
        if float32 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard, mp_policy=policy)
    if root:
        fully_shard(model, mesh=mesh["dp"], mp_policy=policy)


def fsdp_blocks_kept(model, mesh):
    """``fully_shard`` per block with ``reshard_after_forward=False``, then
    the root; float32 parameters and reductions; the default divide factor
    (an average over dp, right for a per-rank mean)."""
    _fsdp(model, mesh, reshard=False)


def fsdp_blocks_resharded(model, mesh):
    """The same with ``reshard_after_forward=True``."""
    _fsdp(model, mesh, reshard=True)


def fsdp_blocks_no_root(model, mesh):
    """Bug: ``fully_shard`` on the blocks only, the root forgotten: the
    embeddings, the pooler and the head keep each replica's gradient (the
    default policy: under a float32 one the root's float64 norm would meet
    float32 activations and raise, in a real run too)."""
    _fsdp(model, mesh, reshard=True, root=False, float32=False)


def fsdp_blocks_sum(model, mesh):
    """Bug: divide factor 1 (a sum over dp) for a per-rank mean loss."""
    _fsdp(model, mesh, reshard=False)
    for module in (model, *model.blocks):
        module.set_gradient_divide_factor(1.0)


def _scaled_loss(model, scale: float) -> OwnSchedule:
    """One microbatch, the rank's loss times ``scale`` before ``backward``."""
    def run(tokens, labels, set_mb):
        set_mb(0)
        loss = model(tokens, labels) * scale
        loss.backward()
        return [loss]
    return OwnSchedule(run)


def fsdp_blocks_sum_share(model, mesh):
    """Divide factor 1 (FSDP2 reduce-scatters float32 with
    ``ReduceOp.PREMUL_SUM(1.0)``) on each rank's mean loss divided by the dp
    size before ``backward``: the rank's share of the step's mean, summed."""
    _fsdp(model, mesh, reshard=False)
    for module in (model, *model.blocks):
        module.set_gradient_divide_factor(1.0)
    return _scaled_loss(model, 1.0 / mesh["dp"].size())


def fsdp_blocks_factor4(model, mesh):
    """Bug: divide factor 4 (``PREMUL_SUM(1 / 4)``) on the per-rank mean over
    dp 2: half the average."""
    _fsdp(model, mesh, reshard=False)
    for module in (model, *model.blocks):
        module.set_gradient_divide_factor(4.0)


# -- DDP with gradient accumulation ---------------------------------------------------------


def _accumulate(model, mesh, scale: float) -> OwnSchedule:
    ddp = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
    micro = 2

    def run(tokens, labels, set_mb):
        rows = tokens.shape[0] // micro
        losses = []
        for i in range(micro):
            set_mb(i)
            part = slice(i * rows, (i + 1) * rows)
            sync = contextlib.nullcontext() if i == micro - 1 else ddp.no_sync()
            with sync:
                loss = ddp(tokens[part], labels[part]) * scale
                loss.backward()
            losses.append(loss)
        return losses

    return OwnSchedule(run, microbatches=micro)


def ddp_no_sync_accumulate(model, mesh):
    """DDP over "dp", two microbatches, the first under ``no_sync()``; each
    microbatch's mean loss divided by 2 before ``backward``."""
    return _accumulate(model, mesh, 0.5)


def ddp_no_sync_unscaled(model, mesh):
    """Bug: the same without dividing the microbatches' losses by 2."""
    return _accumulate(model, mesh, 1.0)


# -- tensor and sequence parallelism with loss_parallel -------------------------------------


def _tp_plan(model, tp, dtensor_heads: bool = True) -> None:
    parallelize_module(model, tp, {
        # the embedding stays whole; its output cut along the sequence
        "embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                use_local_output=False),
    })
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in model.blocks:
        parallelize_module(block, tp, {
            "norm1": SequenceParallel(),
            "attn": gather,
            "attn.q": ColwiseParallel(use_local_output=not dtensor_heads),
            "attn.k": ColwiseParallel(use_local_output=not dtensor_heads),
            "attn.v": ColwiseParallel(use_local_output=not dtensor_heads),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(),
            "mlp": gather,
            "mlp.fc1": ColwiseParallel(use_local_output=False),  # a DTensor into the GELU
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        })
    model.train_context = loss_parallel


def _average_over_dp(model, mesh, reduce_partials: bool = True) -> None:
    group = mesh.get_group("dp")
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor):
            if reduce_partials and any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=p.placements)
                p.grad = g
            local = g.to_local()
        else:
            local = g
        dist.all_reduce(local, op=dist.ReduceOp.AVG, group=group)


def tp_sp_loss_parallel(model, mesh):
    """TP+SP on "tp" (q/k/v ``ColwiseParallel(use_local_output=False)``,
    ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering the
    sequence before attention and the MLP), the head's logits sharded along
    the vocabulary under ``loss_parallel()``; gradients averaged over dp."""
    _tp_plan(model, mesh["tp"])
    return _average_over_dp


def tp_sp_local_heads(model, mesh):
    """tp_sp_loss_parallel with q/k/v's outputs local tensors (the heads
    counted from the local width), the MLP's hidden a DTensor."""
    _tp_plan(model, mesh["tp"], dtensor_heads=False)
    return _average_over_dp


def tp_sp_partials_kept(model, mesh):
    """Bug: tp_sp_local_heads with the partial gradients of the
    sequence-parallel norms never reduced over "tp" before the dp average."""
    _tp_plan(model, mesh["tp"], dtensor_heads=False)
    return lambda model, mesh: _average_over_dp(model, mesh, reduce_partials=False)


def tp_sp_summed_over_dp(model, mesh):
    """Bug: tp_sp_local_heads with the per-rank mean's gradients summed over
    dp instead of averaged."""
    _tp_plan(model, mesh["tp"], dtensor_heads=False)

    def after(model, mesh):
        _average_over_dp(model, mesh)
        for p in model.parameters():
            g = p.grad
            (g.to_local() if isinstance(g, DTensor) else g).mul_(mesh["dp"].size())
    return after


# -- pipelining -----------------------------------------------------------------------------


class Stage(nn.Module):
    """One pipeline stage of a ``staged_tagger``: its layers, the embedding
    on the first stage, the norm and head on the last (the model's own
    modules, shared)."""

    def __init__(self, model, names: list[str], first: bool, last: bool):
        super().__init__()
        self.tok = model.tok if first else None
        self.layers = nn.ModuleDict({n: model.layers[n] for n in names})
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _pipeline(model, mesh, schedule_class, per_rank: int = 1, scale_grads: bool = False,
              dp_sum: bool = True) -> PipelineStep:
    pp = mesh["pp"]
    rank, size = pp.get_local_rank(), pp.size()
    stages = size * per_rank
    names = list(model.layers.keys())
    per_stage = len(names) // stages
    held = [rank + k * size for k in range(per_rank)]
    kept = {names[i] for s in held for i in range(s * per_stage, (s + 1) * per_stage)}
    modules = [Stage(model, names[s * per_stage:(s + 1) * per_stage], s == 0, s == stages - 1)
               for s in held]
    for n in names:
        if n not in kept:
            del model.layers[n]
    if 0 not in held:
        model.tok = None
    if stages - 1 not in held:
        model.norm = model.head = None
    dtype = next(p.dtype for p in model.parameters())
    micro = 2 * size if per_rank > 1 else 2

    def schedule(tokens):
        rows = tokens.shape[0] // micro
        # a stage's static input must require grad, or it sends no gradient back
        hidden = torch.empty(rows, tokens.shape[1], model.hidden, dtype=dtype, requires_grad=True)
        logits = torch.empty(rows, tokens.shape[1], model.vocab_size, dtype=dtype,
                             requires_grad=True)
        built = [PipelineStage(m, s, stages, torch.device("cpu"),
                               input_args=tokens[:rows] if s == 0 else hidden,
                               output_args=logits if s == stages - 1 else hidden,
                               group=pp.get_group())
                 for s, m in zip(held, modules)]
        return schedule_class(built if per_rank > 1 else built[0], micro, loss_fn=model.loss,
                              scale_grads=scale_grads)

    def sum_over_dp(model, mesh):
        if mesh["dp"].size() > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=mesh.get_group("dp"))

    return PipelineStep(schedule, 1, sum_over_dp if dp_sum else None)


def pp_gpipe(model, mesh):
    """Two stages on "pp", ``ScheduleGPipe`` over two microbatches, their
    gradients summed (``scale_grads=False``: each loss is its share of the
    step's mean), summed over dp."""
    return _pipeline(model, mesh, ScheduleGPipe)


def pp_1f1b(model, mesh):
    """The same with ``Schedule1F1B``."""
    return _pipeline(model, mesh, Schedule1F1B)


def pp_interleaved(model, mesh):
    """``ScheduleInterleaved1F1B`` with two stages per rank (``--layers 4``)."""
    return _pipeline(model, mesh, ScheduleInterleaved1F1B, per_rank=2)


def pp_gpipe_scaled(model, mesh):
    """Bug: ``scale_grads=True`` on a loss already shared out over the step:
    the gradients divided by the microbatch count once more."""
    return _pipeline(model, mesh, ScheduleGPipe, scale_grads=True)


def pp_1f1b_no_dp_sum(model, mesh):
    """Bug: 1F1B over "pp" with dp > 1, the replicas' gradients never summed."""
    return _pipeline(model, mesh, Schedule1F1B, dp_sum=False)


# -- gradient clipping ----------------------------------------------------------------------


def clip_foreach(model, mesh, max_norm: float) -> None:
    """``clip_grad_norm_(foreach=True)`` on the DTensor gradients as they are."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)


def _trainer_norm(model, mesh, counts) -> torch.Tensor:
    """Sum of squares of the local gradients the rank counts, all-reduced
    over "tp", rooted."""
    tp_rank = mesh["tp"].get_local_rank()
    total = torch.zeros((), dtype=next(model.parameters()).dtype)
    for p in model.parameters():
        g = p.grad
        if counts(g, tp_rank):
            local = g.to_local() if isinstance(g, DTensor) else g
            total = total + local.pow(2).sum()
    dist.all_reduce(total, group=mesh.get_group("tp"))
    return total.sqrt()


def _sharded(g) -> bool:
    return isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements)


def _scale(model, norm: torch.Tensor, max_norm: float) -> None:
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in model.parameters():
        g = p.grad
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)


def clip_trainer(model, mesh, max_norm: float) -> None:
    """A trainer's norm: sharded gradients counted on every tp rank,
    replicated ones (plain or ``Replicate``) on tp rank 0 only."""
    norm = _trainer_norm(model, mesh, lambda g, r: _sharded(g) or r == 0)
    _scale(model, norm, max_norm)


def clip_trainer_counted_everywhere(model, mesh, max_norm: float) -> None:
    """Bug: the rank predicate counts the replicated gradients on every tp rank."""
    norm = _trainer_norm(model, mesh, lambda g, r: True)
    _scale(model, norm, max_norm)
