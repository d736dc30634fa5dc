"""cp: the CPU flash kernel's log-sum-exp and its backward at a merged out
and lse (a ring's) lowered onto the rule table's ``attention`` and
``attention_grad`` (docs/soundness.md, "Plans traced from PyTorch", 38 (c)),
with the ring's sigmoid-form merge as plain arithmetic: the lowered step's
loss and gradients equal torch's."""

from __future__ import annotations

import pytest

import verdict_cli
from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 12, "vocab": 10, "seqlen": 4}


def test_two_block_ring_lowering_matches_torch() -> None:
    spec = {"model": "tests.cp_models:ring_tagger", "model_kwargs": SIZES, "recipe": "",
            "dp": 1, "tp": 1, "pp": 1, "batch": 2, "seqlen": SIZES["seqlen"],
            "vocab": SIZES["vocab"], "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    low = lower_trace(trace, SIZES["vocab"])
    ops = [node.op for node in low.nodes]
    assert {"attention", "attention_grad", "sigmoid"} <= set(ops)
    # one attention node per kernel call: three blocks, and the first recomputed
    # by the backward (its lse read twice by the merge, each emitted once)
    assert ops.count("attention") == 4
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads and not check.differences(rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("recipe", ["ring_ddp", "ring_ddp_wrong_merge"])
def test_blocks_of_no_single_device_tensor_are_refused_not_passed(recipe, capsys) -> None:
    code = verdict_cli.torch(["--model", "tests.cp_models:sdpa_tagger", "--recipe",
                              f"tests.cp_models:{recipe}", "--dp", "2", "--tp", "1",
                              "--layers", "1", "--hidden", "8", "--heads", "2", "--seqlen", "4",
                              "--vocab", "10"])
    assert code == 2
    assert "never combines that way" in capsys.readouterr().err
