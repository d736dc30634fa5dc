"""A constant true at several cuts has its cut chosen where it meets a
computed value (``backends/torch/tracer/align/recut.py``; docs/soundness.md,
"Plans traced from PyTorch", 68): a rotary table computed per batch row
from positions laid out (axes, batch, sequence) is equal on every row, a
piece of the single-device table at a "tp" cut and a "dp" cut alike; the
queries it multiplies are cut by "dp", so the table is claimed by "dp"
(Cohere Compass's text model's false alarm at dp 2 tp 2). Rows of the
table that are another rank's (positions offset by the local row index)
still FAIL. gloo agrees on every case (scripts/gloo_truth.py: ``same`` for
the two correct recipes, ``differs`` for the offset rows)."""

from __future__ import annotations

import shlex

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from main import verify
from verdict.diagnosis import diagnose

MODELS = "tests.recut_models:"
STOCK = "backends.torch.stock_recipes:"


def _verdict(model: str, recipe: str, tp: int = 2):
    argv = f"--model {MODELS}{model} --recipe {STOCK}{recipe} --dp 2 --tp {tp}"
    (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(shlex.split(argv))))
    verdict = verify(plan_s, plan_p)
    return verdict, "\n".join(diagnose(verdict, plan_s, plan_p))


@pytest.mark.parametrize("recipe", ["tp_attention", "fsdp_tp_attention"])
def test_a_table_alike_on_every_row_is_cut_as_the_queries(recipe: str) -> None:
    verdict, _ = _verdict("batch_second_rotary_lm", recipe)
    assert verdict.success, verdict.message


@pytest.mark.parametrize(("recipe", "tp"), [("tp_attention", 2), ("ddp", 1)])
def test_rows_offset_by_the_local_index_fail(recipe: str, tp: int) -> None:
    verdict, lines = _verdict("row_offset_rotary_lm", recipe, tp)
    assert not verdict.success
    assert verdict.kind == "stage", verdict.message
    assert "layers.0.attn" in lines, lines


def test_a_plan_mistake_still_fails_with_the_table() -> None:
    verdict, _ = _verdict("batch_second_rotary_lm", "tp_attention_no_dp_sum")
    assert not verdict.success
    assert verdict.kind != "internal", verdict.message
