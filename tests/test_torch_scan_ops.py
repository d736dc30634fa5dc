"""``torch.cumsum``, ``torch.flip`` and zero padding (and its crop, the
padding's backward) of computed tensors (backends/torch/lowering/scan.py,
tests/scan_models.py): the lowered single-device step equals PyTorch's loss
and gradients, and the model verifies under DDP. The same holds for the
label-smoothing and log-softmax readers and the label masks lowered
elsewhere, checked here against PyTorch too."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.lowering import lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run
from main import verify

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 12, "vocab": 10, "seqlen": 4}


@pytest.mark.parametrize("model", [
    "tests.scan_models:scan_tagger", "tests.label_mask_models:masked_fill",
    "tests.label_mask_models:where", "tests.label_mask_models:masked_fill_mean",
    "tests.loss_parallel_models:log_softmax_smoothed", "tests.loss_parallel_models:log_softmax_nll"])
def test_lowering_matches_torch(model: str) -> None:
    spec = {"model": model, "model_kwargs": SIZES, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 2, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"], "seed": 0,
            "parallel": False, "keep_values": True}
    trace = run(spec, 0)
    check = check_lowering(trace, lower_trace(trace, SIZES["vocab"]), SIZES["vocab"])
    assert check.grads and not check.differences(rtol=1e-9, atol=1e-11)


def test_scan_tagger_verifies_under_ddp() -> None:
    args = resolve(parser().parse_args(["--model", "tests.scan_models:scan_tagger", "--recipe",
                                        "backends.torch.stock_recipes:ddp", "--dp", "2",
                                        "--tp", "1"]))
    (plan_s, plan_p), _ = trace_and_build(args)
    assert verify(plan_s, plan_p).success
