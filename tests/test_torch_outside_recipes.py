"""Recipes written with PyTorch's own parallel APIs outside the backend
(``tests/outside_recipes.py``): ``DistributedDataParallel`` (its C++
reducer's flat buckets, a comm hook, ``gradient_as_bucket_view``), a flat
bucket built by hand, a mesh of the user's own; each right one verifies
and the oracle agrees, each wrong one fails at the op that applies the
mistake. The other recipes run as cases of scripts/run_torch_suite.sh."""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.errors import LoweringError
from backends.torch.lowering import Lowered, check_broadcasts, check_bucket_layouts
from backends.torch.tracer.hidden_memory import HiddenMemory
from harness.oracle import judge
from main import verify

R = "tests.outside_recipes:"
_SINGLES: dict = {}


def plans(argv: str):
    args = resolve(parser().parse_args(shlex.split(argv)))
    key = (args.model, args.layers)
    (plan_s, plan_p), _SINGLES[key] = trace_and_build(args, _SINGLES.get(key))
    return plan_s, plan_p


def test_ddp_averages_a_per_rank_mean_loss() -> None:
    plan_s, plan_p = plans(f"--model mlp_mean --recipe {R}ddp --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    # one all-reduce per gradient of the bucket, after DDP's 1 / world size
    assert sum(n.op == "all_reduce" for n in plan_p.nodes) == 2 * 12
    assert any(n.op == "mul_scalar" and n.kwargs.get("value") == 0.5 for n in plan_p.nodes)


def test_ddp_on_a_shared_out_loss_fails_at_its_division() -> None:
    """DDP averages; the loss ``mlp`` divides by the whole step's token
    count already, so every gradient ends 1/dp of the single-device one
    (a real gloo run differs the same way)."""
    plan_s, plan_p = plans(f"--model mlp --recipe {R}ddp --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert not verdict.success
    assert "rank" in verdict.message and "DistributedDataParallel" in verdict.message
    assert not judge(plan_s, plan_p).right


def test_composable_replicate_verifies_and_averages() -> None:
    """``replicate(model)`` builds DDP's reducer at its first forward; the
    rank builds it after the recipe, before the traced step: the per-rank
    mean verifies, the loss already shared out ends 1/dp (as a real gloo
    run does)."""
    plan_s, plan_p = plans(f"--model mlp_mean --recipe {R}replicate_dp --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    plan_s, plan_p = plans(f"--model mlp --recipe {R}replicate_dp --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and "rank" in verdict.message
    assert not judge(plan_s, plan_p).right


def test_ddp_gradients_as_bucket_views_verify() -> None:
    """With ``gradient_as_bucket_view`` the gradient is the bucket's view,
    bound before the in-place all-reduce: it is read again from memory."""
    plan_s, plan_p = plans(f"--model mlp_mean --recipe {R}ddp_bucket_view --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right


def test_a_comm_hook_dividing_twice_fails() -> None:
    plan_s, plan_p = plans(f"--model mlp_mean --recipe {R}ddp_hook_divides_twice --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert not verdict.success
    assert "div" in verdict.message and "rank" in verdict.message


def test_a_flat_bucket_by_hand_verifies() -> None:
    plan_s, plan_p = plans(f"--model mlp_mean --recipe {R}flat_bucket_by_hand --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message


def test_memory_regions_read_back() -> None:
    """Two views written into a buffer never seen allocated read back as
    the values written, side by side, and a binding older than the last
    write is stale."""
    memory = HiddenMemory()
    buffer = torch.zeros(10)
    memory.write(buffer[:4], 1)
    memory.write(buffer[4:], 2)
    whole = memory.read(buffer)
    assert (whole.kind, whole.values) == ("cat", (1, 2))
    before = memory.generation(buffer)
    memory.write(buffer, 3)
    assert memory.generation(buffer) != before
    part = memory.read(buffer[4:6])
    assert (part.kind, part.values, part.offset) == ("slice", (3,), 4)
    memory.write(buffer[2:6], 4)  # overlaps the whole: nothing else is known
    assert memory.read(buffer[6:]) is None


def _lowered(rank: int, buckets) -> Lowered:
    return Lowered(rank, {}, {}, [], {}, {}, [], {}, buckets=buckets)


def test_buckets_cut_differently_are_refused() -> None:
    check_bucket_layouts([_lowered(0, [((0, 1), (4, 6))]), _lowered(1, [((0, 1), (4, 6))])])
    with pytest.raises(LoweringError, match="unrelated elements"):
        check_bucket_layouts([_lowered(0, [((0, 1), (4, 6))]), _lowered(1, [((0, 1), (6, 4))])])


def test_a_broadcast_of_constants_that_differ_is_refused() -> None:
    def trace(rank: int, value: float) -> dict:
        event = ("c10d.broadcast_.default", [[[("v", 5)], ("pg", (0, 1)), 0, 0], {}], [6])
        return {"rank": rank, "events": [event], "constvals": {5: np.full(3, value)},
                "losses": [6], "grads": {}}  # the loss reads the broadcast: it is live

    check_broadcasts([trace(0, 1.0), trace(1, 1.0)])
    with pytest.raises(LoweringError, match="other values"):
        check_broadcasts([trace(0, 1.0), trace(1, 2.0)])
