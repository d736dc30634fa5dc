"""Shipped bugs written on the traced code paths (harness/torch_bugs.py): each
fails at the fault; its fix is the recipe it was written from, which
verifies (tests/test_torch_backend.py, tests/test_torch_compositions.py)."""

from __future__ import annotations

from backends.torch.__main__ import parser, resolve, trace_and_build
from harness.oracle import judge
from main import verify


def test_loss_normalized_by_local_token_counts_fails() -> None:
    """Megatron-LM issue 7452, finding 3: every rank's loss is dp times its
    share, so the loss pieces of the replicas do not sum to the loss."""
    args = resolve(parser().parse_args(["--recipe", "harness.torch_bugs:tp_sp_local_token_mean"]))
    (plan_s, plan_p), _ = trace_and_build(args)
    verdict = verify(plan_s, plan_p)
    assert not verdict.success
    assert not judge(plan_s, plan_p).right
