"""Gradient clippers written the way trainers write them for tensor
parallelism: each rank's square sums of its local gradient pieces, the
pieces every tp rank holds alike counted once (on tp rank 0, Megatron's
``param_is_not_tensor_parallel_duplicate``), all-reduced over the group
that holds the other pieces, then the root. Called as
``clipper(model, mesh, max_norm)`` (``--clipper tests.norm_clippers:NAME``).
The mistakes count what every tp rank holds once per rank (NeMo-RL PR
3788) or leave out the reduction."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor


def _params(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.grad is not None]


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def _duplicate(g: torch.Tensor) -> bool:
    """Every tensor-parallel rank holds this gradient whole (not a shard of it)."""
    if not isinstance(g, DTensor):
        return True
    names = g.device_mesh.mesh_dim_names or ()
    return all(not pl.is_shard() for name, pl in zip(names, g.placements) if name == "tp")


def _scale(params: list[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Each local gradient times min(1, max_norm / (total + 1e-6))."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        _local(p.grad).mul_(coef)


def _over_shards(total: torch.Tensor, model, mesh) -> torch.Tensor:
    """The square sum all-reduced over tp, then over dp when FSDP shards
    the gradients over dp too (each dp rank holds other pieces)."""
    total = funcol.all_reduce(total, "sum", mesh["tp"])
    if _fsdp(model):
        total = funcol.all_reduce(total, "sum", mesh["dp"])
    return total


def _fsdp(model) -> bool:
    """FSDP shards the gradients over dp (each dp rank holds other pieces)."""
    return any(isinstance(p.grad, DTensor) and "dp" in (p.grad.device_mesh.mesh_dim_names or ())
               for p in _params(model))


def _first(mesh) -> bool:
    return mesh["tp"].get_local_rank() == 0


def clip_tp_rank0(model, mesh, max_norm: float) -> None:
    """Megatron's count: sharded gradients on every rank, duplicated ones on
    tp rank 0 only; the squares summed, all-reduced over tp, rooted."""
    params = _params(model)
    squares = []
    for p in params:
        if not _duplicate(p.grad) or _first(mesh):
            squares.append(torch.linalg.vector_norm(_local(p.grad)) ** 2)
    total = torch.stack(squares).sum()
    _scale(params, max_norm, _over_shards(total, model, mesh) ** 0.5)


def clip_tp_two_reduces(model, mesh, max_norm: float) -> None:
    """The same count written with two all-reduces: the sharded gradients'
    square sum over tp, the duplicated ones' (tp rank 0's, zero elsewhere)
    over tp, added."""
    params = _params(model)
    sharded = sum((_local(p.grad) ** 2).sum() for p in params if not _duplicate(p.grad))
    duplicated = sum((_local(p.grad) ** 2).sum() for p in params if _duplicate(p.grad))
    if not _first(mesh):
        duplicated = torch.zeros_like(duplicated)
    sharded = _over_shards(sharded, model, mesh)
    duplicated = _over_shards(duplicated, model, mesh)
    _scale(params, max_norm, (sharded + duplicated).sqrt())


def clip_tp_accumulated(model, mesh, max_norm: float) -> None:
    """An accumulator started from a zero tensor plus each counted squared
    norm (tp rank 0 alone counts the duplicated ones), reduced in place with
    ``dist.all_reduce`` over the tp group."""
    params = _params(model)
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if _first(mesh) or not _duplicate(p.grad):
            total = total + _local(p.grad).norm(2) ** 2
    dist.all_reduce(total, group=mesh["tp"].get_group())
    if _fsdp(model):
        dist.all_reduce(total, group=mesh["dp"].get_group())
    _scale(params, max_norm, total.sqrt())


def clip_tp_counted_per_rank(model, mesh, max_norm: float) -> None:
    """NeMo-RL PR 3788 (the bug it fixed): every rank counts every local
    gradient, so the duplicated ones are counted once per tp rank."""
    params = _params(model)
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        total = total + _local(p.grad).norm(2) ** 2
    dist.all_reduce(total, group=mesh["tp"].get_group())
    if _fsdp(model):
        dist.all_reduce(total, group=mesh["dp"].get_group())
    _scale(params, max_norm, total.sqrt())


def clip_tp_not_reduced(model, mesh, max_norm: float) -> None:
    """A mistake: the Megatron count without the all-reduce (each rank's
    norm is its own pieces')."""
    params = _params(model)
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if _first(mesh) or not _duplicate(p.grad):
            total = total + _local(p.grad).norm(2) ** 2
    _scale(params, max_norm, total.sqrt())


def clip_stacked_norms_flat_group(model, mesh, max_norm: float) -> None:
    """The counted norms stacked, squared and summed, all-reduced once over
    the flattened (dp, tp) group when FSDP shards over dp too (else over
    tp)."""
    params = _params(model)
    counted = [p for p in params if not _duplicate(p.grad) or _first(mesh)]
    squares = (torch.stack([torch.linalg.vector_norm(_local(p.grad)) for p in counted]) ** 2).sum()
    group = mesh["dp", "tp"]._flatten() if _fsdp(model) else mesh["tp"]
    _scale(params, max_norm, funcol.all_reduce(squares, "sum", group).sqrt())


def clip_pow_sum_flat_group_unsharded(model, mesh, max_norm: float) -> None:
    """A mistake: ``g.pow(2).sum()`` counted as above but all-reduced over the
    flattened (dp, tp) group although the dp replicas hold the same
    gradients (no FSDP): every square counted dp times."""
    params = _params(model)
    total = sum(_local(p.grad).pow(2).sum() for p in params
                if not _duplicate(p.grad) or _first(mesh))
    total = funcol.all_reduce(total, "sum", mesh["dp", "tp"]._flatten())
    _scale(params, max_norm, total.sqrt())


def clip_tp_item(model, mesh, max_norm: float) -> None:
    """``clip_tp_rank0``'s count, the norm read into Python (``.item()``) and
    rooted and divided as Python floats, the coefficient bounded by a tensor
    clamp: no branch on the number (``tracer.numbers``)."""
    params = _params(model)
    squares = [torch.linalg.vector_norm(_local(p.grad)) ** 2 for p in params
               if not _duplicate(p.grad) or _first(mesh)]
    total = _over_shards(torch.stack(squares).sum(), model, mesh).item() ** 0.5
    coef = torch.clamp(torch.as_tensor(max_norm / (total + 1e-6)), max=1.0)
    for p in params:
        _local(p.grad).mul_(coef)


def clip_tp_item_branch(model, mesh, max_norm: float) -> None:
    """The same norm, then Megatron's ``if clip_coeff < 1.0:`` on the Python
    number: a branch on a value (refused)."""
    params = _params(model)
    squares = [torch.linalg.vector_norm(_local(p.grad)) ** 2 for p in params
               if not _duplicate(p.grad) or _first(mesh)]
    total = _over_shards(torch.stack(squares).sum(), model, mesh).item() ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in params:
            _local(p.grad).mul_(coef)


def clip_tp_item_not_reduced(model, mesh, max_norm: float) -> None:
    """``clip_tp_item`` with the square sum never all-reduced (a rank's own
    norm): wrong."""
    params = _params(model)
    squares = [torch.linalg.vector_norm(_local(p.grad)) ** 2 for p in params
               if not _duplicate(p.grad) or _first(mesh)]
    total = torch.stack(squares).sum().item() ** 0.5
    coef = torch.clamp(torch.as_tensor(max_norm / (total + 1e-6)), max=1.0)
    for p in params:
        _local(p.grad).mul_(coef)


def megatron_norm_over_dp(model, mesh, max_norm: float) -> None:
    """A mistake in Megatron's own clipping: ``get_grad_norm_fp32`` reduced
    over the data-parallel group instead of the model-parallel one (a
    tensor-parallel rank's norm is its own pieces'), then
    ``clip_grad_by_total_norm_fp32``. Like Megatron's, it runs on one device
    too (``one_device``), where both groups are of one rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
        get_grad_norm_fp32,
    )
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
    params = _params(model)
    counted = [p.grad for p in params
               if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    total = get_grad_norm_fp32(counted, norm_type=2,
                               grad_stats_parallel_group=ps.get_data_parallel_group())
    clip_grad_by_total_norm_fp32(params, max_norm, total)


megatron_norm_over_dp.one_device = True  # type: ignore[attr-defined]


def megatron_large_branch_other_side(model, mesh, max_norm: float) -> None:
    """Megatron's clipping on the ranks, and on one device torch's
    ``clip_grad_norm_`` (no ``one_device``): the single-device step reads no
    number and branches on none, so the ranks' branch is refused."""
    from backends.torch.zoo.megatron import clip_grad_norm
    clip_grad_norm(model, mesh, max_norm)


def megatron_dist_opt_norm_over_tp(model, mesh, max_norm: float) -> None:
    """A mistake in Megatron's clipping with the distributed optimizer: the
    square sums of the rank's main-gradient shards all-reduced over the
    tensor-parallel group instead of the whole distributed-optimizer
    instance (at tp 1 a group of one: each rank's own shards' norm; at tp 2
    the data-parallel ranks' shards are left out). Runs on one device too
    (``one_device``), where every group is of one rank."""
    from megatron.core import parallel_state as ps

    from backends.torch.zoo.megatron import clip_grad_norm, clip_shards
    if any(getattr(p, "grad_blocks", None) is not None for p in model.parameters()):
        clip_shards(model, max_norm, ps.get_tensor_model_parallel_group())
    else:
        clip_grad_norm(model, mesh, max_norm)


megatron_dist_opt_norm_over_tp.one_device = True  # type: ignore[attr-defined]
