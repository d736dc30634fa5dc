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
    tensor-parallel rank 0 only, the other ranks keeping them stale."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from torch.utils._python_dispatch import _disable_current_modes
    if name not in CONFIGS:
        raise ValueError(f"no Megatron optimizer for --optimizer {name}")
    if distributed:
        raise ValueError("Megatron's distributed optimizer's step is not traced yet (its "
                         "gradients are: run without --optimizer)")
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
                             use_distributed_optimizer=False)
    # built before the step, as a training loop builds it before its first
    # iteration: not recorded (its parameter groups are agreed on with an
    # all_gather_object, which reads the objects' sizes into Python)
    params = [p for w in wrapped for p in w.parameters()]
    versions = [p._version for p in params]
    with _disable_current_modes():
        optimizer = get_megatron_optimizer(config, wrapped, config_overrides={},
                                           use_gloo_process_groups=False)
    if [p._version for p in params] != versions:  # an unrecorded write: the step would be stale
        raise ValueError("building Megatron's optimizer wrote a parameter (not recorded)")
    if bug == "duplicates_on_tp_rank0":
        _leave_out_duplicates(optimizer)
    optimizer.step()
    if bug == "lr_times_dp_compensated":  # the gradients as the step found them
        for w in wrapped:
            w.scale_gradients(float(dp))
    state: collections.defaultdict = collections.defaultdict(dict)
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if part.optimizer is not None:
            state.update(part.optimizer.state)
    return SimpleNamespace(state=state)


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
