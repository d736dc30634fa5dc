"""transformers' expert-parallel plan on families whose ranks send each
other different numbers of experts' results (docs/soundness.md, "Plans
traced from PyTorch", 114 b): ``zaya`` at dp 2 ep 2 (top-1 over its
experts, two of which no token routes to) verifies, and its wrong plans do
not."""

from __future__ import annotations

import pytest

from backends.torch.__main__ import parser, trace_and_build
from backends.torch.errors import LoweringError


def _verdict(*argv: str):
    pytest.importorskip("transformers")
    from main import verify

    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(list(argv)))
    return verify(plan_s, plan_p)


def test_zaya_ep2_verifies() -> None:
    verdict = _verdict("--hf", "zaya", "--dp", "2", "--tp", "1", "--ep", "2")
    assert verdict.success, verdict.message


def test_zaya_ep2_expert_grads_undivided_fails() -> None:
    """pytorch issue 160285's plan: the experts' gradients 2 x (gloo differs)."""
    verdict = _verdict("--hf", "zaya", "--recipe", "harness.moe_bugs:ep_expert_grads_undivided",
                       "--dp", "2", "--tp", "1", "--ep", "2")
    assert not verdict.success


def test_zaya_ep2_token_to_other_expert_is_no_success() -> None:
    """A token dispatched to another expert: refused at the experts' mul
    (no SUCCESS; a FAIL left to do)."""
    try:
        verdict = _verdict("--hf", "zaya", "--recipe", "harness.moe_bugs:ep_token_to_other_expert",
                           "--dp", "2", "--tp", "1", "--ep", "2")
    except LoweringError as e:
        assert "never combines that way" in str(e)
        return
    assert not verdict.success
