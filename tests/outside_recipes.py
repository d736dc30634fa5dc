"""Recipes written as users write them with PyTorch's own parallel APIs,
independently of ``backends/torch``'s recipes: loaded as
``--recipe tests.outside_recipes:NAME`` (``recipe(model, mesh)``, mesh
dims ``("pp", "dp", "tp")``).

Data-parallel averaging (DDP, AVG, FSDP2's default divide factor) is right
for a loss averaged over the rank's own tokens (the ``*_mean`` models);
summing is right for a loss that is the rank's share of the step's mean
(``mlp``, ``gpt2``, ``llama``). Functions whose docstring starts with
"Bug" are mistakes that change values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel


def _blocks(model: nn.Module) -> list[nn.Module]:
    for name in ("h", "blocks", "layers"):
        found = getattr(model, name, None)
        if found is not None:
            return list(found.values()) if hasattr(found, "values") else list(found)
    if isinstance(getattr(model, "encoder", None), nn.TransformerEncoder):
        return list(model.encoder.layers)
    return []


# -- DistributedDataParallel -------------------------------------------------------------

def ddp(model, mesh):
    """``model = DDP(model)`` over the data-parallel group: gradients
    averaged (its C++ reducer divides by the group size)."""
    return DistributedDataParallel(model, process_group=mesh.get_group("dp"))


def ddp_bucket_view(model, mesh):
    """DDP with small buckets whose views are the gradients
    (``gradient_as_bucket_view``) and a static graph."""
    return DistributedDataParallel(model, process_group=mesh["dp"].get_group(),
                                   gradient_as_bucket_view=True, static_graph=True,
                                   bucket_cap_mb=0.002)


def ddp_allreduce_hook(model, mesh):
    """DDP with PyTorch's own ``allreduce_hook`` (divide, then all-reduce)."""
    group = mesh["dp"].get_group()
    wrapped = DistributedDataParallel(model, process_group=group)
    wrapped.register_comm_hook(group, default_hooks.allreduce_hook)
    return wrapped


def _divide_then_allreduce(group, bucket):
    """Bug: a comm hook that divides the bucket by the group size and then
    calls ``allreduce_hook``, which divides again."""
    bucket.buffer().div_(dist.get_world_size(group))
    return default_hooks.allreduce_hook(group, bucket)


def ddp_hook_divides_twice(model, mesh):
    """Bug: DDP with a comm hook that divides twice (gradients 1/dp too small)."""
    group = mesh["dp"].get_group()
    wrapped = DistributedDataParallel(model, process_group=group)
    wrapped.register_comm_hook(group, _divide_then_allreduce)
    return wrapped


def ddp_wrong_group(model, mesh):
    """Bug: DDP over the tensor-parallel group instead of the data-parallel
    one (every rank replicated; the dp replicas' gradients never meet)."""
    return DistributedDataParallel(model, process_group=mesh["tp"].get_group())


def ddp_sum_hook(model, mesh):
    """DDP for a loss that is the rank's share of the step's mean: a comm
    hook that sums the bucket over the group without dividing."""
    group = mesh["dp"].get_group()
    wrapped = DistributedDataParallel(model, process_group=group)

    def summed(state, bucket):
        work = dist.all_reduce(bucket.buffer(), group=state, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    wrapped.register_comm_hook(group, summed)
    return wrapped


def replicate_dp(model, mesh):
    """``torch.distributed._composable.replicate`` over "dp" (DDP applied in
    place: the module keeps its class and runs the reducer's hooks)."""
    from torch.distributed._composable import replicate
    replicate(model, device_mesh=mesh["dp"])
    return None


# -- collectives by hand -----------------------------------------------------------------

def _reduce_dp(model, mesh, op: str, partials: bool = True) -> None:
    """Every gradient reduced over "dp" with the functional ``all_reduce``
    (``op`` "sum" or "avg"); a DTensor gradient's partial sums first
    reduced to the parameter's placements (``partials``), then its local
    tensor reduced in place."""
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if partials and any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=p.placements)
            g.to_local().copy_(funcol.all_reduce(g.to_local(), op, mesh["dp"]))
            p.grad = g
        else:
            p.grad = funcol.all_reduce(g, op, mesh["dp"])


def funcol_avg(model, mesh):
    """Every gradient averaged with the functional ``all_reduce(..., "avg")``."""
    return lambda model, mesh: _reduce_dp(model, mesh, "avg")


