"""cp: recipes for Ulysses-style context parallelism (tests/cp_ulysses_models.py)
over a "cp" mesh dim: each rank's positions shifted to its chunk of the
sequence, the model's all-to-alls over the cp ranks, the replicated weights'
gradients summed over cp (and dp); with tensor parallelism of the heads over
"tp", or FSDP2 over "dp". The wrong ones as such steps ship: the loss
aggregated over two axes (torchtitan 3280), positions not shifted per cp
rank, the all-to-all's split of heads and sequence swapped, the inverse
all-to-all's received blocks in the wrong order."""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _reduce(model, mesh, dims: tuple[str, ...], op: str = "sum") -> None:
    """Each gradient's local tensor all-reduced over the mesh dims ``dims``
    the mesh has with more than one rank."""
    names = mesh.mesh_dim_names or ()
    for p in model.parameters():
        if p.grad is None:
            continue
        local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        for dim in dims:
            if dim in names and mesh[dim].size() > 1:
                local.copy_(funcol.all_reduce(local, op, mesh[dim]))


def _ulysses(model, mesh, exchange: str = "", shift: bool = True, fault: str = "") -> None:
    cp = mesh["cp"]
    model.group = cp.get_group()
    if exchange:
        model.exchange = exchange
    model.fault = fault
    if shift:
        model.position_offset = cp.get_local_rank() * (model.positions.num_embeddings // cp.size())


def _summed(model, mesh):
    return lambda model, mesh: _reduce(model, mesh, ("cp", "dp"))


def ulysses(model, mesh):
    """DeepSpeed's all-to-all (``all_to_all_single``) over "cp"; gradients summed over cp and dp."""
    _ulysses(model, mesh, "single")
    return _summed(model, mesh)


def ulysses_functional(model, mesh):
    """The all-to-alls as PyTorch's differentiable functional collective
    (``all_to_all_single_autograd``) over "cp"; gradients summed."""
    _ulysses(model, mesh, "functional")
    return _summed(model, mesh)


def ulysses_list(model, mesh):
    """VeOmni's all-to-all (``all_to_all`` of pieces) over "cp"; gradients summed."""
    _ulysses(model, mesh, "list")
    return _summed(model, mesh)


def ulysses_tp(model, mesh):
    """Ulysses over "cp" on the heads tensor parallelism leaves each rank
    (q, k, v by columns, the output projection by rows, over "tp")."""
    parallelize_module(model, mesh["tp"], {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                           "v": ColwiseParallel(), "proj": RowwiseParallel()})
    _ulysses(model, mesh, "single")
    return _summed(model, mesh)


def ulysses_fsdp(model, mesh):
    """FSDP2 over "dp" (its reduce-scatter summing), Ulysses over "cp", the
    shards then summed over cp."""
    _ulysses(model, mesh, "list")
    fully_shard(model, mesh=mesh["dp"])
    model.set_gradient_divide_factor(1.0)
    return lambda model, mesh: _reduce(model, mesh, ("cp",))


def ulysses_averaged(model, mesh):
    """Bug (torchtitan 3280's mechanism): gradients averaged over cp as if
    each cp rank held a replica's whole loss, then summed over dp."""
    _ulysses(model, mesh, "single")

    def after(model, mesh):
        _reduce(model, mesh, ("cp",), "avg")
        _reduce(model, mesh, ("dp",))
    return after


def ulysses_unshifted(model, mesh):
    """Bug: every cp rank embeds its chunk at the first chunk's positions."""
    _ulysses(model, mesh, "single", shift=False)
    return _summed(model, mesh)


def ulysses_swapped(model, mesh):
    """Bug: the first all-to-all scatters the sequence and gathers the heads
    (its scatter and gather dims swapped), the second the reverse: the
    shapes come back, each rank attends over a part of the sequence."""
    _ulysses(model, mesh, "list", fault="swapped")
    return _summed(model, mesh)


def ulysses_wrong_order(model, mesh):
    """Bug: the inverse all-to-all's received head groups put back in reverse order."""
    _ulysses(model, mesh, "single", fault="order")
    return _summed(model, mesh)


def ulysses_list_wrong_order(model, mesh):
    """Bug: ulysses_wrong_order with VeOmni's all-to-all."""
    _ulysses(model, mesh, "list", fault="order")
    return _summed(model, mesh)


def ulysses_pp(model, mesh, shift: bool = True):
    """Pipeline parallelism over "pp" (GPipe, two microbatches; each rank
    keeps its stage of ``UlyssesStack``) with Ulysses over "cp" inside every
    stage: the activations between stages are the rank's chunk of the
    sequence; gradients summed over cp and dp."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from backends.torch.tracer.pipeline import PipelineStep
    pp, cp = mesh["pp"], mesh["cp"]
    stage, stages = pp.get_local_rank(), pp.size()
    model.keep(stage, stages)
    for block in model.blocks.values():
        block.group = cp.get_group()
    width = model.blocks[next(iter(model.blocks))].q.in_features
    vocab = model.head.out_features if model.head is not None else 0
    if model.positions is not None and shift:
        total = model.positions.num_embeddings
        model.position_offset = cp.get_local_rank() * (total // cp.size())

    def schedule(tokens):
        rows, seq = tokens.shape[0] // 2, tokens.shape[1]
        hidden = torch.empty(rows, seq, width, dtype=torch.float64, requires_grad=True)
        last = torch.empty(rows, seq, vocab, dtype=torch.float64, requires_grad=True)
        built = PipelineStage(model, stage, stages, torch.device("cpu"),
                              input_args=tokens[:rows] if stage == 0 else hidden,
                              output_args=last if stage == stages - 1 else hidden,
                              group=pp.get_group())
        return ScheduleGPipe(built, 2, loss_fn=model.loss, scale_grads=False)

    return PipelineStep(schedule, 1, lambda model, mesh: _reduce(model, mesh, ("cp", "dp")))


def ulysses_pp_unshifted(model, mesh):
    """Bug: ulysses_pp with every cp rank's positions left at the first chunk's."""
    return ulysses_pp(model, mesh, shift=False)


def ulysses_sinks(model, mesh, fault: str = ""):
    """Ulysses over "cp" (DeepSpeed's all-to-all) on the sink tagger
    (tests/cp_ulysses_models.py): each rank reads the sinks of its head
    group; gradients summed over cp and dp."""
    _ulysses(model, mesh, "single", fault=fault)
    model.cp_rank = mesh["cp"].get_local_rank()
    return _summed(model, mesh)


def ulysses_sinks_dropped(model, mesh):
    """Bug (prime-rl PR 3397's mechanism under Ulysses): the rank's
    attention drops the sinks."""
    return ulysses_sinks(model, mesh, "no_sinks")


def ulysses_sinks_first_group(model, mesh):
    """Bug: every rank reads the sinks of the first head group (the sinks
    not cut by the rank's cp index), whatever heads it holds."""
    _ulysses(model, mesh, "single")
    return _summed(model, mesh)
