"""Recipes for the models of ``tests/strided_models.py`` with the strided
write wrong on one rank, loaded as ``--recipe tests.strided_mistakes:NAME``:
the correct recipe, then rank 0's model set to write the even and odd
halves swapped (``swapped``). The real run differs
(``scripts/gloo_truth.py``), and the verifier must FAIL at the rank.
"""

from __future__ import annotations

import torch.distributed as dist

from backends.torch.zoo.recipes import ddp_avg
from backends.torch.zoo.scaling_recipes import fsdp_default, tp_mlp_avg


def _swap_on_rank_0(model) -> None:
    if dist.get_rank() == 0:
        for module in model.modules():
            if hasattr(module, "swapped"):
                module.swapped = True


def ddp_avg_swapped_on_rank_0(model, mesh):
    _swap_on_rank_0(model)
    return ddp_avg(model, mesh)


def fsdp_swapped_on_rank_0(model, mesh):
    _swap_on_rank_0(model)
    return fsdp_default(model, mesh)


def tp_mlp_avg_swapped_on_rank_0(model, mesh):
    _swap_on_rank_0(model)
    return tp_mlp_avg(model, mesh)


def ddp_avg_positions_shifted_on_rank_0(model, mesh):
    """Rank 0 reads its rotary angles one position on (an offset meant for
    a sequence shard applied to rows it holds whole)."""
    if dist.get_rank() == 0:
        model.offset = 1
    return ddp_avg(model, mesh)
