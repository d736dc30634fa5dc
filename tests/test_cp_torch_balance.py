"""cp: PyTorch's ring attention with its head-tail load balancer (rank r holds
chunks r and 2 cp - 1 - r), verified by writing the single-device step in
the balancer's order (docs/soundness.md, "Plans traced from PyTorch",
64-67): the rule table's attention told the chunk order agrees with torch
on the permuted sequence; the balanced ring verifies with both rotations;
a rank that undoes the order wrongly fails naming it; a table of positions
read along the sequence is refused. Real gloo runs agree (the suite's
``cp ring load-balanced`` cases, scripts/gloo_truth.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verdict_cli
from backends.torch.tracer.rank import sequence_order
from backends.torch.tracer.seq_order import chunk_order
from harness.evaluator import _attention, _attention_grad
from verdict.ops import get_op

HEAD_TAIL = [0, 1, 6, 7, 2, 3, 4, 5]  # the balancer's order at seqlen 8, cp 2
ARGS = ["--model", "tests.cp_models:sdpa_tagger", "--heads", "2", "--mesh", "cp=2", "--layers",
        "1", "--hidden", "8", "--seqlen", "8", "--vocab", "10", "--batch", "2"]


def test_chunk_order_is_the_coarsest() -> None:
    assert chunk_order(HEAD_TAIL) == (0, 3, 1, 2)
    assert chunk_order(list(range(6))) == (0,)
    assert chunk_order([1, 0, 2]) == (1, 0, 2)


def test_the_head_tail_balancer_orders_the_batch() -> None:
    class Model(torch.nn.Module):
        pass

    model = Model()
    assert sequence_order(model, 8, 2) is None
    from tests.cp_split_recipes import _head_tail
    model.cp_load_balancer = _head_tail
    assert sequence_order(model, 8, 2) == HEAD_TAIL


def test_a_balancer_ordering_rows_differently_is_refused() -> None:
    class Rows:
        def _generate_indices(self):
            return torch.tensor([[0, 1, 2, 3], [1, 0, 2, 3]])

    class Model(torch.nn.Module):
        pass

    model = Model()
    model.cp_load_balancer = lambda seqlen, cp: Rows()
    with pytest.raises(ValueError, match="differently"):
        sequence_order(model, 4, 2)


def test_attention_in_a_chunk_order_is_torchs_on_the_permuted_sequence() -> None:
    """Forward and flash backward of the rule table's attention (and the
    harness's own) with ``order`` equal torch's causal attention on the
    sequence laid out in that order, in float64."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 2, 8, 4, generator=gen, dtype=torch.float64,
                              requires_grad=True) for _ in range(4))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    lse = torch.logsumexp((q @ k.transpose(-1, -2) * 0.5).masked_fill(
        torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
    perm = lambda t: t.detach()[:, :, HEAD_TAIL].numpy()  # noqa: E731
    kw = {"scale": 0.5, "causal": True, "order": [0, 3, 1, 2]}
    mine_out, mine_lse = get_op("attention").forward(np, [perm(q), perm(k), perm(v)], **kw)
    assert np.allclose(mine_out, perm(out), atol=1e-12)
    assert np.allclose(mine_lse, lse.detach()[:, :, HEAD_TAIL].numpy(), atol=1e-12)
    grads = get_op("attention_grad").forward(
        np, [perm(g), perm(q), perm(k), perm(v), mine_out, mine_lse], **kw)
    for mine, want in zip(grads, (dq, dk, dv)):
        assert np.allclose(mine, perm(want), atol=1e-12)
    t = [torch.from_numpy(perm(x)) for x in (q, k, v)]
    h_out, h_lse = _attention(*t, **kw)
    assert torch.allclose(h_out, torch.from_numpy(perm(out)), atol=1e-12)
    h_grads = _attention_grad(torch.from_numpy(perm(g)), *t, h_out, h_lse, **kw)
    assert all(torch.allclose(a, torch.from_numpy(perm(b)), atol=1e-12)
               for a, b in zip(h_grads, (dq, dk, dv)))


def test_a_chunk_order_needs_the_whole_sequence() -> None:
    from verdict.ops import ShapeError
    with pytest.raises(ShapeError):
        get_op("attention").shape([(1, 1, 6, 4)] * 3, scale=0.5, causal=True, order=[0, 3, 1, 2])


def _run(recipe: str, capsys, args: list[str] = ARGS) -> tuple[int, str]:
    code = verdict_cli.torch([*args, "--recipe", f"tests.cp_split_recipes:{recipe}"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("recipe", ["ring_balanced", "ring_balanced_alltoall"])
def test_the_load_balanced_ring_verifies(recipe, capsys) -> None:
    code, out = _run(recipe, capsys)
    assert code == 0, out
    assert "SUCCESS" in out


def test_a_chunk_order_undone_wrongly_on_one_rank_fails_naming_it(capsys) -> None:
    code, out = _run("ring_balanced_wrong_order", capsys)
    assert code == 1, out
    assert "rank 1" in out and "cat" in out


def test_a_table_of_positions_under_a_balancer_is_refused(capsys) -> None:
    code, out = _run("cp_table_balanced", capsys, [
        "--model", "tests.cp_split_models:table_position_tagger", "--mesh", "cp=2", "--layers",
        "1", "--hidden", "8", "--seqlen", "8", "--vocab", "10", "--batch", "2"])
    assert code == 2, out
    assert "load balancer's order" in out


ANSWER = ["--heads", "2", "--mesh", "cp=4", "--layers", "1", "--hidden", "8", "--seqlen", "8",
          "--vocab", "10", "--batch", "2", "--recipe", "tests.cp_split_recipes:ring_answer"]


def test_a_rank_with_no_target_verifies_with_the_count_over_cp(capsys) -> None:
    """Megatron-LM PR 7498's mechanism on the main loss: the prompt's labels
    ignored, so that cp rank 0 of 4 holds none; the kept count all-reduced
    over cp gives every rank the step's loss."""
    code = verdict_cli.torch(["--model", "tests.cp_models:answer_tagger", *ANSWER])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err


def test_each_ranks_own_mean_fails(capsys) -> None:
    """Each rank's loss the mean over its own kept labels (rank 0's over a
    count clamped to 1): the ranks' gradients are scaled apart, a FAIL."""
    code = verdict_cli.torch(["--model", "tests.cp_models:answer_tagger_rank_mean", *ANSWER])
    out = capsys.readouterr()
    assert code == 1, out.out + out.err


def test_a_gather_along_the_sequence_at_computed_positions_lowers_exactly() -> None:
    """``table.gather(1, positions)`` at integers computed from the ids (the
    rotary table's gather at a rank's positions under tensor parallelism):
    the lowered loss and gradients equal torch's in float64."""
    from tests.test_torch_layers import _lower_and_check, _single
    _lower_and_check(_single("tests.cp_models:gather_tagger"))
