"""Megatron-Core's own optimizer step (``--optimizer`` with a Megatron recipe;
docs/soundness.md, "Plans traced from PyTorch", 86): each rank builds
``get_megatron_optimizer`` over its DDP chunks and steps; every rank's
updated parameters and Adam states are proved equal to torch's AdamW on the
single-device gradients at the rank's shard; a rank that leaves the
tensor-parallel duplicates stale FAILs naming the rank and the parameter, and
so does a learning rate the single-device step does not use (91 (a)). The
distributed optimizer's step: tests/test_megatron_dist_opt_step.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.cli_pair import traced_and_verified

pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")

ARGS = ["--model", "backends.torch.megatron:gpt", "--dp", "2", "--tp", "2", "--batch", "8",
        "--optimizer", "adamw"]


def _verify(tmp_path: Path, recipe: str, *extra: str) -> subprocess.CompletedProcess:
    """Trace ``recipe`` (exit 2 passed on: a refusal) and verify its plans."""
    return traced_and_verified(tmp_path, *ARGS, *extra, "--recipe",
                               f"backends.torch.megatron:{recipe}")


def test_megatron_adamw_step_verifies_at_dp2_tp2(tmp_path):
    run = _verify(tmp_path, "ddp")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "SUCCESS" in run.stdout
    assert re.search(r"step [1-9]", run.stdout)  # the step's stages were proved


def test_megatron_step_leaving_tp_duplicates_stale_fails(tmp_path):
    run = _verify(tmp_path, "ddp_duplicates_on_tp_rank0")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "rank 1 holds shard" in run.stdout and "never updates it" in run.stdout


def test_megatron_step_with_another_learning_rate_fails_naming_the_rank(tmp_path):
    run = _verify(tmp_path, "ddp_lr_times_dp")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.search(r"adam_step \(\S+\.optimizer\) on rank \d", run.stdout), run.stdout[:3000]


def test_megatron_sgd_step_with_rate_and_gradients_compensated_verifies(tmp_path):
    """lr x dp with the weight decay and the gradients over dp: the same
    update, aligned with the single-device step by its numbers and proved."""
    run = _verify(tmp_path, "ddp_lr_times_dp_compensated", "--optimizer", "sgd")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "SUCCESS" in run.stdout

