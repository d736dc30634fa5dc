"""Ids rolled along the sequence and overwritten at a position
(``backends/torch/lowering/ids.py``: ``roll``, ``fill``, ``partial_write``),
as Megatron's multi-token prediction shifts its labels (``roll_tensor``:
``torch.roll`` by -1, then the last position's id set to 0 and masked),
written here without Megatron and compared with PyTorch's values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.torch.errors import LoweringError
from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"hidden": 4, "vocab": 10, "seqlen": 4}


class RolledLabels(nn.Module):
    """A loss at the labels rolled by ``shift`` along the sequence (a
    table's rows at them), the position that wrapped around set to id
    ``fill`` and masked out, with a mask of the labels other than the
    last id rolled alike."""

    def __init__(self, shift: int = -1, fill: int = 0, **_sizes: int):
        super().__init__()
        self.embed = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.target = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.shift, self.fill = shift, fill

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        wrapped = -1 if self.shift < 0 else 0
        rolled = torch.roll(labels, shifts=self.shift, dims=-1)
        rolled.select(-1, wrapped).fill_(self.fill)
        kept = (labels < SIZES["vocab"] - 1).to(torch.float64)
        mask = torch.roll(kept, shifts=self.shift, dims=-1)
        mask.select(-1, wrapped).fill_(0)
        if 0 <= self.fill < SIZES["vocab"]:
            per_token = (torch.tanh(self.embed(tokens)) * self.target(rolled)).sum(-1)
        else:  # ids no table has a row for: read by a comparison only
            per_token = torch.tanh(self.embed(tokens)).sum(-1) * (rolled < 5).to(torch.float64)
        return (per_token * mask).sum() / (mask.sum() + 1.0)


def rolled_back(**sizes: int) -> RolledLabels:
    return RolledLabels(**sizes)


def rolled_forward(**sizes: int) -> RolledLabels:
    return RolledLabels(shift=1, fill=3, **sizes)


def filled_outside(**sizes: int) -> RolledLabels:
    return RolledLabels(fill=-100, **sizes)


def _single(model: str) -> dict:
    spec = {"model": model, "model_kwargs": {}, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 3, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"], "seed": 0,
            "parallel": False, "keep_values": True}
    return run(spec, 0)


@pytest.mark.parametrize("model", ["rolled_back", "rolled_forward"])
def test_rolled_and_overwritten_ids_lower_exactly(model: str) -> None:
    trace = _single(f"{__name__}:{model}")
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads, "no gradient was compared"
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences


def test_ids_filled_with_a_number_outside_the_vocabulary_are_refused() -> None:
    trace = _single(f"{__name__}:filled_outside")
    with pytest.raises(LoweringError, match="only an id of the vocabulary"):
        lower_trace(trace, SIZES["vocab"])
