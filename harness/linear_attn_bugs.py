"""Wrong plans of linear attention's decay, each a recipe passed to
``python -m backends.torch`` (``--recipe harness.linear_attn_bugs:NAME``).
The decay parameters (``A_log``, ``dt_bias``: Gated DeltaNet's and Kimi
Delta Attention's gates, tests/decay_models.py's bias) set how fast the
masked, exponentiated decay falls. The backend never applies these; each
must FAIL.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

#: the last part of a decay parameter's name
DECAY = ("A_log", "dt_bias")


def _is_decay(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in DECAY


def all_reduce_but_decay(model, mesh) -> None:
    """Every gradient summed over "dp" (what DDP does), but the decay
    parameters': each replica keeps its own rows' part of theirs."""
    group = mesh["dp"]
    for name, p in model.named_parameters():
        if p.grad is None or _is_decay(name):
            continue
        local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        local.copy_(funcol.all_reduce(local, "sum", group))


def ddp_decay_unreduced(model, mesh):
    """Data parallelism by hand (--tp 1) whose all-reduce skips the decay
    parameters, as a filter by name would."""
    if mesh["tp"].size() != 1:
        raise ValueError("ddp_decay_unreduced is data parallel only (--tp 1)")
    if not any(_is_decay(name) for name, _ in model.named_parameters()):
        raise ValueError("the model has no decay parameter (A_log, dt_bias)")
    return all_reduce_but_decay
