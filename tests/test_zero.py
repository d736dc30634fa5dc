"""ZeRO-1/2/3 (FSDP) plans: parameters and gradients sharded over the
data-parallel ranks. Correct plans pass the numeric check and the proof;
each rank's contract is on the shard it owns; wrong plans fail."""

from __future__ import annotations

import random

import pytest

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge
from main import verify
from verdict.differential import compare
from verdict.final import rank_states
from verdict.plan import Plan

MLP = ModelConfig("mlp", layers=2, hidden=8)
LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12,
                    seqlen=4)
MOE = ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12, seqlen=4,
                  experts=4, topk=2, moe_ffn=8, first_dense=1)
GBS = 16
SINGLE: dict[str, Plan] = {}


def single(cfg: ModelConfig) -> Plan:
    if cfg.model not in SINGLE:
        SINGLE[cfg.model] = make_plan(cfg, Parallelism(), GBS)
    return SINGLE[cfg.model]


CASES = [
    (MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), 1),
    (MLP, Parallelism(dp=4, nm=2), 2),
    (MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), 3),
    (LLAMA, Parallelism(dp=2, tp=2, pp=2, nm=2), 3),
    (MOE, Parallelism(dp=4, ep=2, tp=2), 3),
]


@pytest.mark.parametrize(("cfg", "par", "zero"), CASES,
                         ids=lambda x: getattr(x, "model", None) or str(x))
def test_zero_plans_verify(cfg, par, zero):
    plan = make_plan(cfg, par, GBS, policy=Policy(zero=zero))
    report = compare(single(cfg), plan)
    assert report.equal, [d.describe() for d in report.differences] + report.uncovered
    verdict = verify(single(cfg), plan)
    assert verdict.success, verdict.message


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_collectives_of_each_stage(zero):
    plan = make_plan(MLP, Parallelism(dp=2, nm=2), GBS, policy=Policy(zero=zero))
    ops = [(n.op, n.dir, n.mb) for n in plan.nodes if n.rank == 0]
    gathers = [o for o in ops if o[0] == "all_gather"]
    if zero < 3:  # once per step, before the first microbatch
        assert gathers and all(o[1:] == ("none", -1) for o in gathers)
    else:  # before every use: in each microbatch's forward, and again in its backward
        assert {o[2] for o in gathers} == {0, 1} and {o[1] for o in gathers} == {"fw", "bw"}
        writer = {o: n for n in plan.nodes for o in n.outputs}
        params = [(n, t) for n in plan.nodes if n.dir == "bw" and n.op != "all_gather"
                  for t in n.inputs
                  if plan.logical[plan.tensors[t].tid].kind == "param"]
        assert params and all(writer[t].op == "all_gather" and writer[t].dir == "bw"
                              and writer[t].mb == n.mb for n, t in params)
    reducers = sum(o[0] == "reducer" for o in ops)
    scatters = sum(o[0] == "reduce_scatter" for o in ops)
    assert (reducers > 0) == (zero == 1) and (scatters > 0) == (zero >= 2)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_each_rank_holds_and_ends_with_its_owned_shard(zero):
    plan = make_plan(MLP, Parallelism(dp=2), GBS, policy=Policy(zero=zero))
    states = rank_states(single(MLP), plan)
    for rank, st in states.items():
        for p, held in st.held.items():
            assert held == [((rank * 4, rank * 4 + 4), (0, 8))]
            last = plan.tensors[st.last_grad[p]]
            assert last.slices == held[0] and last.is_whole()


def test_a_gradient_left_unreduced_fails():
    """ZeRO-2 with one rank's reduce-scatter reading only its own gradient."""
    plan = make_plan(MLP, Parallelism(dp=2), GBS, policy=Policy(zero=2))
    i = next(k for k, n in enumerate(plan.nodes) if n.op == "reduce_scatter" and n.rank == 1)
    n = plan.nodes[i]
    own = next(t for t in n.inputs if plan.tensors[t].rank == 1)
    plan.nodes[i] = n._replace(inputs=(own, own))
    verdict = verify(single(MLP), plan)
    assert not verdict.success and verdict.kind == "stage"


def test_a_rank_ending_with_a_peers_shard_fails():
    """ZeRO-1 where rank 1 keeps rank 0's half of the reduced gradient."""
    plan = make_plan(MLP, Parallelism(dp=2), GBS, policy=Policy(zero=1))
    i = next(k for k, n in enumerate(plan.nodes) if n.op == "split" and n.rank == 1)
    n = plan.nodes[i]
    out = plan.tensors[n.outputs[0]]
    plan.tensors[n.outputs[0]] = out._replace(slices=((0, 4), (0, 8)))
    plan.nodes[i] = n._replace(kwargs={**n.kwargs, "index": 0})
    verdict = verify(single(MLP), plan)
    assert not verdict.success and "rank 1 holds shard [4:8, 0:8]" in verdict.message


def test_unshardable_parameter_is_refused():
    with pytest.raises(ConfigError, match="ZeRO shards"):
        make_plan(ModelConfig("mlp", layers=2, hidden=6), Parallelism(dp=4), 24,
                  policy=Policy(zero=3))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_an_owner_keeping_another_owners_shard_fails(zero):
    """wrong_owner: one rank's reduce-scatters (or ZeRO-1's split) keep a
    peer's chunk of a gradient, every tensor after them claiming it
    truthfully; the rank still holds its own parameter shard."""
    plan = make_plan(MLP, Parallelism(dp=4, nm=2), GBS, policy=Policy(zero=zero))
    for k in range(3):
        mutant, where = mutations.wrong_owner(plan, random.Random(f"owner/{zero}/{k}"))
        assert not judge(single(MLP), mutant).right, where
        verdict = verify(single(MLP), mutant)
        assert not verdict.success, where
        if verdict.kind == "coverage":
            assert "the gradient of slice" in verdict.message
