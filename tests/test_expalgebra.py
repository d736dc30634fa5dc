"""The exact exp/log algebra (verdict/expalgebra.py): the lemmas it applies
checked against torch in float64, and one log-sum-exp merge of two key
blocks proved equal to attention over both, wrong merges not proved."""

from __future__ import annotations

import torch
import z3

from verdict import expalgebra as ea

E = z3.Function("exp", z3.RealSort(), z3.RealSort())
L = z3.Function("log", z3.RealSort(), z3.RealSort())


def _exp(x):
    return ea.exp_factored(x, E)


def _merge(o, lse, block_o, block_lse):
    """torch's _SDPAMerger step: sigmoid and logsigmoid written out."""
    sig = 1 / (1 + _exp(-(block_lse - lse)))
    return o - sig * (o - block_o), lse + L(1 + _exp(-(lse - block_lse)))


def test_lemmas_against_torch():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g,
                                                                      dtype=torch.float64)
    assert torch.allclose(torch.exp(a + b), torch.exp(a) * torch.exp(b), rtol=1e-13)
    p = torch.exp(a) + torch.exp(b)
    assert torch.allclose(torch.exp(torch.log(p)), p, rtol=1e-13)
    s = torch.randn(3, 6, generator=g, dtype=torch.float64)
    v = torch.randn(6, 2, generator=g, dtype=torch.float64)
    whole = torch.softmax(s, -1) @ v
    lse_a, lse_b = torch.logsumexp(s[:, :3], -1), torch.logsumexp(s[:, 3:], -1)
    out_a, out_b = torch.softmax(s[:, :3], -1) @ v[:3], torch.softmax(s[:, 3:], -1) @ v[3:]
    lse = torch.logaddexp(lse_a, lse_b)
    merged = torch.exp(lse_a - lse)[:, None] * out_a + torch.exp(lse_b - lse)[:, None] * out_b
    assert torch.allclose(merged, whole, rtol=1e-13)
    ring = out_a - torch.sigmoid(lse_b - lse_a)[:, None] * (out_a - out_b)
    assert torch.allclose(ring, whole, rtol=1e-13)
    assert torch.allclose(lse_a - torch.nn.functional.logsigmoid(lse_a - lse_b), lse, rtol=1e-13)


def test_one_merge_is_proved_and_wrong_ones_are_not():
    s, v = z3.Reals("s0 s1"), z3.Reals("v0 v1")
    e = [E(x) for x in s]
    total = e[0] + e[1]
    whole = (e[0] * v[0] + e[1] * v[1]) / total
    out, lse = _merge(v[0], L(e[0]), v[1], L(e[1]))
    assert ea.equal(out, whole)
    assert ea.equal(lse, L(total))
    assert not ea.equal(v[0] + v[1], whole)  # merged without the shift
    assert not ea.equal(_merge(v[0], L(e[0]), v[1], L(e[0]))[0], whole)  # another lse
    assert not ea.equal(v[0], whole)  # a dropped block


def test_exp_without_logs_is_unchanged():
    x = z3.Real("x")
    assert _exp(x - 1).eq(E(x - 1))
    assert not ea.positive(x) and ea.positive(E(x) + 1)
