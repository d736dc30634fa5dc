"""Megatron's distributed optimizer at pipeline size 2 and the zeros a
parameter's unread gradient all-reduces (docs/soundness.md, "Plans traced
from PyTorch", 108): an all-reduce of zeros on every member is those zeros,
one of zeros on some members only is left as it is; at pp 2 (dp 1 and dp 2)
Megatron's step verifies, and each rank reading the next rank's ranges
FAILs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from backends.torch.lowering import Lowered, LoweringError, check_bucket_layouts
from backends.torch.lowering.context import LNode
from backends.torch.lowering.zero_reductions import drop_zero_reductions
from tests.cli_pair import traced_and_verified


def _rank(rank: int, zero: bool, final: bool = False) -> Lowered:
    """A rank that all-reduces over ranks (0, 1) either zeros it made or a
    parameter, then all-reduces its loss; ``final``: the first all-reduce's
    output is its gradient."""
    made = LNode("zeros", "none", [], [10], {"shape": [2, 3]}, "buf") if zero \
        else LNode("mul", "fw", [1, 1], [10], {}, "w")
    nodes = [made,
             LNode("all_reduce", "fw", [10], [11], {}, "buf", (0, 1)),
             LNode("all_reduce", "fw", [2], [12], {}, "loss", (0, 1))]
    shapes = {1: (2, 3), 2: (), 10: (2, 3), 11: (2, 3), 12: ()}
    return Lowered(rank, {"dp": rank}, shapes, nodes, {1: ("param", "w")}, {1: [[], []]}, [12],
                   {"w": 11 if final else None})


def test_zeros_all_reduced_on_every_member_are_dropped():
    lows = [_rank(0, True), _rank(1, True)]
    drop_zero_reductions(lows)
    for low in lows:  # the loss's all-reduce is the first over the group now, on both
        assert [(n.op, n.group) for n in low.nodes] == [("all_reduce", (0, 1))]


def test_zeros_that_are_a_final_gradient_stay_zeros_made():
    lows = [_rank(0, True, final=True), _rank(1, True, final=True)]
    drop_zero_reductions(lows)
    for low in lows:
        assert [n.op for n in low.nodes] == ["zeros", "all_reduce"]
        assert low.nodes[0].outs == [11] and low.nodes[0].group is None


def test_zeros_on_one_member_only_stay_all_reduced():
    lows = [_rank(0, True), _rank(1, False)]
    drop_zero_reductions(lows)
    assert [n.op for n in lows[0].nodes] == ["zeros", "all_reduce", "all_reduce"]
    assert [n.op for n in lows[1].nodes] == ["mul", "all_reduce", "all_reduce"]


def test_flat_ranges_all_reduced_at_other_offsets_are_refused():
    def low(rank: int, layout: tuple) -> Lowered:
        out = Lowered(rank, {}, {}, [], {}, {}, [], {})
        out.buckets = [((0, 2), layout)]
        return out
    same = (("run", (16, 24), 0, 192), ("run", (16, 24), 192, 384))
    check_bucket_layouts([low(0, same), low(2, same)])
    with pytest.raises(LoweringError, match="would add unrelated elements"):
        check_bucket_layouts([low(0, same), low(2, (("run", (16, 24), 0, 384),))])


megatron = pytest.mark.skipif(
    __import__("importlib").util.find_spec("megatron") is None,
    reason="needs the [megatron] extra (megatron-core)")


def _verify(tmp_path: Path, recipe: str, dp: int, *extra: str) -> subprocess.CompletedProcess:
    return traced_and_verified(tmp_path, "--model", "backends.torch.megatron:gpt", "--recipe",
                               f"backends.torch.megatron:{recipe}", "--pp", "2", "--dp", str(dp),
                               "--tp", "1", "--layers", "2", "--batch", "8", "--hidden", "24",
                               *extra)


@megatron
def test_dist_opt_step_verifies_at_pp2(tmp_path):
    run = _verify(tmp_path, "dist_opt", 1, "--optimizer", "adamw")
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout[-2000:]


@megatron
def test_dist_opt_verifies_at_pp2_dp2(tmp_path):
    run = _verify(tmp_path, "dist_opt", 2)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout[-2000:]


@megatron
def test_the_next_ranks_ranges_fail_at_pp2_dp2(tmp_path):
    run = _verify(tmp_path, "dist_opt_range_shifted", 2)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "which is not the fully accumulated and reduced gradient" in run.stdout
