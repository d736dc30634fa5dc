"""Labels masked the usual ways before the loss ignores them
(tests/label_mask_models.py; backends/torch/lowering/label_masks.py):
``masked_fill``, ``torch.where`` and an in-place write at ``labels == pad``
verify under data and tensor parallelism; a per-rank mean over unequal
kept-label counts summed over dp fails; ids read as numbers are refused
with the op and the value named (backends/torch/lowering/refusals.py), never
a fall-through."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.errors import LoweringError
from main import verify

LM = "tests.label_mask_models:"
STOCK = "backends.torch.stock_recipes:"


def _verdict(model: str, recipe: str, dp: int, tp: int):
    args = resolve(parser().parse_args(["--model", LM + model, "--recipe", STOCK + recipe,
                                        "--dp", str(dp), "--tp", str(tp)]))
    (plan_s, plan_p), _ = trace_and_build(args)
    return verify(plan_s, plan_p)


@pytest.mark.parametrize("model, recipe, dp, tp", [
    ("masked_fill", "ddp", 2, 1), ("where", "fsdp", 2, 1), ("index_put", "fsdp_tp_mlp", 2, 2),
    ("masked_fill_mean", "tp_mlp", 1, 2)])
def test_masked_labels_verify(model: str, recipe: str, dp: int, tp: int) -> None:
    assert _verdict(model, recipe, dp, tp).success


def test_kept_label_means_summed_over_dp_fail() -> None:
    verdict = _verdict("masked_fill_mean", "ddp", 2, 1)
    assert not verdict.success and verdict.kind == "stage"


def test_ids_read_as_numbers_are_refused_naming_op_and_value() -> None:
    with pytest.raises(LoweringError) as e:
        _verdict("doubled", "ddp", 2, 1)
    message = str(e.value)
    assert "aten.mul.Tensor" in message and "the batch's integer ids" in message
    assert "LabelMaskedLM" in message and "layout buffer" not in message
