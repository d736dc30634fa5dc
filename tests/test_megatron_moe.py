"""Megatron-Core's mixture-of-experts layer (local spec, the all-to-all token
dispatcher, top-2 routing) on one device: its permutation's
``masked_select``, ``index_select`` at an index repeating tokens, the
unpermutation's ``scatter_add_`` and the backward's ``masked_scatter`` and
``index_add`` lower exactly (docs/soundness.md, "Plans traced from
PyTorch", 47); and the all-gather of constant counts is answered by its
definition."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core")

from backends.torch.lowering import lower_trace  # noqa: E402
from backends.torch.tracer.check import check_lowering  # noqa: E402
from backends.torch.tracer.exchange import Exchanges  # noqa: E402
from backends.torch.tracer.rank import run  # noqa: E402

SIZES = {"layers": 1, "hidden": 16, "heads": 4, "ffn": 32, "vocab": 16, "seqlen": 4}


def test_megatron_moe_layer_lowers_exactly_on_one_device() -> None:
    spec = {"model": "backends.torch.megatron:moe_gpt", "model_kwargs": SIZES, "recipe": "",
            "dp": 1, "tp": 1, "pp": 1, "batch": 4, "seqlen": SIZES["seqlen"],
            "vocab": SIZES["vocab"], "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    assert trace.get("routing"), "the router's top-k was recorded"
    ops = {ev[0] for ev in trace["events"]}
    assert {"aten.masked_select.default", "aten.index_select.default",
            "aten.scatter_add_.default", "aten.masked_scatter.default"} <= ops
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert any("local_experts" in name for name in check.grads), "no expert gradient compared"
    # Megatron's router takes its softmax in float32 (dtype=torch.float32): torch's
    # values carry float32 rounding, the lowered step is exact
    differences = check.differences(rtol=1e-6, atol=1e-8)
    assert not differences, differences


def test_a_constant_all_gather_is_answered_by_its_definition() -> None:
    def sent(x) -> dict:
        return {"group": [0, 1], "k": 0, "input": np.asarray(x), "in_splits": None,
                "out_splits": None, "whole": True}
    previous = {0: [sent([1, 2])], 1: [sent([3, 4])]}
    # every member receives every member's whole input, in group order
    assert Exchanges(0, previous).answer((0, 1), 0, (4,)).tolist() == [1, 2, 3, 4]
    assert Exchanges(1, previous).answer((0, 1), 0, (4,)).tolist() == [1, 2, 3, 4]
