"""Rank-only guards (docs/soundness.md, "Plans traced from PyTorch", 113
(f)): a norm's truth value, taken true, is settled as an assumption (the
values it squares not all zero); any other branch the single-device step
never takes is refused, named."""

from __future__ import annotations

import pytest

from backends.torch.lowering import LNode, Lowered, LoweringError
from backends.torch.tracer.guards import same_branches
from backends.torch.tracer.rank_guards import settle_rank_only, squared_values

WHERE = "get_grad_norm (optimizer.py:1283)"


def _low(nodes: list[LNode], guards: list[tuple]) -> Lowered:
    return Lowered(0, {}, {}, nodes, {}, {}, [], {}, guards=list(guards))


def _norm_nodes() -> list[LNode]:
    """sqrt(all_reduce(sum(g * g) ** 2 ... )): Megatron's 2-norm, read back."""
    return [LNode("mul", "fw", [1, 1], [2], {}, "n"),
            LNode("sum", "fw", [2], [3], {"dim": None}, "n"),
            LNode("pow", "fw", [3], [4], {"exponent": 0.5}, "n"),
            LNode("pow", "fw", [4], [5], {"exponent": 2.0}, "n"),
            LNode("all_reduce", "fw", [5], [6], {}, "n", (0, 1)),
            LNode("pow", "fw", [6], [7], {"exponent": 0.5}, "n")]


def test_a_norm_squares_its_gradient() -> None:
    assert squared_values(_low(_norm_nodes(), []), 7) == [4]
    assert squared_values(_low(_norm_nodes(), []), 3) == [1]


def test_a_sum_of_unsquared_values_is_no_norm() -> None:
    nodes = [LNode("sum", "fw", [1], [2], {"dim": None}, "n"),
             LNode("pow", "fw", [2], [3], {"exponent": 0.5}, "n")]
    assert squared_values(_low(nodes, []), 3) is None
    diff = [LNode("mul", "fw", [1, 1], [2], {}, "n"), LNode("sub", "fw", [2, 1], [3], {}, "n")]
    assert squared_values(_low(diff, []), 3) is None


def test_a_norm_tested_true_is_an_assumption() -> None:
    single = _low([], [])
    rank = _low(_norm_nodes(), [(7, "ne", 0.0, True, WHERE)])
    assumed = settle_rank_only(single, [rank])
    assert rank.guards == [] and len(assumed) == 1 and WHERE in assumed[0]


def test_guards_the_single_device_step_takes_are_kept() -> None:
    guard = (7, "lt", 1.0, True, "clip (clip_grads.py:173)")
    single = _low([], [(3, "lt", 1.0, True, "clip (clip_grads.py:173)")])
    rank = _low(_norm_nodes(), [guard])
    assert settle_rank_only(single, [rank]) == [] and rank.guards == [guard]


@pytest.mark.parametrize("guard", [(7, "lt", 1.0, True, WHERE), (7, "ne", 0.0, False, WHERE),
                                   (3, "ne", 0.0, True, WHERE)])
def test_any_other_rank_only_guard_is_refused(guard: tuple) -> None:
    nodes = _norm_nodes()
    if guard[0] == 3:  # a number that is no norm: a plain sum
        nodes = [LNode("sum", "fw", [1], [3], {"dim": None}, "n")]
    single, rank = _low([], []), _low(nodes, [guard])
    assert settle_rank_only(single, [rank]) == [] and rank.guards == [guard]
    with pytest.raises(LoweringError, match="not the single-device step's"):
        same_branches(single, [rank])
