"""Bugs that shipped (harness/real_bugs.py, harness/seq_bugs.py,
docs/real-bugs.md): each clean base verifies; each injected plan is a plan
file a parallelizer could write, wrong by the oracle, and fails at the stage
of the operator the bug touches, on the ranks it touches."""

from __future__ import annotations

import pytest

from backends.planfile import validate
from harness.oracle import judge
from harness.real_bugs import BUGS
from harness.seq_bugs import SEQ_BUGS
from main import verify
from verdict.report import failure

ALL = {**BUGS, **SEQ_BUGS}
LOSS_GRAD = ("div", "bw", "truediv_2")
EMBEDDING_BUFFER = ("local_grad_accumulation", "none", "tok_embeddings.weight.grad_buffer")

#: bug -> (single-device op, dir, name) of the failing stage, ranks of its
#: flagged nodes, an operator the diagnosis must name
EXPECTED = {
    "torchtitan-2972": (LOSS_GRAD, {4, 5, 6, 7}, "div"),
    "torchtitan-1733": (EMBEDDING_BUFFER, {0, 1}, "mul_scalar"),
    "megatron-6660": (EMBEDDING_BUFFER, {0, 1}, "mul_scalar"),
    "megatron-5956": (("einsum", "bw", "layers.1.feed_forward.einsum_4"), {0, 1, 2, 3},
                      "mul_scalar"),
    "megatron-5047": (("div", "bw", "layers.1.feed_forward.truediv_2"), {0, 1, 2, 3}, "div"),
    "veomni-1079": (("linear", "bw", "output"), {0, 1, 2, 3}, "mul_scalar"),
    "megatron-1446": (("local_grad_accumulation", "none", "norm.weight.grad_buffer"),
                      {0, 1, 2, 3}, "local_grad_accumulation"),
    "deepspeed-5248": (("ones", "bw", "loss.grad"), {0, 1, 2, 3}, "mul_scalar"),
    "megatron-673": (LOSS_GRAD, {0, 1, 2, 3}, "div"),
    "megatron-906": (EMBEDDING_BUFFER, {0, 1, 2, 3}, "mul_scalar"),
    "megatron-3959": (LOSS_GRAD, {0, 1, 2, 3}, "div"),
    "megatron-1465": (("matmul", "bw", "layers.1.attention.matmul_3"), {0, 1}, "split"),
    "deepspeed-1488": (EMBEDDING_BUFFER, {0, 1}, "local_grad_accumulation"),
    "torchtitan-4730": (("embedding", "fw", "tok_embeddings"), {0, 1}, "embedding"),
}
#: bugs whose plans fail before any stage: the verdict's kind
BEFORE_STAGES = {"megatron-1450": "unreachable"}
#: what each bug is, beyond a constant rescaling (docs/real-bugs.md)
KINDS = {"megatron-1465": "missing collective in the backward only",
         "deepspeed-1488": "stale value", "torchtitan-4730": "wrong shard offset",
         "megatron-1450": "wrong peer tensor"}


def test_every_bug_has_an_expectation():
    assert set(EXPECTED) | set(BEFORE_STAGES) == set(ALL)
    assert len(ALL) == 15  # the table of issue 11 and four of other kinds
    assert set(KINDS) <= set(ALL)


def test_torchtitan_1733_divides_the_sum_again():
    """As shipped: ((g1 + g2) / 2 + g3 + g4) / 2 at nm 4, two steps of 2."""
    bug = ALL["torchtitan-1733"]
    plan = bug.plan()
    scales = sorted(n.kwargs["value"] for n in plan.nodes if n.op == "mul_scalar"
                    and n.rank == 0 and n.name == "tok_embeddings.weight.grad_buffer")
    assert scales == [0.5, 0.5]


@pytest.mark.parametrize("key", list(ALL))
def test_real_bug_is_caught_where_it_is(key):
    bug = ALL[key]
    single, base = bug.single(), bug.base()
    memo: dict = {}
    clean = verify(single, base, memo=memo)
    assert clean.success, clean.message
    plan = bug.plan(base)
    validate(plan.to_data())  # a plan a parallelizer could have written, saved as it is
    assert not judge(single, plan).right
    verdict = verify(single, plan, memo=memo)
    if key in BEFORE_STAGES:
        assert not verdict.success and verdict.kind == BEFORE_STAGES[key], verdict.message
        return
    assert not verdict.success and verdict.kind == "stage", verdict.message
    stage = verdict.failed[0].stage
    node = single.nodes[stage.gs_node]
    (op, direction, name), ranks, flagged = EXPECTED[key]
    assert (node.op, node.dir, node.name) == (op, direction, name)
    assert {plan.nodes[i].rank for i in stage.gp_nodes} == ranks
    text = "\n".join(failure(verdict, single, plan))
    assert f"op='{flagged}'" in text and "🚨" in text
