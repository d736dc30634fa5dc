"""DTensor's ``loss_parallel()`` cross-entropy, traced and verified
(backends/torch/lowering/vocab_parallel.py): the logits stay sharded along the
vocabulary; the plan verifies and the oracle agrees. A stabilizing shift
that is not the all-reduced row maximum (a rank's own maximum, or the
maxima summed) FAILs (docs/soundness.md, "Plans traced from PyTorch", 7a),
and so does the loss-parallel plan with torchtitan PR 3412's relabelled
Partial gradients."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build, trace_ranks
from backends.torch.lowering import LoweringError, lower_trace
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
    ops = {n.op for n in plan_p.nodes if n.name == "Llama"}
    assert {"all_gather", "max", "exp", "log"} <= ops  # the MAX all-reduce as gather and max
    assert judge(plan_s, plan_p).right


@pytest.mark.parametrize("mistake,wrong", [("loss_parallel_local_max", True),
                                           ("loss_parallel_sum_max", False)])
def test_a_shift_other_than_the_global_maximum_fails(verified, mistake: str, wrong: bool) -> None:
    """A rank's own maximum is a real error; the maxima summed shift every
    rank by the same amount, which cancels in exact arithmetic (the oracle
    finds the plans equal): a documented false alarm, never a missed bug."""
    _, _, single = verified
    (plan_s, plan_p), _ = _plans(f"harness.loss_parallel_mistakes:{mistake}", single)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage", verdict.message
    failed = [r for r in verdict.results if r.outcome.status == "counterexample"]
    assert failed and all(plan_s.nodes[r.stage.gs_node].op == "max" for r in failed)
    assert judge(plan_s, plan_p).right is not wrong


def test_target_logits_not_zeroed_outside_the_shard_are_refused() -> None:
    """The gather of a loss-parallel rank equals the one-hot pick only once
    the picks outside its vocabulary rows are zeroed: a run that writes
    anything else there is refused, never lowered as if it were zeroed."""
    spec = {"model": "backends.torch.models:llama",
            "model_kwargs": {"layers": 1, "hidden": 16, "heads": 4, "ffn": 32, "vocab": 16,
                             "seqlen": 4},
            "recipe": "backends.torch.recipes:tp_sp_loss_parallel", "dp": 1, "tp": 2, "pp": 1,
            "batch": 2, "seqlen": 4, "vocab": 16, "seed": 0, "parallel": True}
    trace = trace_ranks(spec, 2)[0]
    events = trace["events"]
    gathered = {outs[0] for op, _, outs, *_ in events if op == "aten.gather.default"}
    zeroing = [i for i, (op, (args, _), *_) in enumerate(events)
               if op == "aten.index_put_.default" and args[0][1] in gathered]
    assert len(zeroing) == 1
    op, (args, kwargs), *rest = events[zeroing[0]]
    events[zeroing[0]] = (op, ([args[0], args[1], 1.0, *args[3:]], kwargs), *rest)
    with pytest.raises(LoweringError, match="not zeroed"):
        lower_trace(trace, 16)
