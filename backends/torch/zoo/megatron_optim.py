"""Megatron-Core's own optimizer step on a rank (``--optimizer adamw|sgd``
with a Megatron recipe).

A Megatron training loop builds its optimizer with
``get_megatron_optimizer(OptimizerConfig(...), model_chunks)`` over the
DDP-wrapped chunks and calls ``optimizer.step()`` after the schedule's
backward and ``finalize_model_grads``. Without the distributed optimizer
and in full precision this is Megatron's ``FP32Optimizer``: it points each
parameter's ``grad`` at its ``main_grad`` and runs the torch optimizer
Megatron falls back to without TransformerEngine or apex
(``torch.optim.AdamW``, ``torch.optim.SGD``) on the model's parameters.

The configuration asks Megatron for exactly the hyperparameters of the
backend's ``--optimizer`` (``tracer.rank.OPTIMIZERS``): the single-device
step runs that torch optimizer on the single-device gradients, a
reference independent of the code under test (docs/soundness.md, "Plans
traced from PyTorch", 86). Megatron's default parameter groups give biases
and 1-d parameters no weight decay; ``config_overrides={}`` (Megatron's
documented way to skip that default) keeps one decay for every parameter,
as the reference has. Clipping is the backend's ``--clip`` (run before the
step, ``clip_grad=0.0`` here); no learning-rate scheduler runs (the first
step's rate is the configured one).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

#: Megatron's ``OptimizerConfig`` fields giving each backend optimizer's
#: hyperparameters (those of ``tracer.rank.OPTIMIZERS``)
CONFIGS: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer": "adam", "lr": 0.001, "weight_decay": 0.1, "adam_beta1": 0.9,
              "adam_beta2": 0.999, "adam_eps": 1e-8, "decoupled_weight_decay": True},
    "sgd": {"optimizer": "sgd", "lr": 0.01, "weight_decay": 0.1, "sgd_momentum": 0.0},
}


def megatron_step(wrapped: list, name: str, distributed: bool,
                  bug: str | None = None) -> SimpleNamespace:
    """Build Megatron's optimizer over the DDP-wrapped chunks for the
    backend optimizer ``name`` and take one step, as a training loop does.
    What the rank ends with: the states of the torch optimizers it wraps
    (one, or a chain's), as ``.state``. ``bug="lr_times_dp"``: a wrong
    step, the learning rate multiplied by the data-parallel size (a linear
    scaling rule applied to a rate already set for the global batch);
    ``"lr_times_dp_compensated"``: that rate with the weight decay and the
    gradients divided by the same size for the step (multiplied back after
    it), the same SGD update (a correct step whose numbers differ from the
    single-device step's);
    ``"duplicates_on_tp_rank0"``: the parameters every tensor-parallel rank
    holds whole (norms, biases of row-parallel layers) stepped on
    tensor-parallel rank 0 only, the other ranks keeping them stale. With
    the distributed optimizer: ``"param_gather_skipped"`` (no all-gather of
    the updated ranges), ``"param_gather_wrong_shard"`` (each rank sends
    the next rank's range of its buffer, stale), ``"step_shifted"`` (each
    rank steps the next rank's ranges)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from torch.utils._python_dispatch import _disable_current_modes
    if name not in CONFIGS:
        raise ValueError(f"no Megatron optimizer for --optimizer {name}")
    if distributed and CONFIGS[name]["optimizer"] != "adam":
        # its DistributedOptimizer asserts it (checkpointing needs Adam's states)
        raise ValueError(f"Megatron's distributed optimizer steps Adam only, not "
                         f"--optimizer {name}")
    fields = dict(CONFIGS[name])
    if bug in ("lr_times_dp", "lr_times_dp_compensated"):
        from megatron.core import parallel_state as ps
        dp = ps.get_data_parallel_world_size()
        fields["lr"] *= dp
        if bug == "lr_times_dp_compensated":  # decay and gradients scaled back: the same update
            fields["weight_decay"] /= dp
            for w in wrapped:
                w.scale_gradients(1.0 / dp)
    config = OptimizerConfig(**fields, clip_grad=0.0, bf16=False, fp16=False,
                             use_distributed_optimizer=distributed)
    # built before the step, as a training loop builds it before its first
    # iteration: not recorded (its parameter groups are agreed on with an
    # all_gather_object, which reads the objects' sizes into Python)
    params = [p for w in wrapped for p in w.parameters()]
    versions = [p._version for p in params]
    with _disable_current_modes(), _ranges_shifted(wrapped, bug == "step_shifted"):
        optimizer = get_megatron_optimizer(config, wrapped, config_overrides={},
                                           use_gloo_process_groups=False)
    if [p._version for p in params] != versions:  # an unrecorded write: the step would be stale
        raise ValueError("building Megatron's optimizer wrote a parameter (not recorded)")
    if bug == "duplicates_on_tp_rank0":
        _leave_out_duplicates(optimizer)
    if distributed:
        _param_buffers_as_regions(wrapped)
    if bug == "param_gather_skipped":  # every rank keeps the others' ranges as loaded
        for w in wrapped:
            w.start_param_sync = lambda *args, **kwargs: None
    if bug == "param_gather_wrong_shard":  # each rank sends the next rank's (stale) range
        for w in wrapped:
            for group in w.bucket_groups:
                group.intra_distributed_optimizer_instance_rank = \
                    (group.intra_distributed_optimizer_instance_rank + 1) \
                    % group.intra_distributed_optimizer_instance_size
    with _float64_kept() if distributed else contextlib.nullcontext(), _traced_sqrt(optimizer):
        optimizer.step()
    if bug == "lr_times_dp_compensated":  # the gradients as the step found them
        for w in wrapped:
            w.scale_gradients(float(dp))
    state: collections.defaultdict = collections.defaultdict(dict)
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if part.optimizer is not None:
            state.update(part.optimizer.state)
            if distributed:  # each shard's states under the parameter it is a range of
                for models, shards in zip(part.model_fp32_groups, part.shard_fp32_groups):
                    for model_param, shard in zip(models, shards):
                        state[model_param] = part.optimizer.state[shard]
    return SimpleNamespace(state=state, flat_states=distributed)


@contextlib.contextmanager
def _ranges_shifted(wrapped: list, shift: bool) -> Iterator[None]:
    """A wrong step (``shift``): the optimizer built with the range map of
    the next data-parallel rank (each rank steps the next rank's range of
    every parameter, with its own, unreduced gradients there)."""
    if not shift:
        yield
        return
    buffers = [b for w in wrapped for b in [*w.buffers, *w.expert_parallel_buffers]]
    kept = [b.data_parallel_group for b in buffers]
    for b in buffers:
        b.data_parallel_group = ShiftedRank(b.data_parallel_group, 1)
    try:
        yield
    finally:
        for b, group in zip(buffers, kept):
            b.data_parallel_group = group


def _param_buffers_as_regions(wrapped: list) -> None:
    """Each DDP parameter buffer written region by region, through views no
    recorded op made (so the recorder follows that memory, as it follows
    the grad buffers): every parameter's region copied from the parameter
    (the values it already holds) and the padding between them zeroed (it
    holds zeros: Megatron allocates the buffer with ``torch.zeros``;
    checked). The distributed optimizer then writes each rank's updated
    range into that memory and all-gathers the buffer, and the parameters,
    views of it, are read from it after the step."""
    from torch.utils._python_dispatch import _disable_current_modes
    for w in wrapped:
        for buffer in w.buffers:
            with _disable_current_modes():  # views no recorded op made
                flat = buffer.param_data.view(-1)
                taken = sorted((start, end, id(p), p)
                               for p, (start, end, _) in buffer.param_index_map.items())
                regions, at = [], 0
                for start, end, _, param in [*taken, (flat.numel(), flat.numel(), 0, None)]:
                    if start > at:
                        if bool((flat[at:start] != 0).any()):
                            raise ValueError("Megatron's parameter buffer holds non-zero padding")
                        regions.append((flat[at:start], None))
                    if param is not None:
                        regions.append((flat[start:end].view(param.shape), param))
                    at = max(at, end)
            for view, param in regions:
                if param is None:
                    view.zero_()
                else:
                    view.copy_(param.detach())

#: the line printed for the distributed optimizer's step (the shim's patches
#: are in ``megatron_shim``; this one holds during the step only)
FLOAT_PATCH = ("Megatron-Core CPU shim (backends/torch/zoo/megatron_optim.py) 11: "
               "Tensor.float() of a float64 tensor during the distributed optimizer's step -> "
               "the tensor itself (the backend runs in float64 what Megatron runs in float32)")


@contextlib.contextmanager
def _float64_kept() -> Iterator[None]:
    """``Tensor.float()`` of a float64 tensor is the tensor itself while the
    distributed optimizer steps: its ``_copy_model_grads_to_main_grads``
    sets ``shard_main_param.grad = main_grad.view(-1)[start:end].float()``,
    a float32 copy torch refuses as the gradient of a float64 parameter.
    The backend runs Megatron's float32 in float64 and exact arithmetic
    treats a cast as the identity, so the value is the same; printed."""
    import sys

    import torch
    kept = torch.Tensor.float

    def float_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.dtype == torch.float64 and not args and not kwargs:
            return self
        return kept(self, *args, **kwargs)
    print(FLOAT_PATCH, file=sys.stderr)
    torch.Tensor.float = float_
    try:
        yield
    finally:
        torch.Tensor.float = kept


#: the line printed when Megatron's chained optimizer (dense and expert parts)
#: combines its parts' norms in Python during the step
SQRT_PATCH = ("Megatron-Core CPU shim (backends/torch/zoo/megatron_optim.py) 11: "
              "math.sqrt in megatron/core/optimizer/optimizer.py of a number read with .item() "
              "-> the number ** 0.5, traced (ChainedOptimizer.get_grad_norm)")


@contextlib.contextmanager
def _traced_sqrt(optimizer: Any) -> Iterator[None]:
    """``math.sqrt`` as Megatron's optimizer module reads it, of a traced
    number (``tracer.numbers``), is the number ``** 0.5``, itself traced:
    ``ChainedOptimizer.get_grad_norm`` combines its parts' norms (each read
    with ``.item()``) as ``math.sqrt(sum(x ** 2))`` when their groups
    differ (a mixture of experts' dense and expert optimizers), and a plain
    ``math.sqrt`` converts the number to an untraced float. Only for a
    chained optimizer; the same value; printed."""
    import math
    import sys

    from megatron.core.optimizer import optimizer as module

    from backends.torch.tracer.numbers import TracedNumber
    if not hasattr(optimizer, "chained_optimizers"):
        yield
        return
    kept = module.math

    def sqrt(x: Any) -> Any:
        return x ** 0.5 if isinstance(x, TracedNumber) else math.sqrt(x)
    print(SQRT_PATCH, file=sys.stderr)
    names = {k: getattr(math, k) for k in dir(math) if not k.startswith("__")}
    module.math = SimpleNamespace(**{**names, "sqrt": sqrt})
    try:
        yield
    finally:
        module.math = kept


def _leave_out_duplicates(optimizer: Any) -> None:
    """A wrong step: on a tensor-parallel rank other than 0 the parameters
    that are tensor-parallel duplicates (``param_is_not_tensor_parallel_duplicate``
    False: the rank that counts them in the norm is rank 0) are taken out of
    the torch optimizers' groups."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    if ps.get_tensor_model_parallel_rank() == 0:
        return
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in part.optimizer.param_groups if part.optimizer is not None else []:
            group["params"] = [p for p in group["params"]
                               if param_is_not_tensor_parallel_duplicate(p)]


class ShiftedRank:
    """A process group seen with its members' ranks shifted by ``shift``
    (a wrong plan: the range map of the next data-parallel rank)."""

    def __init__(self, group: Any, shift: int):
        self.group, self.shift = group, shift

    def rank(self) -> int:
        return (self.group.rank() + self.shift) % self.group.size()

    def size(self) -> int:
        return self.group.size()
