"""Compositions the torch backend traces: tensor parallelism inside pipeline
stages, schedules with several stages per rank and a split backward
(zero bubble), the optimizer step and gradient clipping; each right one
verifies and the oracle agrees, each wrong one fails (more cases, among
them clipping by a rank's local norm, in scripts/run_torch_suite.sh)."""

from __future__ import annotations

import shlex

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.zoo.recipes import ContextParallelRefused, cp_sdpa
from harness.oracle import judge
from main import verify

_SINGLES: dict = {}


def plans(argv: str):
    """The plan pair of ``python -m backends.torch ARGV`` (single-device
    traces shared by cases of the same model, sizes and step)."""
    args = resolve(parser().parse_args(shlex.split(argv)))
    key = (args.layers, args.optimizer, args.clip)
    (plan_s, plan_p), _SINGLES[key] = trace_and_build(args, _SINGLES.get(key))
    return plan_s, plan_p


def test_tensor_parallel_inside_pipeline_stages() -> None:
    plan_s, plan_p = plans("--recipe pp_tp --pp 2 --dp 1 --tp 2 --layers 2")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert {"send_recv", "all_gather", "reduce_scatter"} <= {n.op for n in plan_p.nodes}


def test_zero_bubble_v_schedule_verifies() -> None:
    plan_s, plan_p = plans("--recipe pp_zbv --pp 2 --dp 1 --tp 1 --layers 4")
    assert verify(plan_s, plan_p).success
    assert judge(plan_s, plan_p).right
    assert plan_p.world["nm"] == 4
    # rank 0 holds the first and the last of four stages (the V)
    held = {plan_p.logical[t.tid].name for t in plan_p.tensors if t.rank == 0 and t.mb == -1}
    assert {"tok_embeddings.weight", "output.weight", "layers.0.attention.wq.weight",
            "layers.3.attention.wq.weight"} <= held


@pytest.fixture(scope="module")
def clipped_adamw():
    return plans("--recipe tp_sp_vocab --clip 0.5 --optimizer adamw")


def test_clipping_and_adamw_verify(clipped_adamw) -> None:
    plan_s, plan_p = clipped_adamw
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert judge(plan_s, plan_p).right
    assert sum(n.op == "adam_step" for n in plan_s.nodes) == 12
    assert {"clamp", "pow"} <= {n.op for n in plan_p.nodes}


def test_a_wrong_update_on_one_rank_fails(clipped_adamw) -> None:
    plan_s, plan_p = clipped_adamw
    nodes = list(plan_p.nodes)
    i = next(i for i, n in enumerate(nodes) if n.op == "adam_step" and n.rank == 1)
    nodes[i] = nodes[i]._replace(kwargs={**nodes[i].kwargs, "lr": nodes[i].kwargs["lr"] * 2})
    mutant = plan_p.__class__(**{**plan_p.__dict__, "nodes": nodes})
    assert not judge(plan_s, mutant).right
    assert not verify(plan_s, mutant).success


def test_context_parallel_is_refused_with_its_reason() -> None:
    with pytest.raises(ContextParallelRefused, match="not traced yet"):
        cp_sdpa(None, None)
