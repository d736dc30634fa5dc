"""A row per group of a grouped GEMM and grouped rows kept grouped through
columns and comparisons (docs/soundness.md, "Plans traced from PyTorch",
104): a tagger whose experts run as torchtitan's gpt_oss runs them
(tests/grouped_bias_models.py) lowered against torch (its grouped GEMMs in
float32, the only CPU types of ``torch._grouped_mm``; the rest float64),
its data-parallel step verifying while other routings FAIL, and the rules'
cases on small arrays."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from backends.torch.__main__ import parser, trace_and_build
from backends.torch.lowering import lower_trace
from backends.torch.lowering.grouped_columns import ExpertsOf, grouped_entries
from backends.torch.lowering.grouped_rows import Experts
from backends.torch.lowering.ir import Compare, Zeros
from backends.torch.lowering.per_group import ZeroRows, slice_rows
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run
from main import verify

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 8, "vocab": 10, "seqlen": 4}
MODEL = "tests.grouped_bias_models:biased_grouped_tagger"
#: the ops on grouped rows the rules take, each seen in the traced step
OPS = ("aten._grouped_mm.default", "aten.index_select.default", "aten.index_add.default",
       "aten.slice.Tensor", "aten.slice_backward.default", "aten.ge.Scalar", "aten.le.Scalar",
       "aten.logical_and_.default", "aten.where.self", "aten.clamp.default")


def test_biased_grouped_experts_lowering_matches_torch() -> None:
    spec = {"model": MODEL, "model_kwargs": SIZES, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 4, "seqlen": 4, "vocab": 10, "seed": 0, "parallel": False,
            "keep_values": True}
    trace = run(spec, 0)
    seen = {e[0] for e in trace["events"] if "experts" in (e[4] or "")}
    assert set(OPS) <= seen, set(OPS) - seen
    low = lower_trace(trace, 10)
    check = check_lowering(trace, low, 10)
    assert {"experts.b1", "experts.b2", "experts.w1", "router.weight"} <= set(check.grads)
    assert not check.differences(rtol=1e-5, atol=1e-8)  # float32 grouped GEMMs
    # the biases' zero row is read by no node: its cat is left out
    cats = [n for n in low.nodes if n.op == "cat" and "experts" in n.name]
    assert not cats, [n.ins for n in cats]


def test_biased_grouped_experts_verify_and_other_routings_fail() -> None:
    from harness.mutations import other_routing
    from harness.oracle import judge
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(
        ["--model", MODEL, "--recipe", "backends.torch.stock_recipes:ddp", "--dp", "2", "--tp",
         "1", "--hidden", "8", "--ffn", "8", "--vocab", "10"]))
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    for k in range(2):
        mutant, what = other_routing(plan_p, random.Random(f"routing/{k}"))
        assert not judge(plan_s, mutant).right, what
        verdict = verify(plan_s, mutant)
        assert not verdict.success and verdict.kind != "internal", what


def _lowerer(env: dict, shapes: dict, event: tuple) -> SimpleNamespace:
    return SimpleNamespace(env=env, name="experts", shapes=shapes, next_id=0,
                           trace={"shapes": [], "events": [event]}, event=0)


def _never(*args, **kwargs):
    raise AssertionError("handed on to the base rule")


def test_a_slice_of_the_summed_rows_reads_the_sums_and_past_them_zeros() -> None:
    lw = _lowerer({1: ZeroRows(7, 5)}, {7: (4, 3)}, ("aten.slice.Tensor",))
    assert slice_rows(_never)(lw, [("v", 1), 0, 0, 4], {}, [(4, 3)], None) == 7
    past = slice_rows(_never)(lw, [("v", 1), 0, 4, 5], {}, [(1, 3)], None)
    assert isinstance(past, Zeros) and past.shape == (1, 3)
    handed = []
    slice_rows(lambda *a: handed.append(a) or "base")(lw, [("v", 1), 0, 1, 3], {}, [(2, 3)], None)
    assert handed  # a slice across both: the materialized cat


def test_a_comparison_of_grouped_rows_is_kept_grouped() -> None:
    grouped = Experts(7, np.array([0, 0, 1]), np.array([2, 0, 1]))
    event = ("aten.ge.Scalar",)
    lw = _lowerer({1: grouped}, {7: (2, 3, 4)}, event)
    seen = []

    def base(lw, args, kwargs, shapes, group):
        seen.append((lw.env[args[0][1]], shapes))
        return Compare(lw.env[args[0][1]], "ge", args[1])

    out = grouped_entries(base)(lw, [("v", 1), -7.0], {}, [(3, 4)], None)
    assert isinstance(out, ExpertsOf) and out.wide == (2, 3, 4)
    assert seen == [(7, [(2, 3, 4)])]  # on every group's result for every row
    with pytest.raises(Exception, match="read other than by a where"):
        out.materialize(lw)


def test_a_slice_of_the_rows_dim_is_handed_on() -> None:
    grouped = Experts(7, np.array([0, 1]), np.array([0, 1]))
    lw = _lowerer({1: grouped}, {7: (2, 2, 4)}, ("aten.slice.Tensor",))
    handed = []
    grouped_entries(lambda *a: handed.append(a) or "base")(lw, [("v", 1), 0, 0, 1], {},
                                                             [(1, 4)], None)
    assert handed


def test_the_group_sums_span_the_grouped_gemms_groups_not_the_last_reached() -> None:
    from backends.torch.lowering.per_group import record_groups, sum_rows
    lw = SimpleNamespace(grouped_groups=[], shapes={7: (8, 5, 3)})
    groups = np.array([0, 0, 3, 6, 6])  # the rows reach group 6 of 8
    made = record_groups(lambda *a: Experts(7, groups, np.arange(5)))(lw, [], {}, [], None)
    assert isinstance(made, Experts) and lw.grouped_groups[0][1] == 8
    assert sum_rows(lw, groups) == 8  # the GEMM's 8 groups, as on every rank
    assert sum_rows(lw, np.array([0, 1, 3, 6, 6])) == 7  # no GEMM's groups: the last reached
    record_groups(lambda *a: "rows")(lw, [], {}, [], None)  # no grouped rows: nothing recorded
    assert len(lw.grouped_groups) == 1
