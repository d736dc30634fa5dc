"""Losses read off the log-probabilities (tests/loss_parallel_models.py;
backends/torch/lowering/logprob_views.py): ``log_softmax`` of 3-D logits,
flattened, then ``nll_loss`` verifies with and without DTensor's
``loss_parallel()``; a second reader of the log-probabilities (label
smoothing) verifies without it and fails with a counterexample under it,
whose log-softmax backward passes that reader's gradient through unchanged
(pytorch issue 190746; scripts/gloo_truth.py agrees)."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from main import verify

LP = "tests.loss_parallel_models:"


def _verdict(model: str, recipe: str):
    args = resolve(parser().parse_args(["--model", LP + model, "--recipe", recipe]))
    (plan_s, plan_p), _ = trace_and_build(args)
    return verify(plan_s, plan_p)


@pytest.mark.parametrize("model, recipe", [
    ("log_softmax_nll", "tp_sp_loss_parallel"), ("log_softmax_nll", "tp_sp"),
    ("log_softmax_smoothed", "tp_sp")])
def test_log_probabilities_read_by_the_loss_verify(model: str, recipe: str) -> None:
    assert _verdict(model, recipe).success


def test_second_reader_under_loss_parallel_fails() -> None:
    verdict = _verdict("log_softmax_smoothed", "tp_sp_loss_parallel")
    assert not verdict.success and verdict.kind == "stage"
    assert any(r.outcome.status == "counterexample" for r in verdict.failed)
