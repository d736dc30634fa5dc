"""The mechanisms transformers' MoE families met (docs/soundness.md, "Plans
traced from PyTorch", 109; tests/family_fit_models.py): (a) FSDP2's
gather of a one-row weight that "tp" cuts along its other dim (each dp
group's pieces of the rank's own columns) verifies, and a plan whose rank
receives the other tp rank's columns, or whose gradients FSDP2 averages,
FAILs; (b) a parameter ``[1, n]`` squeezed and added in the forward is no
optimizer op on flat ranges and verifies; (c) a family's casts to float32
read as float64 only when its float64 model fails on a dtype; (d) a value
read that a max's indices made is refused naming the max, its module and
the random draws feeding it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import check_no_value_reads
from backends.torch.lowering.read_origin import origin
from backends.torch.zoo.hf_float32 import Float32Read, reads_float32_wide
from harness.mutations import copy_plan
from harness.oracle import judge
from main import verify
from tests.family_fit_models import Float32Router

FITS = "tests.family_fit_models:"


def _plans(model: str, recipe: str, dp: int, tp: int):
    args = resolve(parser().parse_args(["--model", model, "--recipe", recipe,
                                        "--dp", str(dp), "--tp", str(tp)]))
    (plan_s, plan_p), _ = trace_and_build(args)
    return plan_s, plan_p


@pytest.fixture(scope="module")
def one_row_head():
    return _plans("backends.torch.stock_models:swiglu_regression",
                  FITS + "fsdp_tp_one_row_head", 2, 2)


def test_one_row_weight_cut_over_tp_under_fsdp_verifies(one_row_head) -> None:
    plan_s, plan_p = one_row_head
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    tid = next(k for k, lg in enumerate(plan_p.logical) if lg.name == "head.2.weight")
    held = {t.rank: t.slices for t in plan_p.tensors if t.tid == tid and t.mb == -1}
    assert held == {0: ((0, 1), (0, 8)), 1: ((0, 1), (8, 16))}  # dp 1's ranks hold no row


def test_one_row_weight_from_the_other_tp_rank_fails(one_row_head) -> None:
    """Rank 2 (dp 1, tp 0) receives the head's row from rank 1 (tp 1: the
    other columns, the same shape) instead of rank 0: wrong, and FAILs."""
    plan_s, plan_p = one_row_head
    bad = copy_plan(plan_p)
    found = [i for i, n in enumerate(bad.nodes) if n.op == "send_recv" and n.rank == 2
             and n.kwargs.get("src") == 0 and bad.tensors[n.outputs[0]].shape == (1, 8)]
    assert found
    for i in found:
        n = bad.nodes[i]
        sent = bad.tensors[n.inputs[0]]
        other = next(k for k, t in enumerate(bad.tensors) if t.rank == 1 and t.tid == sent.tid
                     and t.mb == sent.mb and t.version == sent.version)
        bad.nodes[i] = n._replace(inputs=(other,), kwargs={**n.kwargs, "src": 1})
    assert not judge(plan_s, bad).right
    assert not verify(plan_s, bad).success, "wrong SUCCESS"


def test_one_row_weight_averaged_over_dp_fails() -> None:
    plan_s, plan_p = _plans("backends.torch.stock_models:swiglu_regression",
                            FITS + "fsdp_tp_one_row_head_avg", 2, 2)
    assert not judge(plan_s, plan_p).right
    assert not verify(plan_s, plan_p).success, "wrong SUCCESS"


@pytest.mark.parametrize("recipe,right", [("backends.torch.stock_recipes:fsdp", True),
                                          ("backends.torch.scaling_recipes:fsdp_default", False)])
def test_squeezed_row_parameter_added_in_the_forward(recipe: str, right: bool) -> None:
    """``h + b.squeeze()`` of a ``[1, n]`` parameter is lowered by ``add``'s
    own handler (before: refused as an optimizer op on a flat range)."""
    plan_s, plan_p = _plans(FITS + "row_bias", recipe, 2, 1)
    assert judge(plan_s, plan_p).right == right
    verdict = verify(plan_s, plan_p)
    assert verdict.success == right, verdict.message


def test_float32_casts_read_wide_only_where_float64_fails() -> None:
    model = Float32Router()
    assert reads_float32_wide(model, 4)
    with pytest.raises(RuntimeError, match="dtype"):
        model.to(torch.float64)(torch.zeros((1, 4), dtype=torch.long))
    with Float32Read():
        out = model(torch.zeros((1, 4), dtype=torch.long))
    assert out.dtype == torch.float64

    class Casts(Float32Router):
        def forward(self, input_ids, use_cache=False):  # casts both: runs in float64 as it is
            return torch.nn.functional.linear(self.embed(input_ids).float(),
                                              self.router.weight.float())
    assert not reads_float32_wide(Casts(), 4)
    assert not reads_float32_wide(nn.Linear(2, 2), 4)  # no tensor kept in float32


def _event(op: str, reads: list[int], outs: list[int], scope: str = "m") -> tuple:
    return (op, ([("v", r) for r in reads], {}), outs, [], scope)


def _sampled_routing() -> dict:
    """Gumbel sampling as PhiMoE's sparsemixer: scores minus the log of
    exponential draws, their max's indices compared, the answer read."""
    events = [
        _event("aten.mm.default", [0, 10], [1], "router"),
        _event("aten.empty_like.default", [1], [2], "router"),
        _event("aten.exponential_.default", [2], [2], "router"),
        _event("aten.sub.Tensor", [1, 2], [3], "router"),
        _event("aten.max.dim", [3], [4, 5], "router"),
        _event("aten.eq.Scalar", [5], [6], "experts"),
        _event("aten._local_scalar_dense.default", [6], [], "experts"),
    ]
    return {"params": {"w": (0, (3, 4), [[], []])}, "events": events, "constants": []}


def test_a_value_read_names_the_indices_it_came_from() -> None:
    trace = _sampled_routing()
    assert origin(trace["events"], 6) == ("indices chosen by aten.max.dim at router of values "
                                          "drawn at random (aten.exponential_.default)")
    with pytest.raises(LoweringError, match="experts: Python reads indices chosen by "
                                            "aten.max.dim at router of values drawn at random"):
        check_no_value_reads(trace)


def test_a_value_read_of_no_choice_keeps_its_words() -> None:
    trace = _sampled_routing()
    trace["events"] = [_event("aten.sum.default", [0], [6], "m"), trace["events"][-1]]
    assert origin(trace["events"], 1) == ""
    with pytest.raises(LoweringError, match=r"\.item\(\), \.tolist\(\)"):
        check_no_value_reads(trace)
