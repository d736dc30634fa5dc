"""Context parallelism beside data parallelism: a routing constant's dims
past the batch cut by dp x cp, the guess's order left as its callers rely
on, and the exponential normal form's budget counted in CPU time
(docs/soundness.md, "Plans traced from PyTorch", 132)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import z3

from backends.torch.lowering import LoweringError
from backends.torch.tracer.align.claim import Pieces
from backends.torch.tracer.align.inputs import CONST_CUTS
from verdict import expalgebra


def _pieces(**sizes: int) -> Pieces:
    """A Pieces holding only a mesh (every axis the orders name, of size 1
    unless given): what ``guess`` reads."""
    p = object.__new__(Pieces)
    p.sizes = {"dp": 1, "tp": 1, "cp": 1, "mb": 1, **sizes}
    p.dp, p.axes = ["dp"], tuple(p.sizes)
    p.low = SimpleNamespace(rank=0)
    return p


def test_a_constant_dim_past_the_batch_is_cut_by_dp_x_cp() -> None:
    """The (token, slot) pairs of a rank at dp 2 x cp 2 are a quarter of the
    step's, in the ranks' order of the token rows (dp outer, cp inner):
    the constant's dim 1 is claimed cut by ("dp", "cp"), as its dim 0."""
    p = _pieces(dp=2, cp=2)
    assert p.guess(64, 256, order=p.orders(CONST_CUTS[0])) == ["dp", "cp"]
    assert p.guess(64, 256, order=p.orders(CONST_CUTS[1])) == ["dp", "cp"]
    # a half is cp's first along the sequence, dp's first along the batch
    assert p.guess(4, 8, order=p.orders(CONST_CUTS[1])) == ["cp"]
    assert p.guess(2, 4, order=p.orders(CONST_CUTS[0])) == ["dp"]


def test_the_guess_tries_only_its_order() -> None:
    """A split's callers read the guess's refusal as "no mesh axis names
    this piece" and try the load balancer's reading next: the default
    order has no "cp", so on a cp-only mesh a split into 2 is refused
    (guessing "cp" there made the load-balanced sink ring a false FAIL)."""
    p = _pieces(cp=2)
    with pytest.raises(LoweringError, match="not a piece"):
        p.guess(1, 2)
    assert p.guess(1, 2, order=(("cp",),)) == ["cp"]


def test_the_normal_form_budget_counts_cpu_time_only() -> None:
    """Wall time spent elsewhere (a loaded machine, here a sleep) does not
    spend the budget: the identity is still proved by the normal form."""
    x, y = z3.Reals("x y")
    exp = z3.Function("exp", z3.RealSort(), z3.RealSort())
    algebra = expalgebra.Algebra(budget=0.5)
    time.sleep(0.8)
    assert algebra.equal(exp(x + y), exp(x) * exp(y))
    spent = expalgebra.Algebra(budget=-1.0)  # a budget already spent: no answer
    assert not spent.equal(exp(x + y), exp(x) * exp(y))
