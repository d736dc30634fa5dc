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


def _block(name: str) -> str:
    """The layer's block a parameter is in (``...layers.0.self_attn``), or
    the parameter itself outside numbered layers."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[:i + 3])
    return name


def linear_attention(model) -> set[str]:
    """The names of the parameters of every block holding a decay parameter
    (the linear attention of a layer; a lone decay parameter elsewhere)."""
    names = [name for name, _ in model.named_parameters()]
    blocks = {_block(name) for name in names if _is_decay(name)}
    return {name for name in names if name in blocks or any(name.startswith(b + ".")
                                                            for b in blocks)}


def all_reduce_but(model, mesh, skipped: set[str]) -> None:
    """Every gradient summed over "dp" (what DDP does), but those of
    ``skipped``: each replica keeps its own rows' part of theirs."""
    group = mesh["dp"]
    for name, p in model.named_parameters():
        if p.grad is None or name in skipped:
            continue
        local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        local.copy_(funcol.all_reduce(local, "sum", group))


def ddp_decay_unreduced(model, mesh):
    """Data parallelism by hand (--tp 1) whose all-reduce skips the
    parameters of the linear attention (every block holding ``A_log`` or
    ``dt_bias``), as a filter by name would."""
    if mesh["tp"].size() != 1:
        raise ValueError("ddp_decay_unreduced is data parallel only (--tp 1)")
    skipped = linear_attention(model)
    if not skipped:
        raise ValueError("the model has no decay parameter (A_log, dt_bias)")
    return lambda model, mesh: all_reduce_but(model, mesh, skipped)