def flat_bucket_by_hand(model, mesh):
    """One flat bucket by hand: ``torch.cat`` of the flattened gradients,
    ``dist.all_reduce`` on the dp group, divided by dp, copied back."""
    def after(model, mesh):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=mesh.get_group("dp"))
        flat /= mesh["dp"].size()
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()
    return after


def zero2_by_hand(model, mesh):
    """ZeRO-2 style by hand: each gradient reduce-scattered over dp (SUM)
    along dim 0 when dp divides it, the shards all-gathered back; others
    all-reduced. The loss is a share of the step's mean: no division."""
    def after(model, mesh):
        group = mesh.get_group("dp")
        n = mesh["dp"].size()
        for p in model.parameters():
            g = p.grad
            if g is None:
                continue
            if g.dim() and g.shape[0] % n == 0:
                shard = g.new_empty((g.shape[0] // n, *g.shape[1:]))
                dist.reduce_scatter_tensor(shard, g.contiguous(), group=group)
                whole = g.new_empty(g.shape)
                dist.all_gather_into_tensor(whole, shard, group=group)
                p.grad = whole
            else:
                dist.all_reduce(g, group=group)
    return after


def all_reduce_wrong_dim(model, mesh):
    """Bug: the data-parallel sum run over the "tp" dim of the mesh."""
    def after(model, mesh):
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=mesh.get_group("tp"))
    return after


# -- FSDP2 options -----------------------------------------------------------------------

def fsdp_keep_unsharded(model, mesh):
    """FSDP2 on every block and the root, parameters kept gathered after the
    forward (``reshard_after_forward=False``), the default divide factor."""
    for block in _blocks(model):
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    return None


def fsdp_every_linear(model, mesh):
    """FSDP2 on every ``nn.Linear`` then the root, float64 mixed precision
    (``MixedPrecisionPolicy``), reshard after backward set explicitly."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    model.set_reshard_after_backward(True)
    return None


def fsdp_root_only(model, mesh):
    """FSDP2 on the root only (one parameter group), the default factor."""
    fully_shard(model, mesh=mesh["dp"])
    return None


def fsdp_root_only_sum(model, mesh):
    """Bug for a per-rank mean loss: FSDP2 on the root with divide factor 1
    (the replicas' gradients summed where they must be averaged)."""
    fully_shard(model, mesh=mesh["dp"])
    model.set_gradient_divide_factor(1.0)
    return None


# -- tensor parallelism ------------------------------------------------------------------

def tp_wildcard(model, mesh):
    """Megatron's MLP split written as one wildcard plan on the root
    (``"blocks.*.gate"``), biases kept; gradients averaged over dp."""
    plan = {"blocks.*.gate": ColwiseParallel(), "blocks.*.up": ColwiseParallel(),
            "blocks.*.down": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    return funcol_avg(model, mesh)


def tp_own_mesh(model, mesh):
    """A 2-D mesh of the user's own (``init_device_mesh`` with dims
    "data", "model"), the MLP split on "model", gradients summed over
    "data" by hand with ``dist.all_reduce`` and the partial DTensor
    gradients redistributed."""
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    own = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data", "model"))
    for block in _blocks(model):
        parallelize_module(block, own["model"], {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                                 "down": RowwiseParallel()})

    def after(model, mesh):
        for p in model.parameters():
            g = p.grad
            if g is None:
                continue
            if hasattr(g, "placements") and any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=p.placements)
            local = g.to_local() if hasattr(g, "to_local") else g
            dist.all_reduce(local, group=own.get_group("data"))
            p.grad = g
    return after


def tp_rowwise_left_partial(model, mesh):
    """Bug: the MLP's ``down`` row-parallel with its output left ``Partial``
    (``use_local_output=True`` and no reduction): each tp rank carries its
    partial sum on as if whole."""
    from torch.distributed.tensor import Partial
    for block in _blocks(model):
        parallelize_module(block, mesh["tp"], {
            "gate": ColwiseParallel(), "up": ColwiseParallel(),
            "down": RowwiseParallel(output_layouts=Partial())})
    return funcol_avg(model, mesh)


def gpt2_tp_sp_plan(model, tp_mesh) -> None:
    """Megatron's TP with sequence parallelism for GPT-2 with separate q, k,
    v projections (``gpt2_split``): the residual stream cut along the
    sequence (``Shard(1)``) between blocks, ``nn.LayerNorm`` under
    ``SequenceParallel``, attention and MLP inputs gathered
    (``PrepareModuleInput``), q/k/v and ``c_fc`` column-parallel, the
    output projections row-parallel back to ``Shard(1)``; the embeddings'
    sum cut along the sequence after the dropout (``PrepareModuleOutput``);
    the tied ``lm_head`` left whole, its input gathered."""
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(model, tp_mesh, {
        "drop": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                    use_local_output=True),
        "ln_f": SequenceParallel(),
        "lm_head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
    })
    for block in model.h:
        parallelize_module(block, tp_mesh, {
            "ln_1": SequenceParallel(),
            "attn": gather,
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(),
            "mlp": gather,
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        })


def gpt2_tp_sp(model, mesh):
    """gpt2_tp_sp_plan on "tp", gradients summed over "dp" (the loss is a
    share of the step's mean)."""
    gpt2_tp_sp_plan(model, mesh["tp"])
    return lambda model, mesh: _reduce_dp(model, mesh, "sum")


def gpt2_tp_sp_norm_grads_local(model, mesh):
    """Bug: gpt2_tp_sp whose gradient step never reduces the partial
    gradients over "tp": the SP LayerNorms' weights and biases keep each
    rank's sequence shard's gradient."""
    gpt2_tp_sp_plan(model, mesh["tp"])
    return lambda model, mesh: _reduce_dp(model, mesh, "sum", partials=False)


def _reduce_tp_partials(model, mesh) -> None:
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=p.placements)


