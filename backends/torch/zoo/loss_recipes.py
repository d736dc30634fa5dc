"""Recipes for the loss conventions of ``backends/torch/loss_models.py``,
and the mistakes people make with them.

The token-weighted mean divides each rank's summed loss by the step's
count of kept labels, which the rank obtains by all-reducing its own count
over "dp"; the gradients are then summed (each rank's loss is its share of
the step's mean).
"""

from __future__ import annotations

from backends.torch.zoo.recipes import all_reduce_dp, average_dp
from backends.torch.zoo.stock_recipes import mlp_tp_plan


def ddp_token_weighted(model, mesh):
    """The count of kept labels all-reduced over "dp", gradients summed."""
    model.count_group = mesh["dp"].get_group()
    return all_reduce_dp


def ddp_local_count(model, mesh):
    """Bug: the count is not all-reduced, so each rank divides its summed
    loss by its own count of kept labels, and the gradients are summed."""
    return all_reduce_dp


def ddp_token_weighted_avg(model, mesh):
    """Bug: the count all-reduced (each rank's loss already its share of the
    step's mean) and the gradients averaged too: divided by dp twice."""
    model.count_group = mesh["dp"].get_group()
    return average_dp


def ddp_smoothing_first_rank(model, mesh):
    """Bug: the label smoothing of the config reaches the first
    data-parallel rank only; the others run with another (0.2, a stale
    default), gradients summed."""
    if mesh["dp"].get_local_rank() != 0:
        model.label_smoothing = 0.2
    return all_reduce_dp


def ddp_avg_unsmoothed_first_rank(model, mesh):
    """Bug: a per-rank mean averaged over "dp", the smoothing of the config on the first rank only."""
    ddp_smoothing_first_rank(model, mesh)
    return average_dp



def tp_mlp_token_weighted(model, mesh):
    """``ddp_token_weighted`` with the MLPs tensor-parallel on "tp"
    (``stock_recipes.mlp_tp_plan``): the count all-reduced over "dp" only."""
    mlp_tp_plan(model, mesh["tp"])
    model.count_group = mesh["dp"].get_group()
    return all_reduce_dp


def ddp_pad_id_first_rank(model, mesh):
    """Bug: the tokenizer's pad id reaches the first data-parallel rank only;
    the others mask and ignore the next id instead, gradients summed: FAIL
    at the key-padding mask on rank 1 (it reads another column of the
    one-hot ids)."""
    if mesh["dp"].get_local_rank() != 0:
        model.pad += 1
        model.key_pad += 1
    return all_reduce_dp


def ddp_ignore_index_first_rank(model, mesh):
    """Bug: the loss of the ranks after the first ignores the id after the
    pad id (the attention still masks the pad), gradients summed. The
    ignore index's constant row is no single-device constant: an input of
    those ranks only, and the loss FAILs where it reads it."""
    if mesh["dp"].get_local_rank() != 0:
        model.pad += 1
    return all_reduce_dp


def ddp_key_mask_off_by_one(model, mesh):
    """Bug: the key-padding mask of the ranks after the first masks the id
    after the pad id (the loss still ignores the pad), gradients summed:
    FAIL at the mask on rank 1, which reads another column of the one-hot
    ids than the single-device step."""
    if mesh["dp"].get_local_rank() != 0:
        model.key_pad += 1
    return all_reduce_dp
