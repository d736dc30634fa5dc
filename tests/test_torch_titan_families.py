"""torchtitan's models by family (``--model titan:llama3``, ``titan:qwen3``)
under the family's own parallelize and the tie torchtitan's trainer makes
again after it (backends/torch/titan.py); the module shorthand ``titan:``
of the docs; ``--hf deepseek_v2`` refused for its top-k routing although
its configuration leaves ``num_experts_per_tok`` unset."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.errors import LoweringError, WrongStep
from main import verify

QWEN3 = ["--model", "titan:qwen3", "--vocab", "2048", "--dp", "1", "--tp", "2", "--batch", "2"]


def test_shorthands_resolve() -> None:
    args = resolve(parser().parse_args(["--model", "titan:qwen3", "--recipe", "titan:parallelize"]))
    assert args.model == "backends.torch.titan:qwen3"
    assert args.recipe == "backends.torch.titan:parallelize"


def test_qwen3_tied_verifies_and_its_broken_tie_is_a_finding() -> None:
    args = resolve(parser().parse_args([*QWEN3, "--recipe", "titan:parallelize"]))
    (plan_s, plan_p), single = trace_and_build(args)
    assert verify(plan_s, plan_p).success
    bug = resolve(parser().parse_args(
        [*QWEN3, "--recipe", "tests.tp_plan_mistakes:titan_tie_not_made_again"]))
    with pytest.raises(WrongStep) as e:
        trace_and_build(bug, single)
    assert "model.lm_head.weight" in str(e.value)


def test_deepseek_v2_is_refused_for_its_routing() -> None:
    with pytest.raises(LoweringError) as e:
        resolve(parser().parse_args(["--hf", "deepseek_v2", "--tp", "2"]))
    assert "top-k" in str(e.value) and "n_routed_experts" in str(e.value)
