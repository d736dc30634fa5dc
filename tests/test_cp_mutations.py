"""cp: the context-parallel mutation operators (harness/mutations.py,
CP_MUTATIONS and CP_REWRITES). Each shipped CP bug written as a mutation of
a ring plan (gen_model/ring.py) or of the generator's all-gather CP plan is
judged wrong by the oracle and FAILs; the rewrites of a merge (another
order, PyTorch's sigmoid form) are right by the oracle and verify; the
operators leave plans without context parallelism alone. A block merged
with its own log-sum-exp is refuted by evaluation, not left to the
solver."""

from __future__ import annotations

import random

import pytest
import z3
from helpers import MLP, plan_pair

from gen_model.config import ModelConfig, Parallelism
from gen_model.parallelize import Policy
from gen_model.ring import Ring, ring_pair
from harness import mutations
from harness.oracle import judge
from main import verify
from verdict import falsify
from verdict.plan import Plan

RING = Ring(cp=2, balanced=True, scores=True)
LLAMA = ModelConfig("llama3", layers=1, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=8)


def _ring(ring: Ring = RING) -> tuple[Plan, Plan]:
    return ring_pair(ring)


def _mutants(single: Plan, plan: Plan, name: str, table: dict, tries: int = 2):
    """The operator's mutants: (mutant, where, oracle's judgement)."""
    out = []
    for k in range(tries):
        made = table[name](plan, random.Random(f"cp/{name}/{k}"))
        assert made is not None, name
        mutant, where = made
        out.append((mutant, where, judge(single, mutant)))
    return out


@pytest.mark.parametrize("name", sorted(mutations.CP_MUTATIONS))
def test_cp_mutations_of_a_balanced_ring_are_wrong_and_fail(name):
    single, plan = _ring()
    memo: dict = {}
    for mutant, where, judgement in _mutants(single, plan, name, mutations.CP_MUTATIONS):
        assert not judgement.right, where
        v = verify(single, mutant, memo=memo)
        assert not v.success and v.kind != "internal", (where, v.message)


@pytest.mark.parametrize("name", ["kv_wrong_peer", "merge_other_lse", "merge_unshifted"])
def test_cp_mutations_of_a_contiguous_ring_of_four_fail(name):
    single, plan = _ring(Ring(cp=4, scores=True))
    for mutant, where, judgement in _mutants(single, plan, name, mutations.CP_MUTATIONS):
        assert not judgement.right, where
        assert not verify(single, mutant).success, where


@pytest.mark.parametrize("ring", [RING, Ring(cp=4, scores=True)], ids=["cpbal2", "cp4"])
@pytest.mark.parametrize("name", sorted(mutations.CP_REWRITES))
def test_merge_rewrites_are_right_and_verify(name, ring):
    single, plan = _ring(ring)
    memo: dict = {}
    for mutant, where, judgement in _mutants(single, plan, name, mutations.CP_REWRITES, 3):
        assert judgement.right, (where, judgement.why)
        v = verify(single, mutant, memo=memo)
        assert v.success, (where, v.message)


def test_a_block_merged_with_its_own_lse_is_refuted_by_evaluation():
    """lse_merge of a block with itself takes the maximum of a term and
    itself: decided by syntax (verdict/falsify.py), not a near tie."""
    single, plan = _ring()
    site = next(i for i, n in enumerate(plan.nodes) if n.op == "lse_merge")
    n = plan.nodes[site]
    mutant = mutations.copy_plan(plan)
    mutant.nodes[site] = n._replace(inputs=(*n.inputs[:3], n.inputs[1]))
    assert not judge(single, mutant).right
    v = verify(single, mutant)
    assert not v.success and v.kind == "stage", v.message
    assert v.failed[0].outcome.status == "counterexample"
    assert not v.failed[0].outcome.solver


def test_llama3_cp_mutations_fail():
    """The generator's all-gather CP: a rank's rotary tables not shifted, a
    mask chunk, the loss or gradients aggregated twice over cp and dp."""
    single, plan = plan_pair(LLAMA, Parallelism(cp=2, dp=2), 4, Policy(cp_balance=True))
    memo: dict = {}
    for name in ("position_offset", "mask_chunk", "loss_twice", "balance_order"):
        for k in range(2):
            made = mutations.CP_MUTATIONS[name](plan, random.Random(f"llama/{name}/{k}"))
            assert made is not None, name
            mutant, where = made
            assert not judge(single, mutant).right, where
            assert not verify(single, mutant, memo=memo).success, where
    rotary = [mutations.position_offset(plan, random.Random(f"rope/{k}")) for k in range(8)]
    assert any("rotary" in where for _, where in rotary)


def test_cp_operators_leave_other_plans_alone():
    single, plan = plan_pair(MLP, Parallelism(dp=2, tp=2), 8)
    for table in (mutations.CP_MUTATIONS, mutations.CP_REWRITES):
        for name, operator in table.items():
            assert operator(plan, random.Random(0)) is None, name
    _, contiguous = _ring(Ring(cp=2))
    assert mutations.balance_order(contiguous, random.Random(0)) is None
    assert mutations.merge_unshifted(contiguous, random.Random(0)) is None  # no scores


def test_falsify_decides_a_term_against_itself_by_syntax():
    x, y = z3.Reals("x y")
    tie = z3.If(x >= x, x, y)  # the condition holds for every x
    assert falsify.falsify([(0, 0, tie + 1, x)]) is not None
    assert falsify.falsify([(0, 0, tie, x)]) is None
    same = z3.If(x > y, x + y, x + y)  # one term either way: no tie to meet
    assert falsify.falsify([(0, 0, same, x)]) is not None
    assert falsify.falsify([(0, 0, z3.If(x > x, y, x), x)]) is None
