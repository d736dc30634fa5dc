"""ZeRO-1 with expert parallelism proved by its checked symmetry: expert
parameters owned over the expert-data-parallel replicas, shared ones over
every data-parallel rank and gathered in two levels (docs/soundness.md,
"ZeRO-1 with expert parallelism: shards in two levels"). Correct plans
verify by classes; wrong ones FAIL, judged wrong by the oracle. ZeRO-2 and
ZeRO-3 with expert parallelism likewise: shared gradients reduce-scattered
in two levels ("ZeRO-2 and ZeRO-3 with expert parallelism")."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from gen_model.config import ModelConfig, Parallelism
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge
from main import verify
from tests.helpers import plan_pair
from verdict.plan import Plan
from verdict.symmetry.find import Refusal, Symmetry, find_symmetry

MOE = ModelConfig("moe", layers=1, hidden=8, heads=2, kv_heads=1, ffn=8, vocab=8, seqlen=2,
                  experts=4, topk=2, moe_ffn=4, first_dense=0)
EP = 2


def pair(dp: int, nm: int, zero: int = 1) -> tuple[Plan, Plan]:
    return plan_pair(MOE, Parallelism(dp=dp, ep=EP, nm=nm), 2 * dp * nm, Policy(zero=zero))


def wrong_and_fails(single: Plan, wrong: Plan) -> tuple[str, str]:
    """The plan is wrong by the oracle and FAILs with evidence (exit 1)."""
    assert not judge(single, wrong).right
    v = verify(single, wrong)
    assert not v.success and v.kind != "internal", v.message
    return v.symmetry, v.message


def rank(edp: int, e: int) -> int:
    """The rank of expert-data-parallel replica ``edp``, ep index ``e`` (no cp, tp, pp)."""
    return edp * EP + e


@pytest.mark.parametrize("dp,nm", [(8, 2), (4, 4)], ids=["edp4_nm2", "edp2_nm4"])
def test_correct_zero1_ep_plan_verifies_by_classes(dp, nm):
    single, plan = pair(dp, nm)
    assert isinstance(find_symmetry(single, plan), Symmetry)
    v = verify(single, plan)
    assert v.success, v.message
    edp = dp // EP
    assert v.symmetry.startswith(f"{edp} x {nm} blocks (expert-data-parallel replica x "
                                 f"microbatch) checked"), v.symmetry
    assert "ZeRO-1 owned shards checked on every rank" in v.symmetry, v.symmetry
    assert v.blocks == (edp * nm, min(edp, 2) * min(nm, 2), 0) and v.classes == 1


@pytest.mark.parametrize("mesh,zero", [(dict(tp=2), 1), (dict(pp=2), 1), (dict(pp=2), 3)],
                         ids=["tp2_zero1", "pp2_zero1", "pp2_zero3"])
def test_zero_ep_with_tensor_or_pipeline_parallelism_verifies_by_symmetry(mesh, zero):
    """The ep ranks of a replica sit cp x tp ranks apart, in every stage."""
    cfg = replace(MOE, layers=2, kv_heads=2)
    single, plan = plan_pair(cfg, Parallelism(dp=8, ep=EP, nm=2, **mesh), 32, Policy(zero=zero))
    v = verify(single, plan)
    assert v.success, v.message
    assert f"ZeRO-{zero} owned shards checked on every rank" in v.symmetry, v.symmetry


def test_shared_parameters_gather_in_two_levels_and_expert_ones_over_the_orbit():
    single, plan = pair(8, 2)
    sym = find_symmetry(single, plan)
    assert isinstance(sym, Symmetry)
    names = {plan.logical[plan.tensors[n.inputs[0]].tid].name: len(n.inputs)
             for n in plan.nodes if n.op == "all_gather" and n.rank == 0}
    assert names["layers.0.feed_forward.w1"] == 4  # expert: the 4 edp replicas
    assert names["layers.0.attention.wq.weight"] in (2, 4)  # shared: ep, then edp


@pytest.mark.parametrize("dp,nm,zero", [(8, 2, 2), (8, 2, 3), (8, 4, 2)],
                         ids=["zero2_edp4_nm2", "zero3_edp4_nm2", "zero2_edp4_nm4"])
def test_zero2_and_zero3_with_ep_verify_by_classes(dp, nm, zero):
    """Shared gradients reduce-scattered in two levels (the orbit, then the
    ep ranks of the replica), ZeRO-3's shared parameters gathered per use in
    two levels (docs/soundness.md, "ZeRO-2 and ZeRO-3 with expert
    parallelism")."""
    single, plan = pair(dp, nm, zero)
    assert isinstance(find_symmetry(single, plan), Symmetry)
    v = verify(single, plan)
    assert v.success, v.message
    edp = dp // EP
    assert v.symmetry.startswith(f"{edp} x {nm} blocks (expert-data-parallel replica x "
                                 f"microbatch) checked"), v.symmetry
    assert f"ZeRO-{zero} owned shards checked on every rank" in v.symmetry, v.symmetry


def test_an_optimizer_step_on_shared_shards_is_verified_in_full():
    """Its updated shards are gathered in two levels, which no rule describes."""
    single, plan = plan_pair(replace(MOE, optimizer="sgd"), Parallelism(dp=8, ep=EP, nm=2), 32,
                             Policy(zero=1))
    found = find_symmetry(single, plan)
    assert isinstance(found, Refusal), found  # the in-block gather of updated shards
    v = verify(single, plan)
    assert v.success and "verified in full" in v.symmetry, v.message


def mutant(plan: Plan, operator: str, seed: str) -> Plan:
    made = mutations.MATERIALIZED_MUTATIONS[operator](plan, random.Random(seed))
    assert made is not None
    return made[0]


@pytest.mark.parametrize("seed", ["zep/owned/0", "zep/owned/3"])
def test_a_replica_owning_another_shard_fails(seed):
    single, plan = pair(8, 2)
    wrong_and_fails(single, mutant(plan, "owned_shard", seed))


def _moved(plan: Plan, name: str, to: tuple[int, int], src: tuple[int, int]) -> Plan:
    """Rank ``to`` loads rank ``src``'s shard of parameter ``name``."""
    tid = next(k for k, lg in enumerate(plan.logical) if lg.name == name)
    written = {o for n in plan.nodes for o in n.outputs}
    loaded = {t.rank: i for i, t in enumerate(plan.tensors)
              if t.tid == tid and i not in written}
    p = mutations.copy_plan(plan)
    i = loaded[rank(*to)]
    p.tensors[i] = p.tensors[i]._replace(slices=plan.tensors[loaded[rank(*src)]].slices)
    return p


def test_an_expert_shard_owned_twice_fails():
    single, plan = pair(8, 2)
    wrong_and_fails(single, _moved(plan, "layers.0.feed_forward.w1", (2, 0), (1, 0)))


def test_a_shared_shard_owned_twice_fails():
    single, plan = pair(8, 2)
    wrong_and_fails(single, _moved(plan, "layers.0.attention.wq.weight", (2, 1), (2, 0)))


def test_a_keep_of_another_chunk_fails():
    single, plan = pair(8, 2)
    p = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(plan.nodes) if n.op == "split" and n.mb < 0
             and n.rank == rank(3, 1) and n.kwargs.get("parts") == 8)
    n = plan.nodes[i]
    p.nodes[i] = n._replace(kwargs={**n.kwargs, "index": n.kwargs["index"] - 1})
    out = plan.tensors[n.outputs[0]]
    p.tensors[n.outputs[0]] = out._replace(slices=mutations._chunk(
        plan.tensors[n.inputs[0]].slices, n.kwargs["dim"], 8, n.kwargs["index"] - 1))
    wrong_and_fails(single, p)


