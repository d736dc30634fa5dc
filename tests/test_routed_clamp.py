"""Clamped, compared and sliced rows gathered at a recorded routing index,
and a sum over them (docs/soundness.md, "Plans traced from PyTorch", 93):
each newly lowered op checked in float64 against torch on a tagger whose
clamps bind on a third of the entries (tests/routed_models.py), gpt_oss's
experts loop lowered against torch, and gpt_oss verifying at dp 2 and with
its expert-parallel plan while a rank routing one token otherwise FAILs.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backends.torch.__main__ import parser, trace_and_build
from backends.torch.errors import LoweringError
from backends.torch.lowering import lower_trace
from backends.torch.lowering.ir import Compare
from backends.torch.lowering.routed_rowwise import RowsOf
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run
from main import verify

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 12, "vocab": 10, "seqlen": 4}
#: the ops on gathered rows this file covers, each seen in the traced step
NEW_OPS = ("aten.clamp.default", "aten.slice.Tensor", "aten.slice_backward.default",
           "aten.sigmoid_backward.default", "aten.tanh_backward.default", "aten.ge.Scalar",
           "aten.le.Scalar", "aten.gt.Scalar", "aten.logical_and_.default", "aten.where.self",
           "aten.sum.dim_IntList", "aten.index_add_.default")


def _trace(model: str, sizes: dict, vocab: int) -> dict:
    spec = {"model": model, "model_kwargs": sizes, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 4, "seqlen": sizes["seqlen"], "vocab": vocab, "seed": 0, "parallel": False,
            "keep_values": True}
    return run(spec, 0)


def test_clamped_experts_lowering_matches_torch() -> None:
    trace = _trace("tests.routed_models:clamped_moe_tagger", SIZES, SIZES["vocab"])
    seen = {e[0] for e in trace["events"] if "experts" in (e[4] or "")}
    assert set(NEW_OPS) <= seen, set(NEW_OPS) - seen
    check = check_lowering(trace, lower_trace(trace, SIZES["vocab"]), SIZES["vocab"])
    assert {"experts.gate_up_bias", "experts.down_bias", "router.weight"} <= set(check.grads)
    assert not check.differences(rtol=1e-9, atol=1e-11)


def test_clamped_experts_verify_under_ddp() -> None:
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(
        ["--model", "tests.routed_models:clamped_moe_tagger", "--recipe",
         "backends.torch.stock_recipes:ddp", "--dp", "2", "--tp", "1", "--hidden", "8",
         "--ffn", "12", "--vocab", "10"]))
    assert verify(plan_s, plan_p).success


def test_gpt_oss_lowering_matches_torch() -> None:
    pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
    sizes = dict(layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)
    trace = _trace("backends.torch.hf:gpt_oss", sizes, 16)
    check = check_lowering(trace, lower_trace(trace, 16), 16)
    assert "hf.model.layers.0.mlp.experts.gate_up_proj_bias" in check.grads
    # its RMS norms and rotary angles are computed in float32
    assert not check.differences(rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mesh, wrong", [(["--dp", "2"], "token_to_other_expert"),
                                         (["--dp", "2", "--ep", "2"], "ep_token_to_other_expert")])
def test_gpt_oss_verifies_and_a_rerouted_token_fails(mesh: list[str], wrong: str) -> None:
    pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
    argv = ["--hf", "gpt_oss", "--tp", "1", *mesh]
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(argv))
    assert plan_s.world["routing"].startswith("router call 0: indices 16x2 sha256:")
    assert verify(plan_s, plan_p).success
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(
        [*argv, "--recipe", f"harness.moe_bugs:{wrong}"]))
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage", verdict.message


def test_a_comparison_of_gathered_rows_is_read_only_by_a_where() -> None:
    lw = SimpleNamespace(name="experts")
    pending = RowsOf(Compare(3, "ge", -7.0), np.array([0, 2]), 4)
    with pytest.raises(LoweringError, match="comparison of gathered rows"):
        pending.materialize(lw)
