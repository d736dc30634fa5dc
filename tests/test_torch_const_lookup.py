"""A table sharded by rows and looked up at ids computed from constants:
PyTorch's own tensor-parallel test model (tests/dtensor_transformer.py), its
position table under ``RowwiseParallel`` looked up at ``torch.arange``
positions, verifies under its own ``Transformer.parallelize`` (TP, TP+SP,
tp 4, tied, FSDP2), and a mistake in the same plan fails at the gradient
(backends/torch/lowering/const_lookup.py; scripts/gloo_truth.py agrees)."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from main import verify

DT = "tests.dtensor_transformer:"


def _verdict(model: str, recipe: str, mesh: list[str]):
    args = resolve(parser().parse_args(["--model", DT + model, "--recipe", DT + recipe, *mesh]))
    (plan_s, plan_p), _ = trace_and_build(args)
    return plan_p, verify(plan_s, plan_p)


@pytest.mark.parametrize("model, recipe, mesh", [
    ("transformer", "tp", ["--dp", "2", "--tp", "2"]),
    ("transformer_tied", "tp_sp", ["--dp", "2", "--tp", "2"]),
    ("transformer", "tp_sp", ["--dp", "1", "--tp", "4", "--seqlen", "8"]),
    ("transformer_tied", "fsdp_tp", ["--dp", "2", "--tp", "2"])])
def test_position_table_sharded_by_rows_verifies(model: str, recipe: str,
                                                 mesh: list[str]) -> None:
    plan_p, verdict = _verdict(model, recipe, mesh)
    assert verdict.success
    # the lookup reads the rank's columns of the positions' one-hot rows
    assert any(n.op == "embedding" and "pos_embeddings" in n.name for n in plan_p.nodes)


def test_gradients_averaged_over_dp_fail() -> None:
    _, verdict = _verdict("transformer", "tp_sp_dp_averaged", ["--dp", "2", "--tp", "2"])
    assert not verdict.success and "1/2 x the gradient" in verdict.message
