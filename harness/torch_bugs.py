"""Shipped bugs written on the real code paths the torch backend traces: each
is the change that shipped, as a recipe or a clipper passed to
``python -m backends.torch`` (``--recipe harness.torch_bugs:NAME`` or
``--clipper harness.torch_bugs:NAME``); the backend itself never applies
them. docs/real-bugs.md says which bug each one is and what the verifier
reports.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from backends.torch.zoo.moe import reduce_grads, shard_experts
from backends.torch.zoo.recipes import all_reduce_dp, hsdp_mesh, llama_tp_plan, replicate_fp32


def tp_sp_local_token_mean(model, mesh):
    """Megatron-LM issue 7452, finding 3: the per-token loss normalized by the
    rank's own token count instead of the step's (``process_mtp_loss``
    divides by local counts), then summed over data-parallel replicas as a
    per-token loss is: every gradient is dp times too large (with uneven
    valid-token counts, weighted wrongly as well)."""
    llama_tp_plan(model, mesh["tp"])
    model.global_tokens //= mesh["dp"].size()
    return all_reduce_dp


def clip_local_norm(model, mesh, max_norm: float) -> None:
    """Gradient clipping by the norm of the rank's own gradient pieces (the
    local tensors of its DTensor gradients), never reduced across the ranks
    that hold the other pieces: the mistake of torchtitan issue 596 (there
    across pipeline stages), made across tensor-parallel shards."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None],
                                         max_norm, total)


def clip_stage_norm(model, mesh, max_norm: float) -> None:
    """torchtitan issue 596 (fixed by PR 649): under pipeline parallelism each
    stage clips with ``torch.nn.utils.clip_grad_norm_`` over its own
    parameters, so the norm is the stage's, not the model's (the fix sums
    the stages' squared norms over the pipeline group:
    ``backends.torch.recipes:clip_grad_norm``)."""
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                   max_norm)


def _local_square_sum(model) -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    """The rank's parameters with gradients, and the square sum of its local
    gradient pieces (the local tensors of its DTensor gradients), as
    VeOmni's FSDP2 clipper computes it before reducing it."""
    params = [p for p in model.parameters() if p.grad is not None]
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    return params, torch.nn.utils.get_total_norm(local) ** 2


def clip_hsdp_norm_all_dp(model, mesh, max_norm: float) -> None:
    """VeOmni PR 862 (the bug it fixed): under HSDP the ranks' local square
    sums are all-reduced over the whole data-parallel group (VeOmni's
    ``fsdp_group``, replicas and shards), so each shard's square sum is
    counted once per replica: the norm sqrt(replicas) times too large."""
    params, square = _local_square_sum(model)
    total = funcol.all_reduce(square, "sum", mesh["dp"]) ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def clip_hsdp_norm_shard_group(model, mesh, max_norm: float) -> None:
    """VeOmni PR 862's fix: the local square sums all-reduced over the shard
    group only (each shard group holds every gradient once; its replicas
    hold the same pieces again)."""
    params, square = _local_square_sum(model)
    shard_group = hsdp_mesh(mesh)["dp_shard"]
    total = funcol.all_reduce(square, "sum", shard_group) ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def replicate_fp32_factor_ignored(model, mesh):
    """pytorch PR 167178 (the bug it fixed): FSDP2 over a shard group of one
    rank ignored the gradient divide factor. For a float32 reduction FSDP2
    folds a custom factor into the shard group's reduce-scatter
    (``PREMUL_SUM(1 / factor)``) and all-reduces the replicas with SUM; a
    group of one rank skips the reduce-scatter, and before the fix its
    branch copied the buffer undivided. Written as that change: this rank's
    ``foreach_reduce`` gets the factors computed for the recipe's factor
    and runs the size-1 branch without it (the fix, in the installed torch,
    divides there). The recipe is ``backends.torch.recipes:replicate_fp32``
    (dp replicas of one shard, factor dp, a per-rank mean loss): every
    gradient ends dp times too large."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group
    shipped = _fsdp_collectives.foreach_reduce

    def foreach_reduce(*args, **kwargs):
        names = list(inspect.signature(shipped).parameters)
        bound = dict(zip(names, args), **kwargs)
        factor = bound["gradient_divide_factor"]
        if bound["reduce_scatter_group"].size() != 1 or factor is None:
            return shipped(**bound)
        factors = _fsdp_collectives._get_gradient_divide_factors

        def with_factor(rs_group, ar_group, reduce_dtype, device_type="", _factor=None,
                        force_sum_reduction_for_comms=False):
            return factors(rs_group, ar_group, reduce_dtype, device_type, factor,
                           force_sum_reduction_for_comms)

        _fsdp_collectives._get_gradient_divide_factors = with_factor
        try:
            return shipped(**{**bound, "gradient_divide_factor": None})
        finally:
            _fsdp_collectives._get_gradient_divide_factors = factors

    _fsdp_param_group.foreach_reduce = foreach_reduce
    return replicate_fp32(model, mesh)


def ep_mean_experts_undivided(model, mesh):
    """pytorch issue 160285 (expert gradients exactly 2x with EP 2): expert
    parallelism over the data-parallel ranks with a per-rank mean loss; the
    dense gradients are averaged over dp, but the expert gradients, which
    already sum the tokens of every ep rank (the dispatch's backward), are
    not divided by ep: ep times too large. The fix is
    ``backends.torch.moe:ep_mean``."""
    experts = shard_experts(model, mesh)
    return lambda m, mesh: reduce_grads(m, mesh, experts, "avg", 1)


def ep_experts_summed_over_dp(model, mesh):
    """A wrong expert-parallel reduction: the expert gradients all-reduced
    over dp like the dense ones, though each rank holds other experts (its
    shard summed with the other ranks' shards of other experts)."""
    experts = shard_experts(model, mesh)

    def reduce(m, mesh):
        reduce_grads(m, mesh, experts, "sum", 1)
        for name, p in m.named_parameters():
            if name in experts:
                local = p.grad.to_local()
                local.copy_(funcol.all_reduce(local, "sum", mesh["dp"]))

    return reduce
