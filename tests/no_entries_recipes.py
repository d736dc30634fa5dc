"""A tensor-parallel plan that does not run on ``no_entries_lm``: the
queries split over "tp" by heads, the keys and values left whole, so each
rank's attention meets half the query heads against every key head (a
shape error in ``attn``, raised alike by a real run on gloo)."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from backends.torch.zoo.recipes import all_reduce_dp


def queries_only_tp(model, mesh):
    """Bug: only ``attn.q_proj`` column-parallel on "tp"."""
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"attn.q_proj": ColwiseParallel()})
    return all_reduce_dp
