"""The sequence-dimension bugs that shipped (gen_model/seq_bugs.py): each
clean base plan verifies, each injected plan is wrong by the oracle and
fails, the failing stage named by its operator and ranks."""

from __future__ import annotations

import pytest

from backends.planfile import validate
from gen_model.oracle import judge
from gen_model.seq_bugs import SEQ_BUGS
from verdict.engine import verify
from verdict.report import failure

#: bug -> (operator of the failing stage's single-device node, a line of the diagnosis)
EXPECTED = {
    "megatron-1446": ("local_grad_accumulation", "name='norm.weight.grad_buffer'"),
    "deepspeed-5248": ("ones", "op='mul_scalar'"),
}


@pytest.mark.parametrize("name", list(SEQ_BUGS))
def test_bug_is_caught_and_base_verifies(name):
    bug = SEQ_BUGS[name]
    single, clean = bug.single(), bug.base()
    memo: dict = {}
    assert judge(single, clean).right
    assert verify(single, clean, memo=memo).success
    buggy = bug.plan(clean)
    validate(buggy.to_data())
    assert not judge(single, buggy).right
    v = verify(single, buggy, memo=memo)
    assert not v.success and v.kind == "stage"
    op, line = EXPECTED[name]
    assert single.nodes[v.failed[0].stage.gs_node].op == op
    text = "\n".join(failure(v, single, buggy))
    assert line in text and "rank=1" in text
