"""Readers of a tensor of no entries (``backends/torch/lowering/
no_entries.py``; docs/soundness.md, "Plans traced from PyTorch", 110 (a)):
an ``index_add`` or ``index_put`` of no rows is its target, a product or a
sum over a dim of size 0 is zeros, each compared with PyTorch's values."""

from __future__ import annotations

import torch
from torch import nn

from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"hidden": 4, "vocab": 10, "seqlen": 4}


class NoRowsAdded(nn.Module):
    """Embedded tokens plus the rows of an empty selection, added back at
    no index and put at no index; a weight multiplied by no rows."""

    def __init__(self, **_sizes: int):
        super().__init__()
        self.embed = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.proj = nn.Linear(SIZES["hidden"], SIZES["hidden"], bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(tokens)).reshape(-1, SIZES["hidden"])
        none = h.new_zeros((0, SIZES["hidden"]))
        index = torch.zeros(0, dtype=torch.long)
        added = h.index_add(0, index, none)
        put = added.index_put((index,), none, accumulate=True)
        weight_of_none = none.t() @ none  # a contraction over no rows: zeros
        total = put + self.proj(put) + weight_of_none.sum() + none.sum(0)
        return (total * total).sum()


def no_rows_added(**sizes: int) -> NoRowsAdded:
    return NoRowsAdded(**sizes)


def test_readers_of_no_rows_lower_exactly() -> None:
    spec = {"model": f"{__name__}:no_rows_added", "model_kwargs": {}, "recipe": "", "dp": 1,
            "tp": 1, "pp": 1, "batch": 3, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"],
            "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads, "no gradient was compared"
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences
