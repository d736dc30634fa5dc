"""Expert parallelism with an all-to-all dispatch of uneven split sizes
(docs/soundness.md, "Plans traced from PyTorch", 37): the count exchange
answered from the members' sends, torchtitan's DeepSeek-V3 at dp 2 ep 2
verifying for the routing it names, and pytorch issue 160285 (expert
gradients ep times too large) failing at the experts' gradient, and a
combine with another token's scores failing at the lookup that swaps them."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchtitan", reason="needs torchtitan")

from backends.torch.__main__ import parser, trace_and_build  # noqa: E402
from backends.torch.errors import LoweringError  # noqa: E402
from backends.torch.tracer.exchange import Exchanges, settled  # noqa: E402
from main import verify  # noqa: E402

EP = ["--model", "backends.torch.titan:deepseek_v3_debugmodel_ep", "--vocab", "2048",
      "--dp", "2", "--tp", "1"]


def _sent(x, splits) -> dict:
    return {"group": [0, 1], "k": 0, "input": np.asarray(x), "in_splits": splits,
            "out_splits": None}


def test_a_constant_all_to_all_is_answered_by_its_definition() -> None:
    previous = {0: [_sent([[1, 2], [3, 4], [5, 6]], [1, 2])],
                1: [_sent([[7, 8], [9, 10]], [2, 0])]}
    # rank 0 receives block 0 of every member: rank 0's first row, rank 1's two rows
    assert Exchanges(0, previous).answer((0, 1), 0, (3, 2)).tolist() == [[1, 2], [7, 8], [9, 10]]
    # rank 1 receives block 1: rank 0's last two rows, none of its own
    assert Exchanges(1, previous).answer((0, 1), 0, (2, 2)).tolist() == [[3, 4], [5, 6]]
    with pytest.raises(LoweringError):  # the members send it another shape than it expects
        Exchanges(1, previous).answer((0, 1), 0, (3, 2))
    assert Exchanges(0, {1: []}).answer((0, 1), 0, (3, 2)) is None  # not yet sent: next pass
    again = {0: [_sent([[1, 2], [3, 4], [5, 6]], [1, 2])], 1: [_sent([[7, 8], [9, 0]], [2, 0])]}
    assert settled(previous, previous) and not settled(previous, again)


@pytest.fixture(scope="module")
def traced() -> tuple:
    """DeepSeek-V3 at dp 2 ep 2 under its family's own parallelize function:
    the two plans and the single-device trace, which the wrong recipes
    below reuse (a recipe changes the ranks' steps, never the
    single-device step, ``rank._setup``)."""
    args = parser().parse_args([*EP, "--recipe", "backends.torch.titan:parallelize_deepseekv3_ep"])
    return trace_and_build(args)


def test_deepseek_v3_ep2_verifies_and_expert_grads_2x_fail(traced) -> None:
    (plan_s, plan_p), single = traced
    assert "router call 0" in plan_s.world["routing"]
    assert any(n.op == "send_recv" for n in plan_p.nodes)  # the dispatch moved rows
    assert verify(plan_s, plan_p).success
    bug = parser().parse_args([*EP, "--recipe", "harness.moe_bugs:titan_ep_expert_grads_undivided"])
    (plan_s, plan_p), _ = trace_and_build(bug, single)
    result = verify(plan_s, plan_p)
    assert not result.success


def test_deepseek_v3_ep2_combine_with_another_tokens_gate_fails_at_the_lookup(traced) -> None:
    """Rank 0 flattens its scores, swaps two tokens' rows and reads them
    back in the scores' shape, which the routed experts flatten again: the
    lookup stands in for the flattened scores (docs/soundness.md, "Plans
    traced from PyTorch", 73), the reshape back is left out (84), and the
    step FAILs at the lookup on rank 0; the oracle judges it wrong too."""
    from harness.oracle import judge
    from verdict.diagnosis import diagnose

    bug = parser().parse_args([*EP, "--recipe", "harness.moe_bugs:titan_ep_combine_other_gate"])
    (plan_s, plan_p), _ = trace_and_build(bug, traced[1])
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage", verdict.message
    lead = "\n".join(diagnose(verdict, plan_s, plan_p))
    assert "embedding (TitanLM.model.layers.1.moe.routed_experts) on rank 0" in lead, lead
    assert not judge(plan_s, plan_p).right
