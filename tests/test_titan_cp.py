"""torchtitan's own context parallelism (``titan:parallelize_cp``, CP's ring
through the CPU shim) on one layer of its Llama3 debugmodel: the rotary table
gathered at each rank's positions is read as its one row
(docs/soundness.md, "Plans traced from PyTorch", 55), so the step verifies;
the positions of the next chunk give each rank the wrong angles, and FAIL
(gloo differs too: scripts/gloo_truth.py). With tp 2 beside cp 2 the
positions are first read by ``DTensor.from_local``'s view, and stay constants
(item 82): the same holds. The six-layer runs are suite cases
(``-k "cp titan"``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="needs the [titan] extra (torchtitan)")
pytest.importorskip("triton", reason="torchtitan imports triton")

from backends.torch.__main__ import parser, trace_and_build  # noqa: E402
from main import verify  # noqa: E402


def _verdict(recipe: str, mesh: str = "cp=2"):
    argv = ["--model", "backends.torch.titan:llama3_debugmodel", "--recipe",
            f"backends.torch.titan:{recipe}", "--vocab", "2048", "--seqlen", "8",
            "--batch", "2", "--layers", "1", "--mesh", mesh]
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(argv))
    return verify(plan_s, plan_p)


@pytest.mark.parametrize("mesh", ["cp=2", "cp=2,tp=2"])
def test_titan_cp_verifies(mesh: str) -> None:
    verdict = _verdict("parallelize_cp", mesh)
    assert verdict.success, verdict.message


@pytest.mark.parametrize("mesh", ["cp=2", "cp=2,tp=2"])
def test_titan_cp_positions_of_the_next_chunk_fail(mesh: str) -> None:
    verdict = _verdict("parallelize_cp_other_chunk", mesh)
    assert not verdict.success
    assert verdict.kind != "internal", verdict.message


def test_titan_tp2_cp2_positions_not_shifted_fail() -> None:
    """Every rank's positions from 0: the second cp rank rotates its tokens
    by the first chunk's angles (gloo differs too)."""
    verdict = _verdict("parallelize_cp_unshifted", "cp=2,tp=2")
    assert not verdict.success
    assert verdict.kind != "internal", verdict.message


def test_titan_qwen3_moe_cp_traces_and_is_judged() -> None:
    """torchtitan's Qwen3 MoE (grouped-query attention) under its own CP,
    its step given the data loader's positions: the rotary table's two
    halves read as one constant by value, the ring's dk and dv claimed as
    the gradients of the keys as held, a received key repeated for its
    query heads still the sender's chunk (docs/soundness.md, "Plans traced
    from PyTorch", 107), its token rows (the batch, the rank's chunk of the
    positions) written in the ranks' order (115): it verifies."""
    argv = ["--model", "titan:qwen3_moe_positions", "--recipe", "titan:parallelize_cp",
            "--vocab", "2048", "--seqlen", "8", "--batch", "2", "--layers", "1",
            "--mesh", "cp=2"]
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(argv))
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
