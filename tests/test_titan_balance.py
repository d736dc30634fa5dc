"""torchtitan's load-balancing bias update traced on its optimizer step
(docs/soundness.md, "Plans traced from PyTorch", 105): the SUM all-reduce
of constant counts answered by its definition, the buffers the step
updates compared by value, and torchtitan's DeepSeek-V3 at dp 2 verifying
with its hook while the counts left unreduced FAIL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from backends.torch.errors import LoweringError, WrongStep
from backends.torch.tracer.exchange import Exchanges
from backends.torch.tracer.final_buffers import check_final_buffers

BIAS = "model.layers.1.moe.expert_bias_E"


def _sum_sent(x) -> dict:
    return {"group": [0, 1], "k": 0, "input": np.asarray(x, dtype=np.float32),
            "in_splits": None, "out_splits": None, "whole": True, "sum": True}


def test_a_constant_all_reduce_is_answered_with_the_members_sum() -> None:
    previous = {0: [_sum_sent([[1, 0, 2]])], 1: [_sum_sent([[3, 4, 0]])]}
    assert Exchanges(0, previous).total((0, 1), 0, (1, 3)).tolist() == [[4, 4, 2]]
    assert Exchanges(1, {0: previous[0]}).total((0, 1), 0, (1, 3)) is None  # next pass
    halves = {0: [_sum_sent([[0.5, 0, 0]])], 1: previous[1]}
    with pytest.raises(LoweringError, match="not integers"):
        Exchanges(0, halves).total((0, 1), 0, (1, 3))
    with pytest.raises(LoweringError, match="meets a member's"):
        Exchanges(0, previous).total((0, 1), 0, (3,))


def test_all_reduces_are_answered_only_when_the_step_asks() -> None:
    assert not Exchanges(0).handles("c10d.allreduce_.default")
    assert Exchanges(0, reduce=True).handles("c10d.allreduce_.default")


def _trace(rank: int, bias: list[float], constant: bool = True) -> dict:
    return {"rank": rank, "final_buffers": {BIAS: (constant, np.asarray(bias))}}


def test_final_buffers_equal_by_value_or_a_finding() -> None:
    single = _trace(0, [0.001, -0.001])
    assert BIAS in check_final_buffers(single, [_trace(0, [0.001, -0.001]),
                                                _trace(1, [0.001, -0.001])])
    assert check_final_buffers({"final_buffers": {}}, []) is None
    with pytest.raises(WrongStep, match="rank 1 ends its step with another"):
        check_final_buffers(single, [_trace(0, [0.001, -0.001]), _trace(1, [-0.001, 0.001])])
    with pytest.raises(WrongStep, match="holds no buffer"):
        check_final_buffers(single, [{"rank": 0, "final_buffers": {}}])
    with pytest.raises(LoweringError, match="no constant"):
        check_final_buffers(single, [_trace(0, [0.001, -0.001], constant=False)])


def test_torchtitans_hook_on_one_device_moves_the_bias_by_the_batch_counts() -> None:
    """``OneDevice``: torchtitan's own hook with no mesh of size > 1 reads the
    counts as they are (no collective), moves the bias by the signs about
    their mean less the signs' mean, and zeroes them."""
    pytest.importorskip("torchtitan", reason="needs torchtitan")
    from backends.torch.zoo.titan_balance import balanced
    model = balanced("deepseek_v3")(layers=2, seqlen=4)
    assert model.final_buffers == ["model.layers.1.moe.expert_bias_E",
                                   "model.layers.1.moe.tokens_per_expert_E"]
    moe = model.model.layers["1"].moe
    counts = torch.tensor([8.0, 9, 3, 5, 10, 4, 3, 6])
    moe.tokens_per_expert_E.copy_(counts)
    assert not dist.is_initialized()
    model.own_optimizer("sgd")
    sign = torch.sign(counts.mean() - counts)
    want = moe.load_balance_coeff * (sign - sign.mean())
    assert torch.allclose(moe.expert_bias_E, want)
    assert not moe.tokens_per_expert_E.any()


def test_deepseek_v3_dp2_bias_verifies_and_unreduced_counts_fail() -> None:
    pytest.importorskip("torchtitan", reason="needs torchtitan")
    from backends.torch.__main__ import parser, trace_and_build
    from main import verify
    common = ["--model", "backends.torch.zoo.titan_balance:deepseek_v3", "--vocab", "2048",
              "--layers", "2", "--dp", "2", "--tp", "1", "--optimizer", "sgd"]
    args = parser().parse_args([*common, "--recipe",
                                "backends.torch.zoo.titan_balance:parallelize"])
    (plan_s, plan_p), single = trace_and_build(args)
    assert BIAS in plan_s.world["final_buffers"]
    assert verify(plan_s, plan_p).success
    bug = parser().parse_args([*common, "--recipe",
                               "backends.torch.zoo.titan_balance:parallelize_counts_not_reduced"])
    with pytest.raises(WrongStep, match="expert_bias_E"):
        trace_and_build(bug, single)


def test_the_global_balance_loss_is_transformers_on_one_device() -> None:
    """``hf_moe_global``'s loss with no group (one device) is transformers'
    ``load_balancing_loss_func`` of the same router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from backends.torch.zoo.hf_moe_global import mixtral
    torch.manual_seed(0)
    model = mixtral(layers=2, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4).double()
    model.global_tokens = 16
    tokens = torch.randint(0, 16, (4, 4))
    model(tokens, tokens)
    assert len(model.router_logits) == 2
    theirs = load_balancing_loss_func(tuple(model.router_logits), model.hf.num_experts,
                                      model.hf.num_experts_per_tok, None)
    mine = model.balance_loss(tuple(model.router_logits))
    assert abs(float(mine) - float(theirs)) < 1e-6


def test_a_balanced_model_of_the_loader_positions_is_named_by_family() -> None:
    """``titan_balance:NAME_positions`` (the step given the data loader's
    positions, for torchtitan's CP: docs/soundness.md, "Plans traced from
    PyTorch", 115) is the family's balanced model; a family without load
    balancing is none."""
    from backends.torch.zoo import titan_balance
    assert titan_balance.balanced("qwen3_moe_positions").__name__ == "qwen3_moe_positions"
    with pytest.raises(AttributeError):
        titan_balance.balanced("llama3_positions")
