"""cp: recipes for a step whose sequence is cut over a "cp" mesh dim (each
rank's tokens and labels its chunk of the sequence, backends/torch/rank.py),
on a model that computes each position on its own (no attention): the
weights are replicated and their gradients summed over the context-parallel
ranks, and over the data-parallel ones when the mesh has them. The wrong
ones as such steps ship: a gradient left unreduced over cp, and the loss
averaged over cp where it is summed (the loss aggregated over two axes,
torchtitan issue 3280)."""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _reduce(model, mesh, dims: tuple[str, ...], op: str = "sum") -> None:
    """Each gradient's local tensor (a DTensor's shard) all-reduced over the
    mesh dims ``dims`` the mesh has with more than one rank."""
    names = mesh.mesh_dim_names or ()
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=p.placements)
        local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        for dim in dims:
            if dim in names and mesh[dim].size() > 1:
                local.copy_(funcol.all_reduce(local, op, mesh[dim]))


def cp_sum(model, mesh):
    """Gradients summed over cp, then over dp."""
    return lambda model, mesh: _reduce(model, mesh, ("cp", "dp"))


def cp_unreduced(model, mesh):
    """Bug: gradients summed over dp only; each cp rank keeps its chunk's part."""
    return lambda model, mesh: _reduce(model, mesh, ("dp",))


def cp_averaged(model, mesh):
    """Bug (torchtitan 3280's mechanism): the gradients averaged over cp, as
    if each cp rank held a replica's whole loss; the loss already divides by
    the whole step's token count, so the step is 1/cp of the single-device one."""
    def after(model, mesh):
        _reduce(model, mesh, ("cp",), "avg")
        _reduce(model, mesh, ("dp",))
    return after


class _Ring:
    """The context ``context_parallel`` enters around a step, without its
    buffers (the backend has cut the batch already): PyTorch's ring for SDPA,
    through the CPU shim, with the given rotation and no load balancer.
    ``merger``: a class to merge the blocks with in place of CP's own
    ``_SDPAMerger`` (a merge written wrong, as such code ships)."""

    def __init__(self, mesh, method: str, merger=None):
        self.mesh, self.method, self.merger = mesh, method, merger
        self.saved = None

    def __enter__(self):
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        from backends.torch import cp_shim
        cp_shim.apply()
        set_rotate_method(self.method)
        cp._cp_options.enable_load_balance = False
        cp._cp_options.convert_to_f32 = False  # merge in float64 (a cast changes no proof)
        if self.merger is not None:
            self.saved = cp._SDPAMerger
            cp._SDPAMerger = self.merger(cp._SDPAMerger)
        cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=self.mesh)

    def __exit__(self, *exc):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        cp._disable_context_parallel_dispatcher_impl()
        if self.saved is not None:
            cp._SDPAMerger = self.saved


def ring_allgather(model, mesh):
    """PyTorch's ring attention over "cp" (all-gather rotation), gradients summed."""
    model.train_context = lambda: _Ring(mesh["cp"], "allgather")
    return cp_sum(model, mesh)


def ring_alltoall(model, mesh):
    """PyTorch's ring attention over "cp" (all-to-all rotation: each step's
    keys and values passed to the next rank), gradients summed."""
    model.train_context = lambda: _Ring(mesh["cp"], "alltoall")
    return cp_sum(model, mesh)


def _other_lse(merger):
    class OtherLse(merger):
        """Each block after the first merged with the log-sum-exp of the block
        before it (another block's lse)."""

        def _merge_one(self, block_out, block_lse, partial):
            previous = getattr(self, "previous_lse", None)
            self.previous_lse = block_lse
            super()._merge_one(block_out, block_lse if previous is None else previous, partial)
    return OtherLse


def ring_other_lse(model, mesh):
    """Bug: PyTorch's ring (all-gather rotation) whose merge takes, for every
    block after the first, the log-sum-exp of the block before it."""
    model.train_context = lambda: _Ring(mesh["cp"], "allgather", _other_lse)
    return cp_sum(model, mesh)


def _unshifted(merger):
    import torch.nn.functional as F

    class Unshifted(merger):
        """The merged log-sum-exp written without its shift: ``-logsigmoid(lse
        - lse_b)`` where it is ``lse - logsigmoid(lse - lse_b)`` (the running
        lse, which the sigmoid form's log-sum-exp is taken relative to, left
        out); the outputs are merged right."""

        def _merge_one(self, block_out, block_lse, partial):
            before = self._lse
            super()._merge_one(block_out, block_lse, partial)
            if before is None or partial:
                return
            lse_b = block_lse.unsqueeze(-1) if block_lse.dim() < block_out.dim() else block_lse
            self._lse = -F.logsigmoid(before - lse_b)
    return Unshifted


def ring_lse_unshifted(model, mesh):
    """Bug: PyTorch's ring (all-to-all rotation) whose merge drops the shift
    of the merged log-sum-exp; the backward, which reads it, is wrong."""
    model.train_context = lambda: _Ring(mesh["cp"], "alltoall", _unshifted)
    return cp_sum(model, mesh)


