"""torchtitan's MoE models with their auxiliary-loss-free load balancing.

    python -m backends.torch --model backends.torch.zoo.titan_balance:deepseek_v3 \\
        --recipe backends.torch.zoo.titan_balance:parallelize --dp 2 --tp 1 \\
        --vocab 2048 --layers 2 --optimizer sgd

torchtitan's trainer builds its optimizers and then calls the model
family's ``post_optimizer_build_fn``, ``register_moe_load_balancing_hook``:
an optimizer step pre-hook that sums every MoE layer's ``tokens_per_expert_E``
over the ranks of its "loss" mesh (dp x cp; first over "tp" with expert
and tensor parallelism together), moves ``expert_bias_E`` by
``coeff * sign(mean - counts)`` less its mean, and zeroes the counts. Here
a rank's ``--optimizer`` step is torch's (``rank.OPTIMIZERS``) with that
hook registered by torchtitan's own function on the rank's torchtitan
``ParallelDims``, on one device with the dims of a world of one rank (no
mesh of size > 1: the counts are the step's). The models (``NAME``,
``NAME_ep`` of ``titan.FAMILIES`` with load balancing) name the buffers the
hook updates (``final_buffers``), which every rank must end with as the
single-device step does, and ask for their counts' all-reduces to be
answered (``reduces_constants``; docs/soundness.md, "Plans traced from
PyTorch", 105). The wrong plans give the hook a wrong "loss" mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from backends.torch.tracer.rank import OPTIMIZERS
from backends.torch.zoo import titan

#: the families whose MoE layers balance their load (torchtitan's
#: ``load_balance_coeff`` set in the flavor)
BALANCED = ("deepseek_v3", "qwen3_moe", "kimi_k2_7")


class OneDevice:
    """What torchtitan's load-balancing hook reads of its ``ParallelDims``
    on one device: no mesh of size > 1 (``get_optional_mesh`` answers None,
    as torchtitan's does for a dim of size 1), no expert or tensor
    parallelism."""

    ep_enabled = False
    tp = 1

    def get_optional_mesh(self, dims: Any) -> None:
        return None


class LossMeshAs:
    """A rank's ``ParallelDims`` whose "loss" mesh is ``loss`` (a bug of the
    wrong plans: None, or another dim's mesh); everything else its own."""

    def __init__(self, dims: Any, loss: Any):
        self.dims = dims
        self.loss = loss

    def get_optional_mesh(self, dims: Any, **kwargs: Any) -> Any:
        if dims == "loss":
            return self.loss
        return self.dims.get_optional_mesh(dims, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dims, name)


def moe_buffers(model: nn.Module) -> list[str]:
    """The names of the buffers torchtitan's hook updates: every MoE
    layer's expert bias and token counts."""
    names = [n for n, _ in model.named_buffers()]
    return [n for n in names if n.endswith((".expert_bias_E", ".tokens_per_expert_E"))]


def balanced_step(model: titan.TitanLM, dims: Any):
    """The optimizer step of a rank (or of one device: ``dims`` a
    ``OneDevice``): torch's optimizer ``name`` over the model's parameters
    with torchtitan's load-balancing hook registered by torchtitan, then
    stepped (the hook runs first)."""

    def step(name: str):
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        optimizer = OPTIMIZERS[name](list(model.parameters()))
        register_moe_load_balancing_hook(optimizer, [model.model], dims)
        optimizer.step()
        return optimizer

    step.one_device = isinstance(dims, OneDevice)
    return step


def balanced(name: str):
    """The factory of ``titan:NAME`` (``NAME_ep``) with its load balancing
    traced: the model names the buffers its step updates, asks for the
    all-reduces of its counts to be answered, and steps on one device with
    torchtitan's hook."""
    base = name.removesuffix(titan.POSITIONS_SUFFIX).removesuffix(titan.EP_SUFFIX)
    if base not in BALANCED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    make = titan.family_factory(name)

    def factory(**sizes) -> titan.TitanLM:
        model = make(**sizes)
        if not moe_buffers(model):
            raise ValueError(f"{name}: no MoE layer with load balancing")
        model.final_buffers = moe_buffers(model)
        model.reduces_constants = True
        model.own_optimizer = balanced_step(model, OneDevice())
        return model

    factory.__name__ = factory.__qualname__ = name
    factory.__module__ = __name__
    return factory


def __getattr__(name: str):
    """``titan_balance:NAME`` (and ``NAME_ep``) of ``BALANCED`` as its factory."""
    return balanced(name)


def _on(model: titan.TitanLM, mesh, ep: int, loss: Callable[[Any], Any] | None = None,
        cp: bool = False):
    """The family's own parallelize (``titan.parallelize``; with ``cp``,
    ``titan.parallelize_cp``'s context parallelism) on torchtitan's
    ``ParallelDims`` of the mesh, then the rank's step with the hook on
    those dims (a bug: on dims whose "loss" mesh is ``loss(dims)``)."""
    if titan._size(mesh, "pp") != 1:
        raise ValueError(f"{__name__}: not pipelined (--pp 1)")
    if not hasattr(model, "final_buffers"):
        raise ValueError(f"{__name__}: give a model of {__name__} (--model "
                         f"backends.torch.zoo.titan_balance:NAME)")
    if ep > 1 and not getattr(model, "expert_parallel", False):
        raise ValueError(f"{__name__}: expert parallelism needs a model built for it: NAME_ep")
    dims = titan._dims(mesh, ep)
    if cp:
        titan._parallelize_cp(model, mesh, shift=0, dims=dims)
    else:
        titan.parallelize(model, mesh, ep=ep, dims=dims)
    model.own_optimizer = balanced_step(model, dims if loss is None
                                        else LossMeshAs(dims, loss(dims)))


def _ep(mesh) -> int:
    """Expert parallelism over the data-parallel ranks (torchtitan's dp2ep)."""
    return mesh["dp"].size()


def _none(dims: Any) -> None:
    return None


def parallelize(model: titan.TitanLM, mesh):
    """``titan:parallelize`` with torchtitan's load-balancing hook on the
    rank's optimizer step."""
    _on(model, mesh, 1)


def parallelize_ep(model: titan.TitanLM, mesh):
    """``titan:parallelize_ep`` (ep = dp) with torchtitan's load-balancing
    hook on the rank's optimizer step."""
    _on(model, mesh, _ep(mesh))


def parallelize_counts_not_reduced(model: titan.TitanLM, mesh):
    """A bug: the hook sees no "loss" mesh, so each rank moves its expert
    biases by the counts of its own tokens."""
    _on(model, mesh, 1, _none)


def parallelize_ep_counts_not_reduced(model: titan.TitanLM, mesh):
    """``parallelize_counts_not_reduced`` with expert parallelism (ep = dp)."""
    _on(model, mesh, _ep(mesh), _none)


def parallelize_ep_counts_over_ep(model: titan.TitanLM, mesh):
    """The counts summed over the "ep" ranks instead of the "loss" ranks
    (ep = dp: the same ranks at tp 1, another group with tp > 1)."""
    _on(model, mesh, _ep(mesh), lambda dims: dims.get_mesh("ep"))


def parallelize_counts_over_tp(model: titan.TitanLM, mesh):
    """A bug: the counts summed over the tensor-parallel ranks instead of
    the "loss" ranks."""
    _on(model, mesh, 1, lambda dims: dims.get_mesh("tp"))


def parallelize_cp(model: titan.TitanLM, mesh):
    """``titan:parallelize_cp`` (torchtitan's CP over "cp", on a model of
    ``NAME_positions``) with torchtitan's load-balancing hook on the rank's
    optimizer step: its "loss" mesh is dp x cp, so the counts are the
    step's (docs/soundness.md, "Plans traced from PyTorch", 115)."""
    _on(model, mesh, 1, cp=True)


def parallelize_cp_counts_not_reduced(model: titan.TitanLM, mesh):
    """A bug: ``parallelize_cp`` with the hook seeing no "loss" mesh, so
    each cp rank moves its expert biases by its own chunk's counts."""
    _on(model, mesh, 1, _none, cp=True)
