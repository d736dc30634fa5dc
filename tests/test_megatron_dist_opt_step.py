"""Megatron-Core's distributed optimizer's own step (``dist_opt`` with
``--optimizer``; docs/soundness.md, "Plans traced from PyTorch", 90): each
rank steps its flat ranges of the parameters, writes them into the DDP
parameter buffer and all-gathers it; every rank must end with every
updated parameter whole and the ranks' Adam states must make the whole
states. The memory reads cut at a region's ends, the blocks' cover and the
world's list of final tensors are tested without Megatron; the steps (and
wrong ones: the all-gather left out, each rank sending the next rank's
stale range) through the backend."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from backends.torch.tracer.hidden_memory import HiddenMemory
from tests.cli_pair import traced_and_verified
from verdict.final import _covers, final_blocks
from verdict.plan import Plan, Tensor

ARGS = ["--model", "backends.torch.megatron:gpt", "--dp", "2", "--tp", "1", "--batch", "8",
        "--hidden", "24"]


def test_memory_read_cut_at_the_regions_ends():
    """A tensor whose memory starts inside one region and ends inside
    another is those regions' parts side by side ("cuts")."""
    buf = torch.zeros(10)
    memory = HiddenMemory()
    memory.write(buf[0:4], 1)
    memory.write(buf[4:10], 2)
    read = memory.read(buf[2:7])
    assert read is not None and read.kind == "cuts"
    assert read.cuts == ((1, 2, 2), (2, 0, 3))
    memory2 = HiddenMemory()
    memory2.write(buf[0:4], 1)
    memory2.write(buf[6:10], 2)
    assert memory2.read(buf[2:8]) is None  # a gap: no known value


def test_blocks_cover_a_shard_only_when_they_tile_it():
    whole = ((0, 72), (0, 24))
    rank0 = [((0, 21), (0, 24)), ((21, 22), (0, 8))]
    rank1 = [((21, 22), (8, 24)), ((22, 72), (0, 24))]
    assert _covers(rank0 + rank1, whole)
    assert not _covers(rank0, whole)  # the other rank's range left as loaded
    assert not _covers(rank0 + [((22, 72), (0, 24))], whole)  # a gap in row 21


def test_final_blocks_listed_in_the_world_by_identity():
    """Entries name a tensor by (rank, mb, tid, version), so that a plan
    whose tensors are renumbered keeps them; one the plan lacks is -1."""
    t = [Tensor(0, 0, 3, v, (2,), 1, ((0, 2),), (0, 1, 1), (1, 1)) for v in range(2)]
    plan = Plan(world={"final_blocks": "0,3,0,0,3,1;0,3,0,0,3,0;1,4,1,0,4,0"}, tensors=t)
    assert final_blocks(plan) == {(0, 3): [1, 0], (1, 4): [-1]}
    plan.tensors = t[::-1]
    assert final_blocks(plan) == {(0, 3): [0, 1], (1, 4): [-1]}
    assert final_blocks(Plan(world={})) is None


def _verify(tmp_path: Path, recipe: str, *extra: str) -> subprocess.CompletedProcess:
    """Trace ``recipe`` (exit 2 passed on: a refusal) and verify its plans."""
    return traced_and_verified(tmp_path, *ARGS, *extra, "--recipe",
                               f"backends.torch.megatron:{recipe}")


megatron = pytest.mark.skipif(
    __import__("importlib").util.find_spec("megatron") is None,
    reason="needs the [megatron] extra (megatron-core)")


@megatron
def test_distributed_optimizer_step_verifies_at_dp2(tmp_path):
    run = _verify(tmp_path, "dist_opt", "--optimizer", "adamw")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "SUCCESS" in run.stdout


@megatron
def test_distributed_optimizer_sgd_is_refused(tmp_path):
    """Megatron's DistributedOptimizer asserts Adam: refused in one line."""
    run = _verify(tmp_path, "dist_opt", "--optimizer", "sgd")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Adam only" in run.stderr


@megatron
def test_distributed_optimizer_step_without_the_all_gather_fails(tmp_path):
    run = _verify(tmp_path, "dist_opt_gather_skipped", "--optimizer", "adamw")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "never updates it" in run.stdout


@megatron
def test_distributed_optimizer_step_gathering_stale_ranges_fails(tmp_path):
    run = _verify(tmp_path, "dist_opt_gather_wrong_shard", "--optimizer", "adamw")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
