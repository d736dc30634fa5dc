"""Ulysses sequence parallelism: the sequence split across the cp ranks
outside attention, all-to-alls to head shards of whole sequences around it.
The plans verify; wrong ones, judged wrong by the oracle, fail."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import caught, plan_pair

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from harness.oracle import judge
from main import verify
from verdict.differential import compare
from verdict.plan import Plan, pair_problem

LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=8)
ULYSSES = Policy(ulysses=True)
GBS = 4


def plans(par: Parallelism) -> tuple[Plan, Plan]:
    return plan_pair(LLAMA, par, GBS, ULYSSES)


@pytest.mark.parametrize("par", [Parallelism(cp=4), Parallelism(cp=2, dp=2, pp=2, nm=2)],
                         ids=["cp4", "cp2_dp2_pp2_nm2"])
def test_ulysses_plans_verify(par):
    single, plan = plans(par)
    assert pair_problem(single, plan) is None
    assert compare(single, plan).equal
    assert judge(single, plan).right
    assert verify(single, plan).success


def test_all_to_alls_around_attention():
    """Per layer on one rank: q, k^T and v to head shards and the attention
    output back to sequence shards, and the four reverse ones; no gather."""
    _, plan = plans(Parallelism(cp=4))
    rank = [n for n in plan.nodes if n.rank == 1]
    count = Counter((n.dir, n.op) for n in rank)
    assert count[("fw", "all_to_all")] == 4 * LLAMA.layers
    assert count[("bw", "all_to_all")] == 4 * LLAMA.layers
    assert not any(n.op in ("all_gather", "reduce_scatter") for n in plan.nodes)
    masks = [n for n in plan.nodes if n.op == "causal_mask"]
    assert all(not n.kwargs for n in masks)  # whole sequences


@pytest.mark.parametrize("operator", ["permute_group", "wrong_index"])
def test_wrong_ulysses_plans_fail(operator):
    single, plan = plans(Parallelism(cp=4))
    assert caught(single, plan, operator, "ulysses")


@pytest.mark.parametrize(("par", "message"), [
    (Parallelism(cp=2, tp=2), "--tp 1"),
    (Parallelism(cp=8), "not divisible|divisible by --cp"),
])
def test_ulysses_limits(par, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(LLAMA, par, GBS, policy=ULYSSES)
