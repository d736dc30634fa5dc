"""Rows gathered at an index naming every row, put back (docs/soundness.md,
"Plans traced from PyTorch", 121 a): the row mask, all ones, is written
as the rows' other puts write it, so a rank whose tokens all route to one
expert writes the single-device step's node for that expert.

A tagger whose router sends every token to expert 0 in its first slot
(``x[token]`` at every row, ``index_add_`` back, and the gather's backward
at every row) is lowered against torch and verified under DDP; deepseek_v2
at dp 2 tp 2, whose rank 2 routes all its tokens to expert 3, verifies
(gloo same) and its averaged FSDP plan FAILs."""

from __future__ import annotations

import pytest
import torch

from backends.torch.__main__ import parser, trace_and_build
from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run
from main import verify
from tests.cli_pair import suite_cases
from tests.routed_models import ClampedMoeTagger

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 12, "vocab": 10, "seqlen": 4}


def one_expert_tagger(**kw) -> ClampedMoeTagger:
    """The clamped tagger with its router's bias favouring expert 0 by far:
    every token's first choice."""
    model = ClampedMoeTagger(**kw)
    with torch.no_grad():
        model.router.bias.copy_(torch.tensor([50.0, 0.0, 0.0, -50.0]))
    return model


def _ops(lowered) -> list[str]:
    return [n.op for n in lowered.nodes]


def test_every_row_put_back_lowering_matches_torch() -> None:
    spec = {"model": "tests.test_every_row_put_back:one_expert_tagger", "model_kwargs": SIZES,
            "recipe": "", "dp": 1, "tp": 1, "pp": 1, "batch": 4, "seqlen": SIZES["seqlen"],
            "vocab": SIZES["vocab"], "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    gathered = [e for e in trace["events"] if e[0] == "aten.index.Tensor" and "experts" in (e[4] or "")]
    assert gathered, "the experts loop gathers rows"
    lowered = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, lowered, SIZES["vocab"])
    assert {"experts.gate_up", "experts.down", "router.weight"} <= set(check.grads)
    assert not check.differences(rtol=1e-9, atol=1e-11)


def test_every_row_put_back_verifies_under_ddp() -> None:
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(
        ["--model", "tests.test_every_row_put_back:one_expert_tagger", "--recipe",
         "backends.torch.stock_recipes:ddp", "--dp", "2", "--tp", "1", "--hidden", "8",
         "--ffn", "12", "--vocab", "10"]))
    assert verify(plan_s, plan_p).success


def test_deepseek_v2_dp2_tp2_suite_cases() -> None:
    pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
    done = suite_cases("moe hf deepseek_v2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 as expected" in done.stdout
