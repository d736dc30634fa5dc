"""Recipes and gradient clippers written as a user writes them with
PyTorch's own APIs (a third set), for the models of
``tests/outside_apis_causal_models.py`` (``--recipe
tests.outside_apis_causal_recipes:NAME``, mesh dims ``("dp", "tp")``;
``--clipper tests.outside_apis_causal_recipes:NAME``).

Both models return the mean over the rank's own rows or kept tokens, so
data parallelism averages. Functions whose docstring starts with "Bug" are
mistakes that change values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from backends.torch.tracer.pipeline import OwnSchedule

# -- FSDP2 ----------------------------------------------------------------------------------


def _fsdp(model: nn.Module, mesh, reshard: bool | int = True,
          policy: MixedPrecisionPolicy | None = None) -> None:
    policy = policy or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=policy)


def fsdp_float64_policy(model, mesh):
    """``fully_shard`` per block and the root under
    ``MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)``
    on the float64 model (a policy that casts nothing)."""
    _fsdp(model, mesh, policy=MixedPrecisionPolicy(param_dtype=torch.float64,
                                                   reduce_dtype=torch.float64))


def fsdp_reshard_to_2(model, mesh):
    """The blocks with ``reshard_after_forward=2`` (over dp 4: the
    parameters kept gathered over pairs of ranks after forward)."""
    _fsdp(model, mesh, reshard=2)


def _fsdp_accumulate(model, mesh, scale: float, resync: bool) -> OwnSchedule:
    _fsdp(model, mesh)
    micro = 2

    def run(tokens, labels, set_mb):
        rows = tokens.shape[0] // micro
        losses = []
        for i in range(micro):
            set_mb(i)
            model.set_requires_gradient_sync(i == micro - 1 or not resync)
            part = slice(i * rows, (i + 1) * rows)
            loss = model(tokens[part], labels[part]) * scale
            loss.backward()
            losses.append(loss)
        return losses

    return OwnSchedule(run, microbatches=micro)


def fsdp_accumulate_no_sync(model, mesh):
    """FSDP2 over "dp", two microbatches, ``set_requires_gradient_sync(False)``
    on the first (its unsharded gradients kept), ``True`` on the last; each
    microbatch's mean loss times 1/2."""
    return _fsdp_accumulate(model, mesh, 0.5, resync=True)


def fsdp_accumulate_unscaled(model, mesh):
    """Bug: the same without dividing the microbatches' losses by 2."""
    return _fsdp_accumulate(model, mesh, 1.0, resync=True)


# -- activation checkpointing ---------------------------------------------------------------


def ddp_checkpoint_wrapper(model, mesh):
    """Each block wrapped by ``apply_activation_checkpointing`` with
    ``checkpoint_wrapper`` (non-reentrant), then ``DDP`` over "dp"."""
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: m in set(model.blocks))
    return DistributedDataParallel(model, process_group=mesh.get_group("dp"))


def fsdp_checkpointed(model, mesh):
    """The model's own ``torch.utils.checkpoint`` switched on, then FSDP2."""
    model.activation_checkpointing = True
    _fsdp(model, mesh)


def ddp_blocks_only_checkpointed(model, mesh):
    """Bug: the checkpointed blocks wrapped by DDP one by one; the
    embeddings and the final norm keep each replica's gradient."""
    model.activation_checkpointing = True
    group = mesh.get_group("dp")
    model.blocks = nn.ModuleList(DistributedDataParallel(b, process_group=group)
                                 for b in model.blocks)


# -- tensor and sequence parallelism --------------------------------------------------------


def _tp_blocks(model, tp, ln2_planned: bool = True, mlp_seq: bool = False) -> None:
    for block in model.blocks:
        plan = {
            "ln1": SequenceParallel(),
            "attn": PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Shard(1),),
                desired_output_layouts=(Shard(1),)),
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(),
            "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
        if not ln2_planned:
            del plan["ln2"]
        if mlp_seq:  # the GELU on sequence shards: all-to-alls around it
            plan["mlp.up"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1))
            plan["mlp.down"] = RowwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1))
        parallelize_module(block, tp, plan)


def tp_sp_blocks(model, mesh):
    """TP+SP inside the blocks on "tp": sequence-parallel LayerNorms (with
    their biases), attention's input gathered along the sequence by
    ``PrepareModuleInputOutput`` (its output cut back along it),
    ``ColwiseParallel(input_layouts=Shard(1))`` gathering the MLP's input;
    the tied embedding and head replicated, the sequence cut after the
    embedding and gathered before the final norm by hand; gradients
    averaged over dp by DDP-free all-reduces."""
    tp = mesh["tp"]
    _tp_blocks(model, tp)
    _cut_and_gather(model, tp)
    return _average_over_dp


def tp_sp_blocks_mlp_seq(model, mesh):
    """tp_sp_blocks with the MLP's hidden handed between its Linears cut
    along the sequence: ``ColwiseParallel(output_layouts=Shard(1))``,
    ``RowwiseParallel(input_layouts=Shard(1))`` (each redistributes between
    the feature and the sequence cut)."""
    tp = mesh["tp"]
    _tp_blocks(model, tp, mlp_seq=True)
    _cut_and_gather(model, tp)
    return _average_over_dp


def tp_sp_blocks_ln2_unplanned(model, mesh):
    """Bug: tp_sp_blocks with ``ln2`` left out of the plan: it runs on each
    rank's sequence shard as a plain LayerNorm (the values it computes are
    right), but its weight's and bias's gradients are each rank's positions
    only, never summed over "tp"."""
    tp = mesh["tp"]
    _tp_blocks(model, tp, ln2_planned=False)
    _cut_and_gather(model, tp)
    return _average_over_dp


