"""Bugs that shipped (gen_model/real_bugs.py, docs/real-bugs.md): each clean
base verifies; each injected plan is wrong by the oracle and fails at the
stage of the operator the bug touches, on the ranks it touches."""

from __future__ import annotations

import pytest

from backends.planfile import validate
from gen_model.oracle import judge
from gen_model.real_bugs import BUGS
from verdict.engine import verify

#: bug -> (single-device op, dir, name) of the failing stage, ranks of its flagged nodes
EXPECTED = {
    "torchtitan-2972": (("div", "bw", "truediv_2"), {4, 5, 6, 7}),
    "torchtitan-1733": (("local_grad_accumulation", "none", "tok_embeddings.weight.grad_buffer"),
                        {0, 1}),
    "megatron-6660": (("local_grad_accumulation", "none", "tok_embeddings.weight.grad_buffer"),
                      {0, 1}),
    "megatron-5956": (("einsum", "bw", "layers.1.feed_forward.einsum_4"), {0, 1, 2, 3}),
    "megatron-5047": (("div", "bw", "layers.1.feed_forward.truediv_2"), {0, 1, 2, 3}),
    "veomni-1079": (("linear", "bw", "output"), {0, 1, 2, 3}),
}


def test_every_bug_has_an_expectation():
    assert set(EXPECTED) == set(BUGS)


@pytest.mark.parametrize("key", sorted(BUGS))
def test_real_bug_is_caught_where_it_is(key):
    bug = BUGS[key]
    single, base = bug.single(), bug.base()
    memo: dict = {}
    clean = verify(single, base, memo=memo)
    assert clean.success, clean.message
    plan = bug.plan(base)
    validate(plan.to_data())  # a plan a parallelizer could have written, saved as it is
    assert not judge(single, plan).right
    verdict = verify(single, plan, memo=memo)
    assert not verdict.success and verdict.kind == "stage", verdict.message
    stage = verdict.failed[0].stage
    node = single.nodes[stage.gs_node]
    (op, direction, name), ranks = EXPECTED[key]
    assert (node.op, node.dir, node.name) == (op, direction, name)
    assert {plan.nodes[i].rank for i in stage.gp_nodes} == ranks
