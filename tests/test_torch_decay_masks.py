"""``exp`` of scores masked with -inf (chunked linear attention's decay
mask, tests/decay_models.py; backends/torch/lowering/masks.py ``exp``): the
lowered single-device step equals PyTorch's loss and gradients in float64,
the hidden pairs weigh 0, and the model verifies under DDP while a plan
that leaves the decay's gradients unreduced FAILs (docs/soundness.md, "Plans
traced from PyTorch", 96)."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run
from main import verify

SIZES = {"layers": 1, "hidden": 4, "heads": 1, "ffn": 8, "vocab": 10, "seqlen": 4}
MODELS = ["tests.decay_models:decay_tagger", "tests.decay_models:causal_decay_tagger"]


@pytest.mark.parametrize("model", MODELS)
def test_lowering_matches_torch(model: str) -> None:
    spec = {"model": model, "model_kwargs": SIZES, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 2, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"], "seed": 0,
            "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    check = check_lowering(trace, lower_trace(trace, SIZES["vocab"]), SIZES["vocab"])
    assert check.grads and not check.differences(rtol=1e-9, atol=1e-11)


def _verdict(model: str, recipe: str) -> bool:
    args = resolve(parser().parse_args(
        ["--model", model, "--recipe", recipe, "--dp", "2", "--tp", "1", "--hidden", "4",
         "--vocab", "10", "--seqlen", "4", "--layers", "1"]))
    (plan_s, plan_p), _ = trace_and_build(args)
    return verify(plan_s, plan_p).success


@pytest.mark.parametrize("model", MODELS)
def test_decay_verifies_under_ddp(model: str) -> None:
    assert _verdict(model, "backends.torch.stock_recipes:ddp")


def test_decay_bias_unreduced_fails() -> None:
    assert not _verdict(MODELS[0], "harness.linear_attn_bugs:ddp_decay_unreduced")
