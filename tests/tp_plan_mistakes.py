"""Tensor-parallel plans applied to values they do not describe, for the
stock SwiGLU tower (backends/torch/zoo/stock_models.py ``mlp``): each runs, and
each computes other gradients than the single-device step; the verifier
must say FAIL, not refuse."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from backends.torch.zoo.recipes import all_reduce_dp


def sp_mlp_on_whole_rows(model, mesh):
    """A sequence-parallel plan (the norm ``SequenceParallel``, the block's
    projections taking and giving ``Shard(1)``) on blocks whose input every
    tp rank holds whole: each rank's whole rows are taken for its piece of
    a sequence tp times as long, so every gradient is tp times too large."""
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "norm": SequenceParallel(),
            "gate": ColwiseParallel(input_layouts=Shard(1)),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        })
    return all_reduce_dp


def _vocab_plan(model, mesh) -> None:
    parallelize_module(model, mesh["tp"], {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })


def tied_head_retied(model, mesh):
    """GPT-2's token table and its tied output projection both split on
    the vocabulary (``RowwiseParallel``, ``ColwiseParallel``), and the tie
    made again afterwards (``parallelize_module`` gives each module a
    parameter of its own)."""
    _vocab_plan(model, mesh)
    model.lm_head.weight = model.wte.weight
    return all_reduce_dp


def tied_head_untied_by_tp(model, mesh):
    """A mistake: the same plan without tying again: the output projection
    trains a copy of the table, and the table's gradient misses the
    projection's part."""
    _vocab_plan(model, mesh)
    return all_reduce_dp


def titan_tie_not_made_again(model, mesh):
    """A mistake: torchtitan's own parallelize of a model that ties its token
    table to its output projection (``--model titan:qwen3``) without the tie
    its trainer makes again afterwards (``backends.torch.titan.retie``)."""
    from backends.torch.zoo.titan import parallelize
    return parallelize(model, mesh, tie_again=False)
