"""Recipes that load a parameter's shard other than the one its placements
claim (``tests/test_torch_loaded_values.py``): ``--recipe
tests.loaded_values_recipes:NAME`` on ``backends.torch.stock_models:mlp``.
Each is a mistake that changes values: the ranks' step computes with other
weights than the single-device step's, while every placement is right."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from backends.torch.zoo.recipes import all_reduce_dp
from backends.torch.zoo.stock_recipes import fsdp, mlp_tp_plan


def _load_up_rows(model, mesh, piece_of) -> None:
    """Each block's ``up`` weight rebuilt as ``DTensor.from_local`` of the
    rows ``piece_of(t, tp)`` of the full weight on tensor-parallel rank t,
    placed as ``Shard(0)``: the claim is rank t's own rows."""
    tp_mesh = mesh["tp"]
    tp, t = tp_mesh.size(), tp_mesh.get_local_rank()
    fulls = [block.up.weight.detach().clone() for block in model.blocks]
    mlp_tp_plan(model, tp_mesh)
    for block, full in zip(model.blocks, fulls):
        n = full.shape[0] // tp
        k = piece_of(t, tp)
        local = full[k * n:(k + 1) * n].clone()
        block.up.weight = nn.Parameter(DTensor.from_local(local, tp_mesh, [Shard(0)]))


def tp_up_next_rows(model, mesh):
    """Bug: the MLP split on "tp" with each rank's ``up`` weight built from
    the next rank's rows (``DTensor.from_local(full[other_rows], ...)``)."""
    _load_up_rows(model, mesh, lambda t, tp: (t + 1) % tp)
    return all_reduce_dp


def tp_up_same_rows(model, mesh):
    """Bug: the MLP split on "tp" with every rank's ``up`` weight built from
    the first rank's rows (two ranks given the same shard)."""
    _load_up_rows(model, mesh, lambda t, tp: 0)
    return all_reduce_dp


def fsdp_swapped_checkpoint(model, mesh):
    """Bug: FSDP2 over "dp", then each rank's shard of the embedding
    overwritten with the next data-parallel rank's (a sharded checkpoint
    loaded into the wrong rank)."""
    full = model.embed.weight.detach().clone()
    fsdp(model, mesh)
    dp, d = mesh["dp"].size(), mesh["dp"].get_local_rank()
    n = -(-full.shape[0] // dp)
    k = (d + 1) % dp
    with torch.no_grad():
        local = model.embed.weight.to_local()
        local.copy_(full[k * n:k * n + local.shape[0]])
    return None
