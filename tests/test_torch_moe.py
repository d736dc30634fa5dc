"""Top-k mixtures of experts traced with their routing recorded and replayed
(docs/soundness.md, "Plans traced from PyTorch", 36): the single-device
lowering against torch, a data-parallel step that verifies for the routing
it names, a rank that routes one token otherwise failing, and the replay's
refusals. More families and wrong plans are suite cases
(scripts/torch_suite.py -k moe).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

from backends.torch.__main__ import parser, trace_and_build  # noqa: E402
from backends.torch.lowering import lower_trace  # noqa: E402
from backends.torch.tracer.check import check_lowering  # noqa: E402
from backends.torch.tracer.rank import run  # noqa: E402
from backends.torch.tracer.routing import Routing, RoutingError  # noqa: E402
from main import verify  # noqa: E402

SIZES = dict(layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)


def test_single_device_lowering_matches_torch() -> None:
    spec = {"model": "backends.torch.hf:mixtral", "model_kwargs": SIZES, "recipe": "", "dp": 1,
            "tp": 1, "pp": 1, "batch": 4, "seqlen": 4, "vocab": 16, "seed": 0, "parallel": False,
            "keep_values": True}
    trace = run(spec, 0)
    assert [s["shape"] for s in trace["routing_summary"]] == [[16, 2]]
    check = check_lowering(trace, lower_trace(trace, 16), 16)
    assert "hf.model.layers.0.mlp.gate.weight" in check.grads  # the router's gradient
    # the model computes its router softmax and norms in float32
    assert not check.differences(rtol=1e-5, atol=1e-7)


def test_grouped_gemm_lowering_matches_torch() -> None:
    """torchtitan's DeepSeek-V3 debugmodel: its local dispatch (rows at
    p // K), torch._grouped_mm in bfloat16 and the scatter_add back."""
    pytest.importorskip("torchtitan", reason="needs the [titan] extra")
    flavor = {k: v for k, v in SIZES.items() if k != "layers"}  # its blocks: the first is dense
    spec = {"model": "backends.torch.titan:deepseek_v3_debugmodel", "model_kwargs": flavor,
            "recipe": "", "dp": 1, "tp": 1, "pp": 1, "batch": 2, "seqlen": 4, "vocab": 2048,
            "seed": 0, "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    check = check_lowering(trace, lower_trace(trace, 2048), 2048)
    assert any("router.gate" in name for name in check.grads)
    assert not check.differences(rtol=2e-2, atol=1e-5)  # bfloat16 experts


def _plans(argv: str):
    return trace_and_build(parser().parse_args(argv.split(" ")))[0]


def test_data_parallel_step_verifies_for_the_routing_it_names() -> None:
    plan_s, plan_p = _plans("--hf mixtral --dp 2 --tp 1")
    assert plan_s.world["routing"].startswith("router call 0: indices 16x2 sha256:")
    assert plan_p.world["routing"] == plan_s.world["routing"]
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    # a rank reading another recorded constant (another routing's mask or
    # pick, another rank's rows of it): wrong by the oracle, and FAILs
    _other_routings_fail(plan_s, plan_p, 3)


def test_a_token_routed_otherwise_on_one_rank_fails() -> None:
    plan_s, plan_p = _plans("--hf mixtral --recipe harness.moe_bugs:routed_to_other_token --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind != "internal", verdict.message


def test_replay_reads_the_ranks_rows_and_recomputes_the_values() -> None:
    recorded = np.array([[0, 1], [2, 3], [1, 0], [3, 2]])
    routing = Routing([recorded], block=(1, 2))
    scores = torch.arange(8.0).reshape(2, 4)
    values, indices = routing.call(torch.topk, (scores, 2), {}, torch.topk(scores, 2))
    assert indices.tolist() == [[1, 0], [3, 2]]
    assert values.tolist() == [[1.0, 0.0], [7.0, 6.0]]
    assert routing.summary()[0]["tokens_per_expert"] == [1, 1, 1, 1]


def test_replay_refuses_rows_it_cannot_place() -> None:
    routing = Routing([np.zeros((4, 2), dtype=np.int64)], block=(0, 2))
    scores = torch.zeros(3, 4)
    with pytest.raises(RoutingError, match="reads no rows"):
        routing.call(torch.topk, (scores, 2), {}, torch.topk(scores, 2))
    with pytest.raises(RoutingError, match="more often"):
        Routing([], block=(0, 1)).call(torch.topk, (scores, 2), {}, torch.topk(scores, 2))


def test_group_limited_router_lowering_matches_torch() -> None:
    """glm4_moe's router: a group mask scattered at the recorded group
    choice (a constant), the other groups' scores masked, top-k of the rest
    (docs/soundness.md, "Plans traced from PyTorch", group-limited routers)."""
    spec = {"model": "backends.torch.hf:glm4_moe", "model_kwargs": SIZES, "recipe": "", "dp": 1,
            "tp": 1, "pp": 1, "batch": 4, "seqlen": 4, "vocab": 16, "seed": 0, "parallel": False,
            "keep_values": True}
    trace = run(spec, 0)
    assert len(trace["routing_summary"]) == 3  # within groups, the groups, the experts
    check = check_lowering(trace, lower_trace(trace, 16), 16)
    assert "hf.model.layers.0.mlp.gate.weight" in check.grads
    assert not check.differences(rtol=1e-5, atol=1e-7)


def test_a_combine_with_another_tokens_gate_fails_at_the_permutation() -> None:
    """Rank 0 weighs its first two tokens with each other's gates, a
    permutation of the weights (``w[order]``) the single-device step never
    runs: the permuted weights stand in for the weights, claimed equal to
    them for every value of the permutation, an input of the rank's own
    (docs/soundness.md, "Plans traced from PyTorch", 73), so the step FAILs
    there, on rank 0; the oracle judges the plan wrong too."""
    from harness.oracle import judge
    from verdict.diagnosis import diagnose

    plan_s, plan_p = _plans("--hf mixtral --recipe harness.moe_bugs:combine_other_gate --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind == "stage", verdict.message
    lead = "\n".join(diagnose(verdict, plan_s, plan_p))
    assert "embedding (CausalLM.hf.model.layers.0.mlp.experts) on rank 0" in lead, lead
    assert not judge(plan_s, plan_p).right


def test_attention_experts_put_back_in_order_verify() -> None:
    """JetMoE routes its attention heads too: each (token, slot) row's query
    projection is computed on its expert's grouped rows and added back at
    the very row it came from (``index_add`` at the sorted positions), and
    the output projection's rows are gathered there again. Both are each
    row's own expert's result on the token-major rows, with no one-hot
    permutation of the rows: a rank's sort of its own rows is no piece of
    the single-device sort, and read as its own constant it made the
    correct step FAIL (issue 30)."""
    spec = {"model": "backends.torch.hf:jetmoe", "model_kwargs": SIZES, "recipe": "", "dp": 1,
            "tp": 1, "pp": 1, "batch": 4, "seqlen": 4, "vocab": 16, "seed": 0, "parallel": False,
            "keep_values": True}
    trace = run(spec, 0)
    low = lower_trace(trace, 16)
    assert not check_lowering(trace, low, 16).differences(rtol=1e-5, atol=1e-7)
    picks = [n.name for n in low.nodes
             if n.op == "embedding" and n.dir == "fw" and "embed_tokens" not in n.name]
    assert not picks, "rows of the attention experts picked by a one-hot permutation"
    plan_s, plan_p = _plans("--hf jetmoe --dp 2 --tp 1")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    _other_routings_fail(plan_s, plan_p, 2)


def _other_routings_fail(plan_s, plan_p, n: int) -> None:
    """``n`` mutants of the parallel plan reading another recorded routing
    constant: each wrong by the oracle, and each FAILs (never internal)."""
    from harness.mutations import other_routing
    from harness.oracle import judge
    for k in range(n):
        mutant, what = other_routing(plan_p, random.Random(f"routing/{k}"))
        assert not judge(plan_s, mutant).right, what
        verdict = verify(plan_s, mutant)
        assert not verdict.success and verdict.kind != "internal", what
