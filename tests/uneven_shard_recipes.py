"""Recipes that cut a parameter unevenly along a dim other than 0
(``tests/test_torch_pools_extrema_padding.py``): ``--recipe tests.uneven_shard_recipes:NAME``
on ``backends.torch.stock_models:mlp`` with an inner size the
tensor-parallel group does not divide (``--ffn 15`` on ``tp 2``: each
``down`` weight ``Shard(1)``, 8 and 7 columns). Functions whose docstring
starts with "Bug" are mistakes that change values.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from backends.torch.zoo.recipes import all_reduce_dp


def rowwise_replicated_input(model, mesh):
    """Each block's ``down`` projection row-parallel on "tp" with its input
    replicated (DTensor cuts the input's columns as the weight's, by
    ``torch.chunk``), gradients summed over "dp"."""
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"down": RowwiseParallel(input_layouts=Replicate())})
    return all_reduce_dp


def _cut_at_even_offsets(tp):
    """A forward pre-hook cutting the replicated input's last dim at
    ``rank * (n // size)``, the width of the rank's ``torch.chunk`` piece."""
    def hook(module, args):
        (x,) = args
        n, size, rank = x.shape[-1], tp.size(), tp.get_local_rank()
        chunk = -(-n // size)
        width = max(0, min(chunk, n - rank * chunk))
        local = x.narrow(-1, rank * (n // size), width)
        return (DTensor.from_local(local, tp, [Shard(-1)], shape=x.shape, stride=x.stride()),)
    return hook


def rowwise_even_offsets(model, mesh):
    """Bug: as ``rowwise_replicated_input``, but the input's columns are cut
    by hand at even offsets (``rank * (n // tp)``): with 15 columns rank 1
    reads columns 7 to 13 against its weight's columns 8 to 14. (The hand
    cut also leaves the input's gradient partial on each rank: its backward
    pads the rank's columns with zeros, where DTensor's gathers them.)"""
    tp = mesh["tp"]
    for block in model.blocks:
        parallelize_module(block, tp, {"down": RowwiseParallel(input_layouts=Shard(-1))})
        block.down.register_forward_pre_hook(_cut_at_even_offsets(tp), prepend=True)
    return all_reduce_dp