def _cut_and_gather(model, tp) -> None:
    def cut(module, args, output):
        return DTensor.from_local(output, tp, [Replicate()]).redistribute(
            tp, [Shard(1)]).to_local()

    def gather(module, args):
        (x,) = args
        return (DTensor.from_local(x, tp, [Shard(1)]).redistribute(tp, [Replicate()]).to_local(),)

    model.blocks[0].register_forward_pre_hook(
        lambda m, args: (cut(m, None, args[0]),))
    model.ln_f.register_forward_pre_hook(gather)


def _average_over_dp(model, mesh) -> None:
    group = mesh.get_group("dp")
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=p.placements)
                p.grad = g
            g = g.to_local()
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=group)


# -- gradient clipping ----------------------------------------------------------------------


def clip_total_norm(model, mesh, max_norm: float) -> None:
    """``get_total_norm`` of the gradients (DTensors under FSDP2), then
    ``clip_grads_with_norm_`` with it."""
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)


def clip_total_norm_local(model, mesh, max_norm: float) -> None:
    """Bug: the norm of each rank's local shards only (``to_local()``
    before ``get_total_norm``): every rank clips by its own part's norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    total = torch.nn.utils.get_total_norm(local, norm_type=2.0)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)



# -- the recipe's own optimizer and learning-rate schedule ----------------------------------


def _own_adamw(model, warmup_start: float = 1.0, cls=torch.optim.AdamW, **adamw) -> None:
    """The rank steps with its own ``torch.optim.AdamW`` (the backend's
    hyperparameters: lr 1e-3, weight decay 0.1; or ``cls`` with them) built
    with ``adamw``, then steps a ``LinearLR`` warmup starting at
    ``warmup_start`` times the rate."""
    def own(name: str):
        if name != "adamw":
            raise ValueError(f"this recipe's own optimizer is AdamW, not {name}")
        opt = cls(model.parameters(), lr=0.001, weight_decay=0.1, **adamw)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=warmup_start, total_iters=10)
        opt.step()
        sched.step()
        return opt
    model.own_optimizer = own


def fsdp_adamw_for_loop(model, mesh):
    """FSDP2 with ``AdamW(foreach=False)`` on the sharded parameters and a
    ``LinearLR`` schedule stepped after it (full rate at the first step)."""
    _fsdp(model, mesh)
    _own_adamw(model, foreach=False)


def fsdp_adamw_fused(model, mesh):
    """FSDP2 with ``AdamW(fused=True)``."""
    _fsdp(model, mesh)
    _own_adamw(model, fused=True)


def fsdp_adam_fused_l2(model, mesh):
    """Bug: FSDP2 with ``Adam(fused=True, weight_decay=0.1)``: the decay
    added to the gradient (L2), not AdamW's decay of the weight."""
    _fsdp(model, mesh)
    _own_adamw(model, cls=torch.optim.Adam, fused=True)


def replicated_adamw_fused_unreduced(model, mesh):
    """Bug: the model replicated on every rank with no wrapper: each rank
    steps ``AdamW(fused=True)`` with its own batch's gradient, never reduced."""
    _own_adamw(model, fused=True)


def fsdp_adamw_warmup_half(model, mesh):
    """Bug: a ``LinearLR(start_factor=0.5)`` warmup the single-device step
    does not have: the first step runs at half the rate."""
    _fsdp(model, mesh)
    _own_adamw(model, warmup_start=0.5, foreach=False)


# -- distribute_module by hand on a 2-D mesh of the recipe's own --------------------------


def _ff_by_hand(model, mesh, reduce_output: bool = True):
    """Each block's feed-forward ``nn.Sequential(Linear, GELU, Linear)``
    under ``distribute_module`` on "tp": the first Linear cut by output
    features, the second by input features (its bias replicated); the input
    made a replicated DTensor, the output's partial sum all-reduced and
    handed back local. The mesh is the recipe's own
    ``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))``."""
    own = init_device_mesh("cpu", (mesh["dp"].size(), mesh["tp"].size()),
                           mesh_dim_names=("dp", "tp"))
    tp = own["tp"]

    def partition(name: str, module: nn.Module, device_mesh) -> None:
        cuts = {"0": {"weight": Shard(0), "bias": Shard(0)},
                "2": {"weight": Shard(1), "bias": Replicate()}}.get(name, {})
        for pname, placement in cuts.items():
            param = getattr(module, pname)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param.data, device_mesh, [placement])))

    def inputs(module, args, device_mesh):
        return tuple(DTensor.from_local(a, device_mesh, [Replicate()]) for a in args)

    def outputs(module, out, device_mesh):
        if reduce_output:
            out = out.redistribute(device_mesh, [Replicate()])
        return out.to_local()

    for block in model.blocks:
        distribute_module(block.ff, tp, partition, inputs, outputs)

    def average(model, mesh):
        group = own.get_group("dp")
        for p in model.parameters():
            g = p.grad
            dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g,
                            op=dist.ReduceOp.AVG, group=group)
    return average


def tp_ff_distribute_module(model, mesh):
    """The feed-forwards cut over "tp" by ``distribute_module`` (above);
    gradients averaged over "dp"."""
    return _ff_by_hand(model, mesh)


def tp_ff_partial_output(model, mesh):
    """Bug: the same with the output function handing back each rank's
    partial sum (``to_local()`` of the ``Partial`` DTensor, never reduced)."""
    return _ff_by_hand(model, mesh, reduce_output=False)
