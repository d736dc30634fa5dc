"""The Python API (backends/torch/api.py) and the pytest helper
(backends/torch/pytest_plugin.py): a result object, a test that fails with
the diagnosis as its message."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import fully_shard

from backends.torch.api import Result, reference, verify
from backends.torch.pytest_plugin import assert_equivalent
from backends.torch.zoo.stock_models import mlp_mean


def fsdp_summed(model, mesh):
    """A mistake: FSDP2 told to sum the gradients of a per-rank mean loss."""
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh["dp"])
        module.set_gradient_divide_factor(1.0)


def test_a_wrong_recipe_fails_the_test_with_the_diagnosis() -> None:
    with pytest.raises(pytest.fail.Exception) as caught:
        assert_equivalent(mlp_mean, fsdp_summed, mesh="dp=2", hidden=8)
    message = str(caught.value)
    assert message.startswith("parallelization not proved equivalent (not equivalent):")
    assert "❌ not equivalent:" in message and "rank" in message
    assert "2 x the gradient" in message or "factor of 2" in message
    assert "Node(" not in message  # the dump stays in Result.report


def test_the_result_says_what_was_proved_and_what_was_assumed(tmp_path) -> None:
    from tests.mesh_recipes import fsdp_tp
    result = verify("backends.torch.stock_models:mlp", fsdp_tp,
                    mesh={"dp_replicate": 1, "dp_shard": 2, "tp": 1}, hidden=8, keep=tmp_path)
    assert isinstance(result, Result) and result and result.code == 0
    assert any(line.startswith("final coverage") for line in result.proved)
    assert result.assumed.startswith("assumed, not proved:")
    assert set(result.timings) == {"trace", "verify", "total"}
    assert all(p.exists() for p in result.plans)


def test_what_cannot_run_in_a_rank_is_refused() -> None:
    result = verify(mlp_mean, lambda model, mesh: None, mesh="dp=2")
    assert result.code == 2 and not result and "top level of an importable module" in result.message
    assert reference(fsdp_summed, "x") == f"{__name__}:fsdp_summed"
    assert verify(mlp_mean, fsdp_summed, mesh="tp=2,dp=2").code == 2


def test_the_docs_show_the_example_test_as_it_is() -> None:
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    example = (root / "tests" / "test_verify_example.py").read_text()
    assert f"```python\n{example}```" in (root / "docs" / "torch-backend.md").read_text()