def test_one_microbatch_op_in_one_replica_fails():
    single, plan = pair(4, 4)
    p = mutations.copy_plan(plan)
    site = next((n.dir, n.name) for n in plan.nodes if n.op == "mul_scalar" and n.mb == 2
                and abs(n.kwargs["value"]) not in (0, 1))
    hit = 0
    for i, n in enumerate(plan.nodes):  # replica edp 1
        if (n.dir, n.name) == site and n.mb == 2 and n.rank in (rank(1, 0), rank(1, 1)):
            p.nodes[i] = n._replace(op="div")
            hit += 1
    assert hit == 2
    symmetry, _ = wrong_and_fails(single, p)
    assert "microbatch 2" in symmetry


@pytest.mark.parametrize("seed", ["zep/ep_peer/0", "zep/ep_peer/1"])
def test_an_all_to_all_peer_of_another_replica_fails(seed):
    """Seed 1 gives replica 0 a peer of replica 2 in every microbatch: a
    value listed after its reader, which a stage runs in dataflow order."""
    single, plan = pair(8, 2)
    wrong_and_fails(single, mutant(plan, "ep_peer", seed))


@pytest.mark.parametrize("zero", [1, 2])
def test_a_reduction_missing_a_replica_fails(zero):
    """One rank's sum over the replicas (ZeRO-1: the reducer of an expert's
    gradient; ZeRO-2: a microbatch's reduce-scatter over the orbit) reads its
    own value in place of another replica's."""
    single, plan = pair(8, 2, zero)
    op = "reduce_scatter" if zero == 2 else None
    p = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(plan.nodes) if n.rank == rank(2, 1) and len(n.inputs) == 4
             and (n.op == op or (op is None and n.mb < 0 and n.op != "all_gather"))
             and any(plan.tensors[t].rank != n.rank for t in n.inputs))
    n = plan.nodes[i]
    own = next(t for t in n.inputs if plan.tensors[t].rank == n.rank)
    ins = list(n.inputs)
    ins[0] = own
    p.nodes[i] = n._replace(inputs=tuple(ins))
    wrong_and_fails(single, p)


