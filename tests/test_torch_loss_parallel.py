"""DTensor's ``loss_parallel()`` cross-entropy, traced and verified
(backends/torch/lower_vocab_parallel.py): the logits stay sharded along the
vocabulary; the plan verifies and the oracle agrees. A stabilizing shift
that is not the all-reduced row maximum (a rank's own maximum, or the
maxima summed) FAILs (docs/soundness.md, "Plans traced from PyTorch", 7a),
and so does the loss-parallel plan with torchtitan PR 3412's relabelled
Partial gradients."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from harness.oracle import judge
from main import verify

ARGS = ["--dp", "1", "--tp", "2", "--batch", "2"]


def _plans(recipe: str, single=None, extra=()):
    args = resolve(parser().parse_args(["--recipe", recipe, *ARGS, *extra]))
    return trace_and_build(args, single)


@pytest.fixture(scope="module")
def verified():
    (plan_s, plan_p), single = _plans("tp_sp_loss_parallel")
    return plan_s, plan_p, single


def test_loss_parallel_verifies(verified) -> None:
    plan_s, plan_p, _ = verified
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    ops = [(n.op, n.group is not None) for n in plan_p.nodes]
    assert ("all_gather", True) in ops and ("max", False) in ops  # the MAX all-reduce, folded
    assert judge(plan_s, plan_p).right


@pytest.mark.parametrize("mistake", ["loss_parallel_local_max", "loss_parallel_sum_max"])
def test_a_shift_other_than_the_global_maximum_fails(verified, mistake: str) -> None:
    _, _, single = verified
    (plan_s, plan_p), _ = _plans(f"harness.loss_parallel_mistakes:{mistake}", single)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage", verdict.message
    assert "max" in verdict.message or "Llama" in verdict.message
