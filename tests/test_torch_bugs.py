"""Shipped bugs written on the traced code paths (harness/torch_bugs.py): each
fails at the fault; its fix is the recipe it was written from, which
verifies (tests/test_torch_backend.py, tests/test_torch_compositions.py)."""

from __future__ import annotations

from backends.torch.__main__ import parser, resolve, trace_and_build
from harness.oracle import judge
from main import verify


def test_loss_normalized_by_local_token_counts_fails() -> None:
    """Megatron-LM issue 7452, finding 3: every rank's loss is dp times its
    share, so the loss pieces of the replicas do not sum to the loss."""
    args = resolve(parser().parse_args(["--recipe", "harness.torch_bugs:tp_sp_local_token_mean"]))
    (plan_s, plan_p), _ = trace_and_build(args)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success
    assert not judge(plan_s, plan_p).right


def test_clipping_by_the_stage_norm_fails_and_its_fix_verifies() -> None:
    """torchtitan issue 596: each pipeline stage clips by its own norm; the
    fix of PR 649 (the stages' squared norms all-reduced over "pp")."""
    argv = ["--recipe", "pp_gpipe", "--pp", "2", "--dp", "1", "--tp", "1", "--layers", "2",
            "--clip", "0.5", "--optimizer", "adamw"]
    (plan_s, plan_p), single = trace_and_build(resolve(parser().parse_args(argv)))
    assert verify(plan_s, plan_p).success
    assert judge(plan_s, plan_p).right
    bug = argv + ["--clipper", "harness.torch_bugs:clip_stage_norm"]
    (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(bug)), single)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage"
    assert not judge(plan_s, plan_p).right
