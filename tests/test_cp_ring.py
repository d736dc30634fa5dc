"""cp: PyTorch's own ring attention (``context_parallel``'s SDPA dispatcher,
through the CPU shim) traced, lowered and verified as it ships, forward and
backward (docs/soundness.md, "Plans traced from PyTorch", 53): both
rotations verify; a merge that takes another block's log-sum-exp, or drops
the merged one's shift, fails at the attention on the rank that merges it.
The head-tail load balancer's ring is in tests/test_cp_torch_balance.py.
Real gloo runs agree (scripts/gloo_truth.py, the suite's ``cp ring``
cases)."""

from __future__ import annotations

import pytest

import verdict_cli

ARGS = ["--model", "tests.cp_models:sdpa_tagger", "--heads", "2", "--mesh", "cp=2", "--layers",
        "1", "--hidden", "8", "--seqlen", "4", "--vocab", "10", "--batch", "2"]


def _run(recipe: str, capsys) -> tuple[int, str]:
    code = verdict_cli.torch([*ARGS, "--recipe", f"tests.cp_split_recipes:{recipe}"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("recipe", ["ring_allgather", "ring_alltoall"])
def test_ring_verifies(recipe, capsys) -> None:
    code, out = _run(recipe, capsys)
    assert code == 0, out
    assert "SUCCESS" in out


@pytest.mark.parametrize("recipe", ["ring_other_lse", "ring_lse_unshifted"])
def test_a_wrong_merge_fails_at_the_attention(recipe, capsys) -> None:
    """Another block's lse (the merged out is wrong), or the merged lse
    without its shift (the out is right, the lse the backward reads is not)."""
    code, out = _run(recipe, capsys)
    assert code == 1, out
    assert "operator attention" in out and "rank 1" in out

