"""A hash router's table lookup at the ids as recorded routing, and a
parameter clamped in place in the forward (docs/soundness.md, "Plans
traced from PyTorch", 128 and 134; ``tracer/hash_routing.py``,
``lowering/compose.py``, ``tracer/copy_memory.py``).

The small models of ``tests/hash_routed_models.py`` are lowered against
torch's own values and verified under data parallelism by hand; a rank
that routes its tokens by another table is a finding (``WrongStep``, exit
1, before any proof), and FSDP2 on the clipped model FAILs (its step
clamps the gathered parameter, never the shard its backward gathers again
and its optimizer updates; gloo differs), while the clamp of the shard
before the blocks gather it verifies (gloo same)."""

from __future__ import annotations

import numpy as np
import pytest

from backends.torch.__main__ import parser, trace_and_build
from backends.torch.errors import WrongStep
from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run
from main import verify

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 12, "vocab": 10, "seqlen": 4}
HASH = "tests.hash_routed_models:hash_moe_tagger"
CLIPPED = "tests.hash_routed_models:clipped_tagger"
ROOT_CLIPPED = "tests.hash_routed_models:root_clipped_tagger"


def _single(model: str) -> dict:
    spec = {"model": model, "model_kwargs": SIZES, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 4, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"], "seed": 0,
            "parallel": False, "keep_values": True}
    return run(spec, 0)


def _pair(model: str, recipe: str, *more: str):
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(
        ["--model", model, "--recipe", recipe, "--dp", "2", "--tp", "1", "--hidden", "8",
         "--ffn", "12", "--vocab", "10", *more]))
    return plan_s, plan_p


def test_hash_lookup_is_recorded_routing() -> None:
    trace = _single(HASH)
    lookups = [e for e in trace["events"] if e[0] == "aten.index.Tensor" and e[3][0] == (16, 2)]
    assert lookups, "the table is looked up at the ids"
    chosen = lookups[0][2][0]
    assert chosen in trace["constants"], "the lookup's experts are data of the step"
    assert len(trace["routing"]) == 1 and trace["routing"][0].shape == (16, 2)
    tokens = trace["batch_ids"]["tokens"].reshape(-1)
    table = (np.arange(SIZES["vocab"])[:, None] + np.arange(2)[None, :]) % 4
    assert np.array_equal(trace["routing"][0], table[tokens])


def test_hash_routed_lowering_matches_torch() -> None:
    trace = _single(HASH)
    lowered = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, lowered, SIZES["vocab"])
    assert {"experts.gate_up", "experts.down", "router.weight"} <= set(check.grads)
    assert not check.differences(rtol=1e-9, atol=1e-11)


def test_hash_routed_verifies_under_ddp_and_other_table_fails() -> None:
    assert verify(*_pair(HASH, "backends.torch.stock_recipes:ddp")).success
    with pytest.raises(WrongStep, match=r"rank [13] routes its token row 0 at HashMoeTagger "
                                        r"\(router call 0\) to experts"):
        _pair(HASH, "tests.hash_routed_models:ddp_other_table")


def test_clamp_in_place_lowers_and_writes_back() -> None:
    trace = _single(CLIPPED)
    clamps = [e for e in trace["events"] if e[0] == "aten.clamp_.default"]
    assert clamps, "the weight's data is clamped in place"
    written = clamps[0][2][0]
    assert any(("v", written) in e[1][0] for e in trace["events"] if e[0] == "aten.t.default"), \
        "the projection reads the clamped weight"
    lowered = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, lowered, SIZES["vocab"])
    assert "layers.0.coefs.weight" in check.grads
    assert not check.differences(rtol=1e-9, atol=1e-11)


def test_clamp_in_place_verifies_with_a_step_and_a_gathered_copy_fails() -> None:
    assert verify(*_pair(CLIPPED, "backends.torch.stock_recipes:ddp", "--optimizer", "sgd")).success
    # FSDP2 clamps the gathered weight, which it frees after the forward: its backward
    # gathers the unclamped shard again and its optimizer steps the shard (gloo differs
    # about 1.44 x): the backward's product reads the weight unclamped (soundness 134)
    assert not verify(*_pair(CLIPPED, "backends.torch.stock_recipes:fsdp")).success


def test_clamp_of_the_shard_before_the_blocks_verifies_under_fsdp() -> None:
    # the root clamps each block's parameter (FSDP2's shard) under no_grad before
    # the blocks gather it: every gather, the backward's and the step read it clamped
    assert verify(*_pair(ROOT_CLIPPED, "backends.torch.stock_recipes:fsdp",
                         "--optimizer", "sgd")).success
