"""Megatron's own gradient clipping (``backends.torch.megatron:clip_grad_norm``):
its ``if clip_coeff < 1.0:`` is a guard taken alike on one device and on
every rank, each rank's number claimed and proved equal to the single-device
one (docs/soundness.md, "Plans traced from PyTorch", 69-71)."""

import pytest

pytest.importorskip("megatron.core")

from backends.torch.__main__ import parser, resolve, trace_and_build  # noqa: E402
from backends.torch.lowering import LoweringError  # noqa: E402
from main import verify  # noqa: E402

MEGATRON = "--model backends.torch.megatron:gpt --recipe backends.torch.megatron:tp --dp 1 --tp 2 "


def _verdict(argv: str):
    args = resolve(parser().parse_args(argv.split()))
    plan_s, plan_p = trace_and_build(args)[0]
    return plan_s, verify(plan_s, plan_p)


@pytest.mark.parametrize("clip, taken", [(0.5, True), (1000.0, False)])
def test_megatron_clipping_verifies_with_its_branch_named(clip: float, taken: bool) -> None:
    plan_s, verdict = _verdict(f"{MEGATRON}--clip {clip} "
                               "--clipper backends.torch.megatron:clip_grad_norm")
    assert verdict.success
    guards = plan_s.world["guards"]
    assert "clip_grad_by_total_norm_fp32" in guards and f"< 1.0 is {taken}" in guards


def test_norm_over_the_wrong_group_fails() -> None:
    _, verdict = _verdict(f"{MEGATRON}--clip 0.5 --clipper tests.norm_clippers:megatron_norm_over_dp")
    assert not verdict.success and verdict.kind == "stage"


def test_branch_the_single_device_step_does_not_take_is_refused() -> None:
    with pytest.raises(LoweringError, match="not the single-device step's"):
        _verdict(f"{MEGATRON}--clip 0.5 "
                 "--clipper tests.norm_clippers:megatron_large_branch_other_side")
