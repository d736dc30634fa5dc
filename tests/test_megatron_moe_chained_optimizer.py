"""Megatron's own optimizer for a MoE (a ``ChainedOptimizer`` of its dense
and expert parts) at dp 2 ep 2: the parts' norms' truth values, a branch
the single-device step never takes, settled as a printed assumption
(docs/soundness.md, "Plans traced from PyTorch", 113 (f)); the step
verifies, and the wrong reduction with the same optimizer FAILs."""

from __future__ import annotations

import pytest

from tests.cli_pair import traced_and_verified

pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")


def _run(tmp_path, recipe: str):
    return traced_and_verified(tmp_path, "--model", "backends.torch.megatron:moe_gpt",
                               "--recipe", f"backends.torch.megatron:{recipe}",
                               "--dp", "2", "--tp", "1", "--optimizer", "adamw")


def test_chained_optimizer_verifies_naming_the_assumption(tmp_path):
    run = _run(tmp_path, "moe_ep2")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "a norm on rank" in run.stdout and "not all zero" in run.stdout, run.stdout[-2000:]


def test_experts_reduced_over_dp_fail_with_the_optimizer(tmp_path):
    run = _run(tmp_path, "moe_ep2_experts_reduced_over_dp")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
