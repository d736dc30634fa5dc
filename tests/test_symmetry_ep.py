"""Expert-parallel materialized plans proved by their checked symmetry: the
expert-data-parallel index is the orbit, the ep ranks sit inside a block
(docs/soundness.md, "Expert parallelism: the ep ranks inside a block").
Correct plans verify by classes; wrong ones FAIL, judged wrong by the oracle."""

from __future__ import annotations

import random

import pytest

from gen_model.config import ModelConfig, Parallelism
from harness import mutations
from harness.oracle import judge
from main import verify
from tests.helpers import plan_pair
from verdict.plan import Plan
from verdict.symmetry.find import Symmetry, find_symmetry

MOE = ModelConfig("moe", layers=1, hidden=8, heads=2, kv_heads=1, ffn=8, vocab=8, seqlen=2,
                  experts=4, topk=2, moe_ffn=4, first_dense=0)


def pair(dp: int, nm: int, ep: int = 2) -> tuple[Plan, Plan]:
    return plan_pair(MOE, Parallelism(dp=dp, ep=ep, nm=nm), 2 * dp * nm)


def wrong_and_fails(single: Plan, wrong: Plan) -> tuple[str, str]:
    """The plan is wrong by the oracle and FAILs with evidence (exit 1):
    the verifier's symmetry line and message."""
    assert not judge(single, wrong).right
    v = verify(single, wrong)
    assert not v.success and v.kind != "internal", v.message
    return v.symmetry, v.message


@pytest.mark.parametrize("dp,nm", [(4, 4), (8, 2), (2, 4)], ids=["edp2_nm4", "edp4_nm2",
                                                                "edp1_nm4"])
def test_correct_ep_plan_verifies_by_classes(dp, nm):
    single, plan = pair(dp, nm)
    assert isinstance(find_symmetry(single, plan), Symmetry)
    v = verify(single, plan)
    assert v.success, v.message
    edp = dp // 2
    assert v.symmetry.startswith(f"{edp} x {nm} blocks (expert-data-parallel replica x "
                                 f"microbatch) checked against the representatives"), v.symmetry
    assert "each block holds the 2 expert-parallel ranks of its replica" in v.symmetry
    assert v.blocks == (edp * nm, min(edp, 2) * min(nm, 2), 0) and v.classes == 1


def mutant(plan: Plan, operator: str, seed: str) -> Plan:
    made = mutations.MATERIALIZED_MUTATIONS[operator](plan, random.Random(seed))
    assert made is not None
    return made[0]


def test_one_replica_reading_another_replicas_rows_fails():
    single, plan = pair(8, 2)
    _, message = wrong_and_fails(single, mutant(plan, "other_rows", "ep/rows"))
    assert "overlapping batch rows" in message


@pytest.mark.parametrize("seed", ["ep/ep_peer/0", "ep/ep_peer/1"], ids=["peer", "order"])
def test_one_replica_routing_to_the_wrong_peer_fails(seed):
    single, plan = pair(8, 2)
    wrong_and_fails(single, mutant(plan, "ep_peer", seed))


def test_one_ep_rank_loading_another_expert_fails_in_its_class():
    single, plan = pair(8, 2)
    symmetry, _ = wrong_and_fails(single, mutant(plan, "ep_expert", "ep/ep_expert/0"))
    assert "classes of blocks" in symmetry and "FAILED in its own cut" in symmetry, symmetry


def test_one_microbatch_op_in_one_replica_fails():
    single, plan = pair(4, 4)
    p = mutations.copy_plan(plan)
    site = next((n.dir, n.name) for n in plan.nodes if n.op == "mul_scalar" and n.mb == 2
                and abs(n.kwargs["value"]) not in (0, 1))
    hit = 0
    for i, n in enumerate(plan.nodes):  # replica edp 1: ranks 2 and 3
        if (n.dir, n.name) == site and n.mb == 2 and n.rank in (2, 3):
            p.nodes[i] = n._replace(op="div")
            hit += 1
    assert hit == 2
    symmetry, _ = wrong_and_fails(single, p)
    assert "microbatch 2" in symmetry


def test_expert_gradient_reduced_over_the_wrong_group_fails():
    single, plan = pair(8, 2)
    wrong_and_fails(single, mutant(plan, "expert_group", "ep/expert_group/0"))
