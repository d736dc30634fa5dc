"""Megatron's clipping with the distributed optimizer (docs/soundness.md,
"Plans traced from PyTorch", 79-81): the norm over every rank's shards of
the main gradients, all-reduced over the whole instance, verifies with its
branch named; the same norm all-reduced over the tensor-parallel group (at
tp 1 a group of one: each rank's own shards' norm) FAILs. Each case traced
and verified in processes of its own, as a user runs them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from backends.torch.lowering.flat_ranges import FlatRange, read_flat
from tests.cli_pair import traced_and_verified

pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")

ARGS = ("--model backends.torch.megatron:gpt --recipe backends.torch.megatron:dist_opt --dp 2 "
        "--tp 1 --batch 8 --hidden 24 --clip 0.5 --clipper ")


def _traced_and_verified(tmp_path: Path, clipper: str) -> subprocess.CompletedProcess:
    return traced_and_verified(tmp_path, *(ARGS + clipper).split())


def test_norm_over_the_shards_verifies_with_its_branch_named(tmp_path: Path) -> None:
    checked = _traced_and_verified(tmp_path, "backends.torch.megatron:clip_grad_norm")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-2000:]
    assert "SUCCESS" in checked.stdout
    assert "clip_grad_by_total_norm_fp32" in checked.stdout and "< 1.0 is True" in checked.stdout


def test_each_ranks_own_shards_norm_fails(tmp_path: Path) -> None:
    checked = _traced_and_verified(tmp_path, "tests.norm_clippers:megatron_dist_opt_norm_over_tp")
    assert checked.returncode == 1, checked.stdout[-3000:] + checked.stderr[-2000:]
    assert "not equivalent" in checked.stdout


class _Lowerer:
    """The little of a lowerer ``read_flat`` reads: value shapes."""

    name = "test"

    def __init__(self, shapes: dict[int, tuple[int, ...]]):
        self.shapes = shapes


def test_a_flat_view_of_a_whole_value_in_a_range_stays_a_range() -> None:
    """A shard that is a whole 2-d gradient read flat keeps the value (item
    79 (c)), with the group the reduce-scatter cut it for."""
    lw = _Lowerer({7: (3, 4)})
    rng = FlatRange(((7, 0, 12),), None, (0, 1))
    got = read_flat(lw, rng, 0, (12,))
    assert got == FlatRange(((7, 0, 12),), None, (0, 1))
    part = read_flat(lw, rng, 2, (5,))
    assert part == FlatRange(((7, 2, 7),), None, (0, 1))
