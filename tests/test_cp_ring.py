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



@pytest.mark.parametrize(("recipe", "right"), [("ring_allgather", True), ("ring_alltoall", True),
                                               ("ring_other_lse", False)])
def test_a_grouped_query_ring(recipe, right, capsys) -> None:
    """Two query heads per key and value head (``enable_gqa``): the ring's
    dk and dv are claimed as the single-device gradients of the keys as
    held (the repeat's backward), and a received key repeated for its
    query heads is still the sender's chunk (docs/soundness.md, "Plans
    traced from PyTorch", 107 (b), (c)); both rotations verify, and a
    merge with another block's lse still fails at the attention."""
    args = [*ARGS, "--recipe", f"tests.cp_split_recipes:{recipe}"]
    args[args.index("tests.cp_models:sdpa_tagger")] = "tests.cp_models:sdpa_gqa_tagger"
    args[args.index("--heads") + 1] = "4"
    args[args.index("--hidden") + 1] = "16"
    code = verdict_cli.torch(args)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    if right:
        assert code == 0, out
        assert "SUCCESS" in out
    else:
        assert code == 1, out
        assert "operator attention" in out
