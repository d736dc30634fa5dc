"""A rank's node that combines values no single-device node combines (the
even and odd halves of a strided view written back swapped on one rank,
tests/strided_mistakes.py) is claimed to be the nearest single-device node,
and that claim is refuted: the step FAILs at the rank's node with a
counterexample, where it was refused before (docs/soundness.md, "Plans
traced from PyTorch", 94). The correct steps still verify."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from main import verify

MODELS = "tests.strided_models:"
MISTAKES = "tests.strided_mistakes:"
DP2 = ["--dp", "2", "--tp", "1"]


def _verdict(model: str, recipe: str, mesh: list[str]):
    args = resolve(parser().parse_args(["--model", MODELS + model, "--recipe", recipe, *mesh]))
    (plan_s, plan_p), _ = trace_and_build(args)
    return plan_s, verify(plan_s, plan_p)


@pytest.mark.parametrize("model, recipe, mesh, op", [
    ("interleaved_rope", "ddp_avg_swapped_on_rank_0", DP2, "cat"),
    ("interleaved_rope", "fsdp_swapped_on_rank_0", DP2, "cat"),
    ("copy_into_strided", "ddp_avg_swapped_on_rank_0", DP2, "narrow"),
    ("pair_gated", "tp_mlp_avg_swapped_on_rank_0", ["--dp", "1", "--tp", "2"], "cat")])
def test_halves_swapped_on_one_rank_fail_at_the_rank(model: str, recipe: str,
                                                     mesh: list[str], op: str) -> None:
    plan_s, verdict = _verdict(model, MISTAKES + recipe, mesh)
    assert not verdict.success and verdict.kind == "stage"
    failed = verdict.failed[0]
    assert failed.outcome.status == "counterexample"
    assert plan_s.nodes[failed.stage.gs_node].op == op
    assert plan_s.nodes[failed.stage.gs_node].dir == "fw"


@pytest.mark.parametrize("model, recipe", [
    ("interleaved_rope", "backends.torch.zoo.recipes:ddp_avg"),
    ("copy_into_strided", "backends.torch.zoo.scaling_recipes:fsdp_default")])
def test_the_same_steps_written_right_verify(model: str, recipe: str) -> None:
    _, verdict = _verdict(model, recipe, DP2)
    assert verdict.success