def _inner(plan: Plan, op: str, at: int, mb: int = 0) -> int:
    """The first in-block ``op`` (over the ep ranks of one replica) of a
    shared parameter on rank ``at`` in microbatch ``mb``."""
    return next(i for i, n in enumerate(plan.nodes) if n.op == op and n.rank == at
                and n.mb == mb and len(n.inputs) == EP
                and all(plan.tensors[t].rank // EP == at // EP for t in n.inputs))


@pytest.mark.parametrize("zero", [2, 3])
def test_an_in_block_scatter_missing_an_ep_rank_fails(zero):
    """Rank (2, 1)'s in-block reduce-scatter reads its own value in place of
    ep rank 0's: its shard misses what ep rank 0's tokens contributed."""
    single, plan = pair(8, 2, zero)
    p = mutations.copy_plan(plan)
    i = _inner(plan, "reduce_scatter", rank(2, 1), mb=1)
    n = plan.nodes[i]
    p.nodes[i] = n._replace(inputs=(n.inputs[1], n.inputs[1]))
    wrong_and_fails(single, p)


def test_a_shard_scattered_to_another_chunk_fails():
    """Rank (3, 1)'s in-block reduce-scatter keeps ep rank 0's chunk of the
    replica's box and accumulates it into the buffer of its own shard."""
    single, plan = pair(8, 2, 2)
    p = mutations.copy_plan(plan)
    i = _inner(plan, "reduce_scatter", rank(3, 1))
    n = plan.nodes[i]
    p.nodes[i] = n._replace(kwargs={**n.kwargs, "index": 0})
    wrong_and_fails(single, p)


def test_a_per_use_gather_of_another_replicas_shard_fails():
    """ZeRO-3: rank (3, 0)'s in-block gather in microbatch 1 reads replica
    2's ep rank 1 shard in place of its own replica's."""
    single, plan = pair(8, 2, 3)
    p = mutations.copy_plan(plan)
    i = _inner(plan, "all_gather", rank(3, 0), mb=1)
    n = plan.nodes[i]
    x = plan.tensors[n.inputs[1]]
    other = next(k for k, t in enumerate(plan.tensors) if t.tid == x.tid
                 and t.rank == rank(2, 1) and t.version == x.version and t.mb == x.mb)
    p.nodes[i] = n._replace(inputs=(n.inputs[0], other))
    wrong_and_fails(single, p)


@pytest.mark.parametrize("zero", [2, 3])
def test_one_microbatch_op_in_one_replica_fails_with_scatters(zero):
    single, plan = pair(4, 4, zero)
    p = mutations.copy_plan(plan)
    site = next((n.dir, n.name) for n in plan.nodes if n.op == "mul_scalar" and n.mb == 2
                and abs(n.kwargs["value"]) not in (0, 1))
    hit = 0
    for i, n in enumerate(plan.nodes):  # replica edp 1
        if (n.dir, n.name) == site and n.mb == 2 and n.rank in (rank(1, 0), rank(1, 1)):
            p.nodes[i] = n._replace(op="div")
            hit += 1
    assert hit == 2
    symmetry, _ = wrong_and_fails(single, p)
    assert "microbatch 2" in symmetry


def test_ep_ranks_summing_each_others_values_of_another_buffer_fail():
    """In every replica and microbatch, ep rank 0's in-block scatter of wq
    sums ep rank 1's value of wo, and the other way round: every block is
    alike and every rank's own chain is right (what the cut sees), but the
    sums are wrong. The in-block one-buffer rule refuses it (without it: a
    wrong SUCCESS); verified in full, it FAILs."""
    single, plan = pair(8, 2, 2)
    names = ("layers.0.attention.wq.weight.grad", "layers.0.attention.wo.weight.grad")
    inner = {(n.rank, n.mb, plan.logical[plan.tensors[n.inputs[0]].tid].name): i
             for i, n in enumerate(plan.nodes) if n.op == "reduce_scatter" and len(n.inputs) == EP}
    p = mutations.copy_plan(plan)
    for edp in range(4):
        for mb in range(2):
            at = {(e, a): inner[(rank(edp, e), mb, a)] for e in range(EP) for a in names}
            own = {(e, a): plan.nodes[i].inputs[e] for (e, a), i in at.items()}
            a, b = names
            for e, x, y in ((0, a, b), (1, b, a), (0, b, a), (1, a, b)):
                ins = (own[(0, x)], own[(1, y)]) if e == 0 else (own[(0, y)], own[(1, x)])
                p.nodes[at[(e, x)]] = plan.nodes[at[(e, x)]]._replace(inputs=ins)
    symmetry, _ = wrong_and_fails(single, p)
    assert "another gradient buffer" in symmetry, symmetry
