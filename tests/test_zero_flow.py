"""Values that are zeros by the algebra of their making
(``backends/torch/lowering/zero_flow.py``; docs/soundness.md, "Plans traced
from PyTorch", 125 b): the backward of a placeholder row whose result is
cut to no rows, as transformers' ``AllToAllEP`` runs a rank's experts when
they receive no token, compared with PyTorch's values: the weights'
gradients are ``zeros`` nodes."""

from __future__ import annotations

import torch
from torch import nn

from backends.torch.lowering import lower_trace
from backends.torch.lowering.context import live_events
from backends.torch.lowering.zero_flow import zero_values
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"hidden": 4, "vocab": 10, "seqlen": 4}


class Placeholder(nn.Module):
    """Embedded tokens, and a weight run on a placeholder row (the sum of
    no rows) whose result is cut to no rows and added back as a sum over
    no rows: the weight's gradient is zeros."""

    def __init__(self, **_sizes: int):
        super().__init__()
        self.embed = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.expert = nn.Linear(SIZES["hidden"], 2 * SIZES["hidden"], bias=False)
        self.down = nn.Linear(SIZES["hidden"], SIZES["hidden"], bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(tokens)).reshape(-1, SIZES["hidden"])
        received = h[:0]  # the rows a rank's experts receive: none
        row = received.sum(dim=0, keepdim=True)  # the placeholder row
        gate, up = self.expert(row).chunk(2, dim=-1)
        out = self.down(nn.functional.silu(gate) * up) * torch.ones(1, 1)
        total = h + out[:0].sum(0)
        return (total * total).sum()


def placeholder(**sizes: int) -> Placeholder:
    return Placeholder(**sizes)


def _trace() -> dict:
    spec = {"model": f"{__name__}:placeholder", "model_kwargs": {}, "recipe": "", "dp": 1,
            "tp": 1, "pp": 1, "batch": 3, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"],
            "seed": 0, "parallel": False, "keep_values": True}
    return run(spec, 0)


def test_placeholder_backward_is_zeros_and_lowers_exactly() -> None:
    trace = _trace()
    zeros = zero_values(trace)
    made = {v: ev[0] for ev in trace["events"] for v in ev[2]}
    assert "aten.slice_backward.default" in {made[v] for v in zeros}, zeros
    assert "aten.mm.default" in {made[v] for v in zeros}  # the weights' gradients
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads, "no gradient was compared"
    differences = check.differences(rtol=1e-9, atol=1e-11)
    assert not differences, differences
    for name in ("expert.weight", "down.weight"):
        g = next(v for n, v in low.grads.items() if n.endswith(name))
        producer = next(n for n in low.nodes if g in n.outs)
        assert producer.op == "zeros", (name, producer.op)
    # the backward of the placeholder's silu is zeros, and the zeros made
    # of it read nothing: it is not lowered
    live = live_events(trace)
    backward = [i for i, ev in enumerate(trace["events"])
                if ev[0] == "aten.silu_backward.default"]
    assert backward and all(trace["events"][i][2][0] in zeros for i in backward)
    assert not set(backward) & live


def test_only_zeros_flow() -> None:
    """A product with a nonzero factor and zeros is zeros; a sum of zeros
    and a value, or a product of two values, is not."""
    shapes = [(2, 2)] * 6 + [(0, 2)]
    trace = {"shapes": shapes, "constants": set(), "constvals": {}, "events": [
        ("aten.slice_backward.default", ([("v", 6), [2, 2], 0, 0, 0, 1], {}), [1], [(2, 2)]),
        ("aten.mul.Tensor", ([("v", 1), ("v", 0)], {}), [2], [(2, 2)]),
        ("aten.add.Tensor", ([("v", 2), ("v", 0)], {}), [3], [(2, 2)]),
        ("aten.mm.default", ([("v", 0), ("v", 0)], {}), [4], [(2, 2)]),
        ("aten.add.Tensor", ([("v", 1), ("v", 2)], {}), [5], [(2, 2)]),
    ]}
    assert zero_values(trace) == {1, 2, 5}
