"""The tensor-parallel plan of ``encoder_tagger`` with local heads under
``loss_parallel()`` (a mean cross-entropy of flattened logits: the count of
kept labels read outside the loss-parallel pattern, docs/soundness.md,
"Plans traced from PyTorch", 120 (a)-(c)) verifies, its mistakes and a
trainer's wrong clipper fail; FSDP2's ``ReduceOp.PREMUL_SUM`` reduce-scatter
(120 (d)) is lowered with its recorded factor. Each verdict is judged by
the oracle too."""

from __future__ import annotations

import shlex

import pytest
import torch.distributed as dist

from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.errors import LoweringError
from backends.torch.lowering.ir import ChunkCat
from backends.torch.lowering.layout import _reduce_scatter_base
from backends.torch.lowering.reduce_ops import premul_factor
from backends.torch.tracer.reduce_ops import recorded_reduce_op
from harness.oracle import judge
from main import verify

M = "tests.outside_apis_models:"
R = "tests.outside_apis_recipes:"
TAGGER = f"--model {M}encoder_tagger --dp 2 --tp 2 --recipe {R}"
VIT = f"--model {M}vit_classifier --dp 2 --tp 1 --recipe {R}"
_SINGLES: dict = {}


def plans(argv: str):
    args = resolve(parser().parse_args(shlex.split(argv)))
    key = (args.model, args.layers, args.clip)  # the single-device step clips too
    (plan_s, plan_p), _SINGLES[key] = trace_and_build(args, _SINGLES.get(key))
    return plan_s, plan_p


def verdict_and_truth(argv: str) -> tuple[bool, str, bool]:
    plan_s, plan_p = plans(argv)
    verdict = verify(plan_s, plan_p)
    return verdict.success, verdict.message, judge(plan_s, plan_p).right


@pytest.mark.parametrize("argv, right", [
    (f"{TAGGER}tp_sp_local_heads", True),
    (f"{TAGGER}tp_sp_partials_kept", False),
    (f"{TAGGER}tp_sp_summed_over_dp", False),
    (f"{TAGGER}tp_sp_local_heads --clip 1.0 --clipper {R}clip_trainer", True),
    (f"{TAGGER}tp_sp_local_heads --clip 1.0 --clipper {R}clip_trainer_counted_everywhere", False),
])
def test_loss_parallel_mean(argv: str, right: bool) -> None:
    """DTensor's loss-parallel mean divides by ``(labels != -100).sum()``:
    the labels' flag read as a count; the right plans verify, the wrong FAIL."""
    success, message, truth = verdict_and_truth(argv)
    assert success == right, message
    assert truth == right


@pytest.mark.parametrize("argv, right", [
    (f"{VIT}fsdp_blocks_sum_share", True),
    (f"{VIT}fsdp_blocks_sum", False),
    (f"{VIT}fsdp_blocks_factor4", False),
])
def test_fsdp_premul_sum(argv: str, right: bool) -> None:
    """FSDP2 under a float32 policy reduce-scatters with ``PREMUL_SUM(1 /
    factor)``: factor 1 is right for a loss shared out over dp, wrong (2 x)
    for a per-rank mean; factor 4 is half the average."""
    success, message, truth = verdict_and_truth(argv)
    assert success == right, message
    assert truth == right
    if not right:
        assert "x the gradient" in message


def test_premul_factor_recorded_from_the_caller() -> None:
    """The recorder reads the factor from the caller's Python ReduceOp (or
    its options); without one the op is recorded bare, and the lowering
    refuses it."""
    def collective(op):  # stands for c10d's Python entry point
        return recorded_reduce_op(8)

    assert collective(dist.ReduceOp.PREMUL_SUM(0.25)) == ("redop", 8, 0.25)
    assert recorded_reduce_op(8) == ("redop", 8)
    assert recorded_reduce_op(0) == ("redop", 0)
    assert premul_factor(("redop", 8, 0.25)) == 0.25
    assert premul_factor(["redop", 8]) is None
    assert premul_factor(["redop", 0]) is None


def test_premul_sum_without_factor_refused() -> None:
    """A PREMUL_SUM reduce-scatter of FSDP2's buffer recorded without its
    factor is refused in one line."""
    class Lw:
        name = "FSDP.blocks.0"
        env = {1: ChunkCat([5], 2)}

    with pytest.raises(LoweringError, match="reduce-scatter with reduce op .*8.* is not lowered"):
        _reduce_scatter_base(Lw(), [("v", 0), ("v", 1), ("pg", (0, 1)), ("redop", 8)], {},
                             [(4,)], None)
