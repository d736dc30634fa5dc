"""cp: attention sinks (gpt-oss's per-head sink logits) under context
parallelism (docs/soundness.md, "Plans traced from PyTorch", 92, and
"Exponentials and logarithms", L6). The flash form of the sink tagger
(the kernel's (out, lse), the sink merged once as one more block, the
kernel's backward at the merged out and lse) is the eager sink attention,
forward and every gradient, in float64; keys and values all-gathered
with the eager form, and PyTorch's ring with the flash form, verify; a
ring that enters the sink at every step fails at the attention. Real gloo
runs agree (scripts/gloo_truth.py, the suite's ``sinks`` cases)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import verdict_cli
from tests.cp_sink_models import SinkFlashAttention, fold_sink

SIZES = ["--heads", "2", "--layers", "1", "--hidden", "8", "--seqlen", "4", "--vocab", "10",
         "--batch", "2"]


def _eager(q, k, v, sinks):
    """The sink attention written out as transformers' gpt_oss writes it,
    its causal mask -inf."""
    b, h, s, d = q.shape
    scores = q @ k.transpose(2, 3) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    logits = torch.cat([scores, sinks.reshape(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)
    return probs[..., :-1] @ v


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
            for shape in ((2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4), (3,))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sink_is_one_more_block(seed) -> None:
    """L6: the flash kernel's result merged with the sink (a block of one
    key, value 0), and its backward at the merged out and lse, are the
    eager sink attention and its gradients (q, k, v and the sink)."""
    a = _inputs(seed)
    b = [t.detach().clone().requires_grad_() for t in a]
    out_a = SinkFlashAttention.apply(*a, None, True)
    out_b = _eager(*b)
    torch.testing.assert_close(out_a, out_b, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out_a)
    ga = torch.autograd.grad(out_a, a, dout)
    gb = torch.autograd.grad(out_b, b, dout)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_a_sink_entered_twice_is_another_function() -> None:
    q, k, v, sinks = (t.detach() for t in _inputs(3))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
    once = fold_sink(out, lse, sinks)[0]
    twice = fold_sink(*fold_sink(out, lse, sinks), sinks)[0]
    assert not torch.allclose(once, twice)


def _run(model: str, recipe: str, mesh: str, capsys, *extra: str) -> tuple[int, str]:
    code = verdict_cli.torch(["--model", f"tests.cp_sink_models:{model}", *SIZES, "--mesh",
                              mesh, "--recipe", f"tests.cp_sink_recipes:{recipe}", *extra])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("mesh", ["cp=2", "dp=2,cp=2"])
def test_eager_sinks_with_keys_and_values_all_gathered_verify(mesh, capsys) -> None:
    code, out = _run("sink_tagger", "sink_allgather", mesh, capsys)
    assert code == 0, out


@pytest.mark.parametrize("recipe", ["sink_ring", "sink_ring_alltoall"])
def test_pytorchs_ring_with_the_sink_merged_once_verifies(recipe, capsys) -> None:
    code, out = _run("sink_flash_tagger", recipe, "cp=2", capsys)
    assert code == 0, out


def test_the_sink_ring_with_the_head_tail_balancer_verifies(capsys) -> None:
    code, out = _run("sink_flash_tagger", "sink_ring_balanced", "cp=2", capsys, "--seqlen", "8")
    assert code == 0, out


def test_the_sink_at_every_ring_step_fails_at_the_attention(capsys) -> None:
    """The ring's merged result, named as the attention, reads the sink:
    the attention's stage cannot reach it from the attention's inputs."""
    code, out = _run("sink_flash_tagger", "sink_ring_every_step", "cp=2", capsys)
    assert code == 1, out
    assert "op='attention'" in out and "rank=1" in out


def test_sinks_dropped_under_the_ring_fail_at_the_first_reader(capsys) -> None:
    """prime-rl PR 3397: the ring's result read as if the sink were merged."""
    code, out = _run("sink_flash_tagger", "sink_ring_dropped", "cp=2", capsys)
    assert code == 1, out
    assert "operator transpose" in out


def test_eager_sinks_dropped_fail_at_the_softmax(capsys) -> None:
    """prime-rl PR 3397 with keys and values all-gathered: the rank's
    softmax is claimed to be the single-device one it skips the sink
    column before (soundness.md, 101), which runs over one more entry."""
    code, out = _run("sink_tagger", "sink_allgather_dropped", "cp=2", capsys)
    assert code == 1, out
    assert "op='softmax'" in out and "(size 5)" in out and "(size 4)" in out


def test_balanced_ring_sinks_dropped_fail_at_the_first_reader(capsys) -> None:
    """The balanced ring's backward blocks read halves of its named result:
    matched past it (soundness.md, 101); the forward's first reader fails."""
    code, out = _run("sink_flash_tagger", "sink_ring_balanced_dropped", "cp=2", capsys,
                     "--seqlen", "8")
    assert code == 1, out
    assert "operator transpose" in out and "counterexample" in out


def test_the_sink_entered_once_per_gathered_chunk_fails_at_the_cat(capsys) -> None:
    """The rank's cat of its scores' chunks of the gathered keys, each with
    the sink, joins the scores and the sink twice: more entries than the
    single-device cat makes (soundness.md, 130). The sink's expand, which
    no consumer ties to a claimed value, is cut by "cp" (a guess)."""
    code, out = _run("sink_tagger", "sink_allgather_per_chunk", "cp=2", capsys)
    assert code == 1, out
    assert "cat at SinkTagger joins 4 pieces" in out and "6 entries along dim 3" in out
    assert "makes 5" in out
