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


def test_hsdp_norm_counted_once_per_replica_fails_and_its_fix_verifies() -> None:
    """VeOmni PR 862: under HSDP (FSDP2 on a 2-D data-parallel mesh, two
    replicas of two shards) the ranks' local square sums all-reduced over
    every data-parallel rank count each shard once per replica; DTensor's
    own norm (the default clipper) verifies, and so does the PR's fix (the
    shard group only: scripts/run_torch_suite.sh -k 862)."""
    argv = ["--recipe", "hsdp", "--dp", "4", "--tp", "1", "--clip", "0.5"]
    (plan_s, plan_p), single = trace_and_build(resolve(parser().parse_args(argv)))
    assert verify(plan_s, plan_p).success
    assert judge(plan_s, plan_p).right
    assert any(n.op == "reduce_scatter" for n in plan_p.nodes)
    assert any(n.op == "all_reduce" and len(n.inputs) == 2 for n in plan_p.nodes)
    bug = argv + ["--clipper", "harness.torch_bugs:clip_hsdp_norm_all_dp"]
    (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(bug)), single)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage"
    assert not judge(plan_s, plan_p).right


def test_divide_factor_on_one_shard() -> None:
    """pytorch PR 167178: FSDP2 over shard groups of one rank (dp replicas),
    a float32 reduction and the divide factor dp for a per-rank mean loss.
    The installed torch divides (verifies); the shipped change ignored the
    factor (2 x every gradient). Reducing in float64 instead, the installed
    torch divides twice (1/2 x: FSDP2 pre- and post-divides, and the size-1
    branch divides again)."""
    argv = ["--model", "llama_mean", "--dp", "2", "--tp", "1", "--recipe"]
    (plan_s, plan_p), single = trace_and_build(resolve(parser().parse_args(argv + ["replicate_fp32"])))
    assert verify(plan_s, plan_p).success
    assert judge(plan_s, plan_p).right
    for recipe, factor in (("harness.torch_bugs:replicate_fp32_factor_ignored", "2 x"),
                           ("replicate_fp64", "1/2 x")):
        (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(argv + [recipe])), single)
        verdict = verify(plan_s, plan_p)
        assert not verdict.success and factor in verdict.message, recipe
        assert not judge(plan_s, plan_p).right, recipe


def test_expert_parallelism_and_expert_gradients_2x() -> None:
    """Expert parallelism over dp (backends/torch/zoo/moe.py) verifies; pytorch
    issue 160285: with a per-rank mean loss, the expert gradients left
    undivided by ep are 2 x at EP 2 (the fix ``ep_mean`` verifies); expert
    gradients summed over dp like the dense ones fail."""
    argv = ["--model", "backends.torch.moe:moe_mean", "--layers", "1", "--dp", "2", "--tp", "1",
            "--recipe"]
    (plan_s, plan_p), single = trace_and_build(
        resolve(parser().parse_args(argv + ["backends.torch.moe:ep_mean"])))
    assert verify(plan_s, plan_p).success
    assert judge(plan_s, plan_p).right
    bug = argv + ["harness.torch_bugs:ep_mean_experts_undivided"]
    (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(bug)), single)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success
    assert "2 x the gradient" in verdict.message and "feed_forward.w" in verdict.message
    assert not judge(plan_s, plan_p).right
    wrong = ["--model", "backends.torch.moe:moe", "--layers", "1", "--dp", "2", "--tp", "1",
             "--recipe", "harness.torch_bugs:ep_experts_summed_over_dp"]
    (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(wrong)))
    assert not verify(plan_s, plan_p).success
    assert not judge(plan_s, plan_p).right
