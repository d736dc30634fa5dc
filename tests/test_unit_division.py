"""An out-of-place division by exactly 1 is its dividend (docs/soundness.md,
"Plans traced from PyTorch", 119): lowered as no node, so a single-device
step that divides by a tensor-parallel degree of 1 (torchtitan 0.3.0's
``ScaledBiasRowwiseLinear``: ``bias / tp``) and a rank that divides in the
forward only read one gradient; torchtitan's gpt_oss under its own TP plan
with that bias divided in the forward only verifies, as shipped (its
gradient divided too) it still FAILs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run
from tests.cli_pair import suite_cases

SIZES = {"layers": 1, "hidden": 4, "heads": 1, "ffn": 4, "vocab": 6, "seqlen": 3}


class UnitDivided(nn.Module):
    """A tagger whose projection's bias is divided by 1 (a tensor and a
    Python number), out of place, and whose hidden rows are halved in
    place and divided by 1 in place."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int,
                 seqlen: int) -> None:
        super().__init__()
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        bias = self.proj.bias / 1
        h = torch.tanh(F.linear(h, self.proj.weight, bias / torch.tensor(1.0, dtype=h.dtype)))
        h = h * 2.0
        h.div_(1)
        logits = self.head(h)
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def unit_divided(**kw) -> UnitDivided:
    return UnitDivided(**kw)


def _lowered():
    spec = {"model": "tests.test_unit_division:unit_divided", "model_kwargs": SIZES,
            "recipe": "", "dp": 1, "tp": 1, "pp": 1, "batch": 2, "seqlen": 3, "vocab": 6,
            "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    return trace, lower_trace(trace, 6)


def test_out_of_place_division_by_one_is_no_node_and_matches_torch() -> None:
    trace, low = _lowered()
    check = check_lowering(trace, low, 6)
    assert {"proj.bias", "proj.weight"} <= set(check.grads)
    assert not check.differences(rtol=1e-9, atol=1e-12)
    by_one = [n for n in low.nodes if n.op == "div" and n.kwargs.get("value") == 1.0]
    # only the in-place div_ keeps its node; the bias's divisions (by a number
    # and by a tensor) and every backward division by 1 (out of place) are none
    assert len(by_one) == 1, [(n.name, n.dir) for n in by_one]
    assert [n.kwargs["value"] for n in low.nodes if n.op == "div" and n is not by_one[0]] \
        == [6.0, 6.0]  # the loss's mean, and its backward


def test_gpt_oss_tp_bias_divided_in_the_forward_verifies_as_shipped_fails() -> None:
    done = suite_cases("moe titan gpt_oss tp2 its rowwise bias divided in the forward only",
                       "moe titan gpt_oss tp2 attention.wo.bias gradient 1/tp")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