def gpt2_fsdp_tp_sp(model, mesh):
    """gpt2_tp_sp_plan on "tp" and FSDP2 over "dp" on each block and the
    root (divide factor 1: the loss is a share of the step's mean); the
    partial gradients reduced to their placements."""
    gpt2_tp_sp_plan(model, mesh["tp"])
    for block in model.h:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for module in (model, *model.h):
        module.set_gradient_divide_factor(1.0)
    return _reduce_tp_partials


def tp_explicit_layouts(model, mesh):
    """The MLP split with every layout spelled out: ``gate``/``up``
    ``ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
    use_local_output=False)`` (DTensor activations between them),
    ``down`` ``RowwiseParallel(input_layouts=Shard(-1),
    output_layouts=Replicate())``; gradients summed over dp by hand."""
    col = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    row = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate(), use_local_output=True)
    for block in _blocks(model):
        parallelize_module(block, mesh["tp"], {"gate": col, "up": col, "down": row})
    return lambda model, mesh: _reduce_dp(model, mesh, "sum")


def gqa_tp_loss_parallel(model, mesh):
    """TP on the grouped-query decoder (``gqa``: q/k/v column-parallel,
    ``o_proj`` and ``down`` row-parallel, ``gate``/``up`` column-parallel)
    with the untied ``head`` column-parallel, its logits left sharded along
    the vocabulary (``use_local_output=False``) and the cross-entropy under
    DTensor's ``loss_parallel()``; gradients summed over dp."""
    from torch.distributed.tensor.parallel import loss_parallel
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
            "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], {"head": ColwiseParallel(use_local_output=False)})
    model.train_context = loss_parallel
    return lambda model, mesh: _reduce_dp(model, mesh, "sum")


def _from_local_by_hand(model, mesh, op: str) -> None:
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=p.placements)
            local = funcol.all_reduce(g.to_local(), op, mesh["dp"])
            p.grad = DTensor.from_local(local, g.device_mesh, g.placements)
        else:
            p.grad = funcol.all_reduce(g, op, mesh["dp"])


def tp_from_local(model, mesh):
    """The MLP split on "tp"; each DTensor gradient's local tensor averaged
    over dp with ``funcol.all_reduce`` and put back with
    ``DTensor.from_local`` (left unwaited: the read waits)."""
    for block in _blocks(model):
        parallelize_module(block, mesh["tp"], {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
    return lambda model, mesh: _from_local_by_hand(model, mesh, "avg")


def tp_from_local_summed(model, mesh):
    """Bug for a per-rank mean loss: tp_from_local summing over dp."""
    tp_from_local(model, mesh)
    return lambda model, mesh: _from_local_by_hand(model, mesh, "sum")
