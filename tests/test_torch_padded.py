"""FSDP2's padded shards of a one-row parameter: the regression head
``nn.Linear(h, 1)`` (weight ``[1, h]``, bias ``[1]``) under ``fully_shard``
over two ranks lives on the group's first rank, padded on the other
(docs/soundness.md, "Plans traced from PyTorch", 14). The plans verify and
the oracle agrees; a gradient of the head left un-reduced, or averaged
where FSDP sums, fails; FSDP's default divide factor verifies on a
per-rank mean and fails on a shared-out loss, as the real gloo runs do
(scripts/gloo_truth.py); other padded shards are still refused."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.lower import LoweringError
from harness.mutations import copy_plan
from harness.oracle import judge
from main import verify
from verdict.plan import Node

MODELS = "backends.torch.stock_models:"
STOCK = "backends.torch.stock_recipes:"
SCALING = "backends.torch.scaling_recipes:"
HEAD = ("head.2.weight", "head.2.bias")


def _plans(model: str, recipe: str, *extra: str):
    args = resolve(parser().parse_args(["--model", MODELS + model, "--recipe", recipe,
                                        "--dp", "2", "--tp", "1", *extra]))  # later flags win
    (plan_s, plan_p), _ = trace_and_build(args)
    return plan_s, plan_p


@pytest.fixture(scope="module")
def fsdp_plans():
    return _plans("swiglu_regression", STOCK + "fsdp")


def _tid(plan_p, name: str) -> int:
    return next(k for k, lg in enumerate(plan_p.logical) if lg.name == name)


def _head_reductions(plan_p) -> list[int]:
    """The all-reduces that give rank 0 the head's gradients (FSDP reduces
    every other gradient with a reduce-scatter)."""
    found = [i for i, n in enumerate(plan_p.nodes) if n.op == "all_reduce" and n.rank == 0]
    assert sorted(plan_p.tensors[plan_p.nodes[i].outputs[0]].shape for i in found) == [(1,), (1, 16)]
    return found


def test_one_row_head_under_fsdp_verifies(fsdp_plans) -> None:
    plan_s, plan_p = fsdp_plans
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    for name in HEAD:
        tid = _tid(plan_p, name)
        held = {t.rank for t in plan_p.tensors if t.tid == tid and t.mb == -1}
        assert held == {0}  # rank 1 holds no row of it: no input, no gradient
    assert any(n.op == "send_recv" for n in plan_p.nodes)


@pytest.mark.parametrize("wrong", ["local", "avg"])
def test_head_gradient_not_summed_fails(fsdp_plans, wrong: str) -> None:
    """Rank 0 keeps its own gradient of the head (``local``), or averages it
    over the group where FSDP (divide factor 1) sums it (``avg``): the
    oracle finds the plan wrong and the verifier fails."""
    plan_s, plan_p = fsdp_plans
    bad = copy_plan(plan_p)
    for i in _head_reductions(bad):
        n = bad.nodes[i]
        if wrong == "local":
            own = n.inputs[n.kwargs["index"]]
            bad.nodes[i] = Node(n.rank, n.mb, "div", n.dir, (own,), n.outputs, {"value": 1.0},
                                n.name)
        else:
            bad.nodes[i] = n._replace(op="all_reduce_avg")
    assert not judge(plan_s, bad).right
    verdict = verify(plan_s, bad)
    assert not verdict.success, "wrong SUCCESS"


def test_default_divide_factor(fsdp_plans) -> None:
    """FSDP2's default factor (the group size) on a per-rank mean verifies;
    on the shared-out loss it divides twice and fails, as the real run."""
    plan_s, plan_p = _plans("swiglu_regression_mean", SCALING + "fsdp_default")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    plan_s, plan_p = _plans("swiglu_regression", SCALING + "fsdp_default")
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and "1/2 x the gradient" in verdict.message


def test_one_row_head_with_an_optimizer_step_verifies() -> None:
    plan_s, plan_p = _plans("swiglu_regression", STOCK + "fsdp", "--optimizer", "adamw")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message


def test_one_row_head_under_hsdp_verifies() -> None:
    """HSDP (two replicas of two shards): the first rank of each shard group
    holds the row; its gradient is summed over its shard group, then over
    the replicas (left out, rank 0 ends with a partial sum: a FAIL)."""
    plan_s, plan_p = _plans("swiglu_regression", STOCK + "hsdp", "--dp", "4")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    tid = _tid(plan_p, "head.2.weight")
    assert {t.rank for t in plan_p.tensors if t.tid == tid and t.mb == -1} == {0, 2}
    bad = copy_plan(plan_p)
    reduces = [i for i, n in enumerate(bad.nodes) if n.op == "all_reduce" and n.rank == 0
               and bad.tensors[n.outputs[0]].shape == (1, 16)]
    assert len(reduces) == 2  # over the shard group, then over the replicas
    n = bad.nodes[reduces[1]]
    bad.nodes[reduces[1]] = Node(n.rank, n.mb, "div", n.dir, (n.inputs[n.kwargs["index"]],),
                                 n.outputs, {"value": 1.0}, n.name)
    assert not judge(plan_s, bad).right
    assert not verify(plan_s, bad).success, "wrong SUCCESS"


def test_other_padded_shards_are_refused() -> None:
    with pytest.raises(LoweringError, match="embed.weight .* sharded unevenly"):
        _plans("mlp", STOCK + "fsdp", "--vocab", "15")
