"""torchtitan's Llama3 debugmodel parallelized by its own
``parallelize_llama`` (TP with sequence parallelism, its vocabulary-parallel
embedding and loss-parallel cross-entropy, FSDP2 of one rank), traced under
the CPU shim and verified. The other meshes are in scripts/run_torch_suite.sh
(``-k titan``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="needs the [titan] extra (torchtitan)")
pytest.importorskip("triton", reason="torchtitan imports triton")

from backends.torch.__main__ import parser, trace_and_build  # noqa: E402
from main import verify  # noqa: E402

TITAN = ["--model", "backends.torch.titan:llama3_debugmodel", "--recipe",
         "backends.torch.titan:parallelize", "--dp", "1", "--tp", "2", "--vocab", "2048",
         "--batch", "2"]


def test_titan_debugmodel_tp2_verifies() -> None:
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(TITAN))
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message
    assert {t.rank for t in plan_p.tensors} == {0, 1}


def test_deepseek_v3_tensor_parallelism_verifies() -> None:
    """torchtitan's DeepSeek-V3 under its own tensor-parallel plan (the
    attention's and the experts' own, the routing recorded and replayed):
    every rank's loss and gradients as the single-device step's."""
    argv = ["--model", "backends.torch.titan:deepseek_v3_debugmodel", "--recipe",
            "backends.torch.titan:parallelize_deepseekv3", "--dp", "1", "--tp", "2",
            "--vocab", "2048"]
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(argv))
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message


def test_layers_cut_or_repeat_the_flavors_blocks() -> None:
    """``--layers N``: the flavor's first N blocks, or its blocks and copies
    of its last; without it the flavor's own; the pipeline takes one
    microbatch a stage past two stages."""
    from backends.torch.__main__ import model_kwargs
    from backends.torch.zoo.titan import llama3_debugmodel, microbatches
    assert len(llama3_debugmodel(layers=8).model.layers) == 8
    assert len(llama3_debugmodel(layers=2).model.layers) == 2
    assert "layers" not in model_kwargs(parser().parse_args(TITAN))
    assert model_kwargs(parser().parse_args(TITAN + ["--layers", "3"]))["layers"] == 3
    assert model_kwargs(parser().parse_args([]))["layers"] == 1
    assert [microbatches(pp) for pp in (1, 2, 4, 8)] == [2, 2, 4, 8]
