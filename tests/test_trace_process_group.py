"""A step traced in this process leaves torch.distributed's default process
group as it found it (``backends.torch.tracer.rank.own_process_group``).
A rank's step run here (as tests run one, to lower it alone) used to leave
its fake group of the whole mesh behind: a Megatron step traced after it
on one device built ``parallel_state`` over that world, its data-parallel
group of two ranks, and the wrong-group clipper's norm stopped at its
square root with an AlignError instead of failing. Megatron's group of one
rank, left by a single-device step, made a later rank's step fail to
initialize its group twice. Both orders, in one process."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402

from backends.torch.__main__ import parser, resolve, trace_and_build  # noqa: E402
from backends.torch.tracer.rank import run  # noqa: E402
from main import verify  # noqa: E402

#: a rank (rank 0 of dp 2) of a small data-parallel step
RANK = {"model": "backends.torch.loss_models:token_weighted",
        "recipe": "backends.torch.loss_recipes:ddp_token_weighted", "dp": 2, "tp": 1, "pp": 1,
        "batch": 4, "seqlen": 4, "vocab": 16, "seed": 0, "parallel": True,
        "model_kwargs": {"layers": 1, "hidden": 8, "heads": 2, "ffn": 8, "vocab": 16, "seqlen": 4}}

#: Megatron's step on one device (its model makes a group of one rank)
SIZES = {"layers": 1, "hidden": 16, "heads": 4, "ffn": 32, "vocab": 16, "seqlen": 4}
MEGATRON_SINGLE = {"model": "backends.torch.megatron:gpt", "model_kwargs": SIZES, "recipe": "",
                   "dp": 1, "tp": 1, "pp": 1, "batch": 2, "seqlen": 4, "vocab": 16, "seed": 0,
                   "parallel": False}

WRONG_GROUP = ("--model backends.torch.megatron:gpt --recipe backends.torch.megatron:tp --dp 1 "
               "--tp 2 --clip 0.5 --clipper tests.norm_clippers:megatron_norm_over_dp")


def test_a_rank_traced_here_then_megatron_on_one_device() -> None:
    run(RANK, 0)
    plan_s, plan_p = trace_and_build(resolve(parser().parse_args(WRONG_GROUP.split())))[0]
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage"
    assert not dist.is_initialized(), "a step's process group was left behind"


def test_megatron_on_one_device_then_a_rank_traced_here() -> None:
    run(MEGATRON_SINGLE, 0)
    assert run(RANK, 0)["rank"] == 0
    assert not dist.is_initialized(), "a step's process group was left behind"
