"""Gradient norms as trainers compute them for clipping (tests/norm_clippers.py):
the pieces every tensor-parallel rank holds alike counted on tp rank 0 only,
with one all-reduce or two, from a zero accumulator, over tp or over the
flattened dp x tp group, verify; counting them once per tp rank (NeMo-RL PR
3788), leaving the square sum unreduced, or summing dp replicas' squares
fail at the square sum with a counterexample (scripts/gloo_truth.py
agrees: docs/torch-backend.md, "Gradient norms as trainers write them")."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from main import verify

CLIP = ["--model", "llama", "--clip", "0.5", "--clipper"]


def _verdict(recipe: str, clipper: str, dp: int = 2, singles: dict = {}):  # noqa: B006
    argv = [*CLIP, f"tests.norm_clippers:{clipper}", "--recipe", recipe, "--dp", str(dp),
            "--tp", "2"]
    args = resolve(parser().parse_args(argv))
    (plan_s, plan_p), singles[dp] = trace_and_build(args, singles.get(dp))
    return verify(plan_s, plan_p)


@pytest.mark.parametrize("recipe, clipper", [
    ("tp_sp", "clip_tp_rank0"), ("fsdp_tp", "clip_tp_rank0"),
    ("tp_sp", "clip_tp_two_reduces"), ("fsdp_tp", "clip_tp_accumulated"),
    ("fsdp_tp", "clip_stacked_norms_flat_group")])
def test_trainers_norms_verify(recipe: str, clipper: str) -> None:
    assert _verdict(recipe, clipper).success


def test_accumulated_norm_on_tp_alone_verifies() -> None:
    assert _verdict("tp_sp", "clip_tp_accumulated", dp=1).success


@pytest.mark.parametrize("recipe, clipper", [
    ("tp_sp", "clip_tp_counted_per_rank"), ("fsdp_tp", "clip_tp_counted_per_rank"),
    ("tp_sp", "clip_tp_not_reduced"), ("tp_sp", "clip_pow_sum_flat_group_unsharded")])
def test_miscounted_norms_fail_with_a_counterexample(recipe: str, clipper: str) -> None:
    verdict = _verdict(recipe, clipper)
    assert not verdict.success and verdict.kind == "stage"
    assert any(r.outcome.status == "counterexample" for r in verdict.failed)
