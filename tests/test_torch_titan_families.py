"""torchtitan's models by family (``--model titan:llama3``, ``titan:qwen3``)
under the family's own parallelize and the tie torchtitan's trainer makes
again after it (backends/torch/zoo/titan.py); the module shorthand ``titan:``
of the docs; ``--hf deepseek_v2`` given a small mixture although its
configuration leaves ``num_experts_per_tok`` unset (routed families are
traced with their routing recorded)."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.errors import WrongStep
from backends.torch.zoo import hf
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


def test_deepseek_v2_gets_a_small_mixture() -> None:
    cfg = hf.config("deepseek_v2", layers=1, hidden=64, heads=4, ffn=128, vocab=256, seqlen=4)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (hf.EXPERTS, hf.TOP_K)
    assert hf.refusal("deepseek_v2", 1) is None
