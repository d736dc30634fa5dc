"""A vocabulary-parallel lookup of ids the model computed (Megatron's
``VocabParallelEmbedding`` of the labels its multi-token prediction rolls,
``backends/torch/lowering/vocab_picks.py``), and values read for their
shape only (``backends/torch/lowering/context.py`` ``live_events``);
docs/soundness.md, "Plans traced from PyTorch", 49. The lookup
is written here without Megatron, on one device: the vocabulary in two
tables of half its rows, each looked up as a tensor-parallel rank does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.errors import LoweringError
from backends.torch.lowering import lower_trace
from backends.torch.lowering.context import live_events
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"hidden": 4, "vocab": 10, "seqlen": 4}
HALF = SIZES["vocab"] // 2


class HalvesLookup(nn.Module):
    """The labels rolled by -1 (the last position set to id 0), looked up
    in two tables of the vocabulary's rows ``[0, 5)`` and ``[5, 10)`` as a
    vocabulary-parallel embedding does: ids outside a table's rows masked
    to row 0, that row's output zeroed. ``zero_with``: the range whose mask
    zeroes the second table's output (its own, ``(5, 10)``, unless a
    mistake)."""

    def __init__(self, zero_with: tuple[int, int] = (HALF, 2 * HALF), **_sizes: int):
        super().__init__()
        self.embed = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.tables = nn.ModuleList(nn.Embedding(HALF, SIZES["hidden"]) for _ in range(2))
        self.zero_with = zero_with

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
        rolled.select(-1, -1).fill_(0)
        total = torch.zeros(())
        looked = None
        for k, table in enumerate(self.tables):
            lo, hi = k * HALF, (k + 1) * HALF
            mask = (rolled < lo) | (rolled >= hi)
            local = rolled.clone() - lo
            local[mask] = 0
            part = F.embedding(local, table.weight)
            zlo, zhi = (lo, hi) if k == 0 else self.zero_with
            part[(rolled < zlo) | (rolled >= zhi), :] = 0.0
            looked = part if looked is None else looked + part
        total = (torch.tanh(self.embed(tokens)) * looked).sum()
        # a value read for its shape only: its makers are not needed
        unused = torch.exp(self.embed(tokens))
        return total * torch.ones_like(unused).mean()


def halves(**sizes: int) -> HalvesLookup:
    return HalvesLookup(**sizes)


def halves_zeroed_by_another_range(**sizes: int) -> HalvesLookup:
    return HalvesLookup(zero_with=(0, HALF), **sizes)


def _single(model: str) -> dict:
    spec = {"model": f"{__name__}:{model}", "model_kwargs": {}, "recipe": "", "dp": 1, "tp": 1,
            "pp": 1, "batch": 3, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"], "seed": 0,
            "parallel": False, "keep_values": True}
    return run(spec, 0)


def test_a_vocabulary_parallel_lookup_of_rolled_ids_lowers_exactly() -> None:
    trace = _single("halves")
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert {"tables.0.weight", "tables.1.weight"} <= set(check.grads)
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences


def test_a_lookup_zeroed_with_another_ranges_mask_is_refused() -> None:
    trace = _single("halves_zeroed_by_another_range")
    with pytest.raises(LoweringError, match="not zeroed outside the shard's rows"):
        lower_trace(trace, SIZES["vocab"])


def test_a_value_read_for_its_shape_only_is_not_needed() -> None:
    trace = _single("halves")
    live = live_events(trace)
    exps = [i for i, e in enumerate(trace["events"]) if e[0] == "aten.exp.default"]
    assert exps, "the traced step has no exp"
    assert not live.intersection(exps)