class _Balanced(_Ring):
    """The ring with PyTorch's load balancing on (``_cp_options.
    enable_load_balance``: each rank's query, keys and values hold two
    chunks of the sequence, its causal blocks chosen for them)."""

    def __enter__(self):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        super().__enter__()
        cp._cp_options.enable_load_balance = True

    def __exit__(self, *exc):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        cp._cp_options.enable_load_balance = False
        super().__exit__(*exc)


def _head_tail(seq_length: int, size: int):
    """PyTorch's head-tail load balancer (``context_parallel``'s default):
    rank r's buffers hold chunks r and 2 size - 1 - r of 2 size."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )
    return _HeadTailLoadBalancer(seq_length, size, torch.device("cpu"))


def ring_balanced(model, mesh, method: str = "allgather"):
    """PyTorch's ring with its head-tail load balancer: the batch laid out
    by the balancer's indices and cut along the sequence (what
    ``context_parallel`` does to its buffers), the ring's blocks chosen for
    a rank's two chunks; gradients summed."""
    model.cp_load_balancer = _head_tail
    model.train_context = lambda: _Balanced(mesh["cp"], method)
    return cp_sum(model, mesh)


def ring_balanced_alltoall(model, mesh):
    """ring_balanced with the all-to-all rotation."""
    return ring_balanced(model, mesh, "alltoall")


def cp_tp(model, mesh):
    """Tensor parallelism of the SwiGLU blocks over "tp" (gate and up by
    columns, down by rows) on the sequence split over "cp"; gradients
    summed over cp and dp."""
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
    return cp_sum(model, mesh)


def _fsdp(model, mesh) -> None:
    """FSDP2 over "dp", its reduce-scatter summing (divide factor 1: the loss
    already divides by the whole step's token count)."""
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh["dp"])
        module.set_gradient_divide_factor(1.0)


def cp_fsdp(model, mesh):
    """FSDP2 over "dp" on the sequence split over "cp"; the shards then
    summed over cp."""
    _fsdp(model, mesh)
    return lambda model, mesh: _reduce(model, mesh, ("cp",))


def cp_fsdp_unreduced(model, mesh):
    """Bug: cp_fsdp without the sum over cp (FSDP2 sharded over "dp" alone,
    where torchtitan shards over the flattened dp and cp ranks)."""
    _fsdp(model, mesh)


def _chunk_start(model, mesh) -> int:
    """Where this rank's chunk of the sequence starts."""
    return mesh["cp"].get_local_rank() * (model.positions.num_embeddings // mesh["cp"].size())


def cp_positions(model, mesh):
    """The positions shifted to this rank's chunk; gradients summed over cp and dp."""
    model.position_offset = _chunk_start(model, mesh)
    return cp_sum(model, mesh)


def cp_positions_unshifted(model, mesh):
    """Bug: the positions left at 0 on every context-parallel rank (position
    ids or rotary offsets not shifted per rank): rank c embeds its chunk
    with the first chunk's positions."""
    return cp_sum(model, mesh)


def _cut_table(model, mesh, chunk: int) -> None:
    model.table = model.table.chunk(mesh["cp"].size())[chunk].clone()


def cp_table(model, mesh):
    """The position table cut along the sequence, each rank its own chunk
    (what ``context_parallel`` does to the buffers it is given)."""
    _cut_table(model, mesh, mesh["cp"].get_local_rank())
    return cp_sum(model, mesh)


def cp_table_other_chunk(model, mesh):
    """Bug: the last context-parallel rank cuts the position table at the
    chunk before its own (a chunk order undone wrongly on one rank)."""
    c, n = mesh["cp"].get_local_rank(), mesh["cp"].size()
    _cut_table(model, mesh, c - 1 if c == n - 1 else c)
    return cp_sum(model, mesh)


def ring_balanced_wrong_order(model, mesh):
    """Bug: ring_balanced whose last context-parallel rank undoes the
    balancer's order of its two chunks wrongly (its embeddings' head and
    tail chunks swapped, as a contiguous layout would put them): its
    positions are attended and scored as other positions."""
    import torch
    c, n = mesh["cp"].get_local_rank(), mesh["cp"].size()
    if c == n - 1:
        def swap(module, args, out):
            head, tail = out.chunk(2, dim=1)
            return torch.cat([tail, head], dim=1)
        model.embed.register_forward_hook(swap)
    return ring_balanced(model, mesh)


def cp_table_balanced(model, mesh):
    """The position table model with the head-tail balancer's layout of the
    batch (refused: a table of positions is read along the sequence, which
    the balancer's order would have to permute too)."""
    model.cp_load_balancer = _head_tail
    return cp_table(model, mesh)


def ring_answer(model, mesh):
    """PyTorch's ring (all-gather rotation) on the answer tagger
    (tests/cp_models.py): each rank's positions start at its chunk, the
    kept labels' count all-reduced over "cp" (Megatron-LM's fix of PR
    7498: the loss of the whole step's kept labels on every rank)."""
    c, n = mesh["cp"].get_local_rank(), mesh["cp"].size()
    model.position_offset = c * (model.prompt * 4 // n)
    model.count_group = mesh["cp"].get_group()
    return ring_allgather(model, mesh)
