"""Megatron steps a user writes through the documented contract
(tests/megatron_user_steps.py; docs/torch-backend.md, "Megatron-Core"):
rotary positions (their frequencies a buffer loaded from the single-device
model's, docs/soundness.md, "Plans traced from PyTorch", 116) with
grouped-query attention and a SwiGLU MLP verify at tp 2 with sequence
parallelism; a masked per-token loss verifies at dp 2; the same mask
averaged per microbatch, and a token sum without
``calculate_per_token_loss``, FAIL. Each case runs in fresh interpreters
through scripts/torch_suite.py."""

from __future__ import annotations

import pytest

from tests.cli_pair import suite_cases

pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")


def test_rotary_gqa_swiglu_step_verifies_at_tp2_sp():
    run = suite_cases("megatron user tp2 sp rope")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "torch suite: 1 of 1 as expected" in run.stdout, run.stdout[-2000:]


def test_masked_per_token_loss_verifies_and_its_wrong_variants_fail():
    run = suite_cases("megatron user dp2 masked", "megatron user bug dp2 masked",
                      "megatron user bug dp2 token sum")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "torch suite: 3 of 3 as expected" in run.stdout, run.stdout[-2000:]


def test_an_optimizer_step_over_a_strided_shard_verifies_and_a_wrong_rate_fails():
    """SwiGLU's fused ``linear_fc1`` at tp 2 is a strided shard: its update is
    listed as its claimed blocks and each proved (docs/soundness.md, "Plans
    traced from PyTorch", 116 (c)); with the learning rate times dp it FAILs."""
    run = suite_cases("megatron user tp2 optimizer step sgd over a strided shard",
                      "megatron user bug dp2 tp2 strided shard")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "torch suite: 2 of 2 as expected" in run.stdout, run.stdout[-2000:]
