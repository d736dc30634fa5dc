"""Pair rows added back at other tokens than the rows they hold
(docs/soundness.md, "Plans traced from PyTorch", 124): the accumulating
``index_put`` into zeros of rows ``values[group[r]][index[r]]`` at tokens
``tokens[r]`` is written as each value's rows moved by a permutation of
their own (a lookup by a one-hot constant of the rank's own), masked to the
tokens that receive one: index_put's definition. Rows in place take the
rule before (no lookup); a token receiving two rows of one value is
refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

import backends.torch.lowering  # noqa: F401 (registers the handlers)
from backends.torch.errors import LoweringError
from backends.torch.lowering.context import Lowerer
from backends.torch.lowering.pair_rows import Assembled, gathered_back
from verdict.ops import get_op


def _lowerer() -> Lowerer:
    return Lowerer({"events": [], "shapes": {}, "consts": {}, "constants": set(), "rank": 0},
                   vocab=10)


def _run(lw: Lowerer, values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    env = {**lw.const_values, **values}
    for node in lw.nodes:
        outs = get_op(node.op).forward(np, [env[v] for v in node.ins], **node.kwargs)
        env.update(zip(node.outs, outs))
    return env


def _index_put(values: list[np.ndarray], group: np.ndarray, index: np.ndarray,
               tokens: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """torch's meaning: zeros, each live row added at its token."""
    out = np.zeros(shape)
    for g, i, t in zip(group, index, tokens):
        if g >= 0:
            out[t] += values[g][i]
    return out


@pytest.mark.parametrize("rest", [(), (3,)])
def test_rows_added_at_other_tokens_are_the_values_moved(rest: tuple[int, ...]) -> None:
    # JetMoE's gates picked at a permuted index: the first two sorted pairs swapped
    t = 6
    lw = _lowerer()
    v0, v1 = lw.new((t, *rest)), lw.new((t, *rest))
    group = np.array([0, 0, 0, 1, 1, -1])
    index = np.array([4, 1, 2, 0, 5, 0])
    tokens = np.array([1, 4, 3, 0, 2, 5])
    out = gathered_back(lw, Assembled((v0, v1), group, index), tokens, (t, *rest))
    rng = np.random.default_rng(0)
    given = {v0: rng.standard_normal((t, *rest)), v1: rng.standard_normal((t, *rest))}
    got = _run(lw, given)[out]
    assert np.allclose(got, _index_put([given[v0], given[v1]], group, index, tokens, (t, *rest)))
    assert sum(n.op == "embedding" for n in lw.nodes) == 2  # one lookup per value
    assert lw.rows_moved


def test_rows_in_place_take_the_rule_before() -> None:
    lw = _lowerer()
    v = lw.new((4,))
    gathered_back(lw, Assembled((v,), np.array([0, 0, 0, 0]), np.array([2, 0, 1, 3])),
                  np.array([2, 0, 1, 3]), (4,))
    assert not any(n.op == "embedding" for n in lw.nodes) and not lw.rows_moved


def test_a_token_receiving_two_rows_of_one_value_is_refused() -> None:
    lw = _lowerer()
    v = lw.new((4,))
    with pytest.raises(LoweringError, match="rows added back at other tokens than they hold"):
        gathered_back(lw, Assembled((v,), np.array([0, 0, 0]), np.array([1, 2, 3])),
                      np.array([0, 0, 2]), (4,))
