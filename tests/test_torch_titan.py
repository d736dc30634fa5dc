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


def test_deepseek_v3_tensor_parallelism_is_refused_with_its_reason() -> None:
    """Its top-k routing is traced recorded (tests/test_torch_moe.py; the
    suite's "moe titan" cases); expert and tensor parallelism are refused,
    the reason named (the suite runs it end to end: exit 2)."""
    from backends.torch.titan import parallelize_deepseekv3

    class Dim:
        def __init__(self, n: int) -> None:
            self.n = n

        def size(self) -> int:
            return self.n

    with pytest.raises(ValueError, match="all-to-all dispatch is not lowered"):
        parallelize_deepseekv3(None, {"tp": Dim(2), "pp": Dim(1), "dp": Dim(1)})
