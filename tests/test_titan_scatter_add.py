"""torchtitan's ``deterministic_scatter_add`` given its meaning once, as
``out.scatter_add(0, index, src)`` by every rule of that op
(``lowering/titan_ops.py``; docs/soundness.md, "Plans traced from
PyTorch", 112): lowered against torch in float64 (the grouped GEMMs in
float32) for grouped rows with a scaled bias combined at their tokens, and
for computed rows added into zeros at a fixed index that repeats rows;
a rank's plan that routes rows elsewhere FAILs."""

from __future__ import annotations

import random

from backends.torch.__main__ import parser, trace_and_build
from backends.torch.lowering import lower_trace
from backends.torch.lowering.registry import handlers
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run
from main import verify

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 8, "vocab": 10, "seqlen": 4}
OP = "torchtitan.deterministic_scatter_add.default"


def _checked(model: str, rtol: float) -> None:
    spec = {"model": model, "model_kwargs": SIZES, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 4, "seqlen": 4, "vocab": 10, "seed": 0, "parallel": False,
            "keep_values": True}
    trace = run(spec, 0)
    assert OP in {e[0] for e in trace["events"]}
    low = lower_trace(trace, 10)
    check = check_lowering(trace, low, 10)
    assert check.grads
    assert not check.differences(rtol=rtol, atol=1e-8)


def test_the_op_has_a_handler() -> None:
    assert OP in handlers()


def test_grouped_rows_with_a_scaled_bias_combined_match_torch() -> None:
    _checked("tests.titan_scatter_models:titan_combined_tagger", 1e-5)  # float32 grouped GEMMs


def test_rows_added_into_zeros_at_a_repeating_index_match_torch() -> None:
    _checked("tests.titan_scatter_models:scattered_tagger", 1e-9)


def test_grouped_combine_verifies_and_other_routings_fail() -> None:
    from harness.mutations import other_routing
    from harness.oracle import judge
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(
        ["--model", "tests.titan_scatter_models:titan_combined_tagger", "--recipe",
         "backends.torch.stock_recipes:ddp", "--dp", "2", "--tp", "1", "--hidden", "8",
         "--ffn", "8", "--vocab", "10"]))
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    mutant, what = other_routing(plan_p, random.Random("routing/0"))
    assert not judge(plan_s, mutant).right, what
    verdict = verify(plan_s, mutant)
    assert not verdict.success and verdict.kind != "internal", what
