"""The ranks' order of the flattened token rows (docs/soundness.md, "Plans
traced from PyTorch", 89): torchtitan's data x sequence parallel rows and
Megatron's sequence-first data-parallel rows are blocks in that order, the
explicit chain of shape ops lays the rows out in it (and is the identity on
a rank), recorded routing constants relabelled for it pick the same rows,
and a step of row-wise ops, a gather and a scatter at recorded rows written
in that order computes the same result. Ranks whose rows are no block of
it are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch.errors import LoweringError
from backends.torch.tracer.token_order import (
    RowGrid,
    check_blocks,
    held_rows,
    inverse,
    numbers_in_order,
    rows_in_order,
)

#: torchtitan at dp 2 tp 2 with sequence parallelism: rows (batch, position),
#: rank (d, t) holds batch block d and position block t
TITAN = RowGrid(sizes=(4, 8), parts=(2, 2))
#: Megatron at dp 2: rows (position, batch), rank d holds batch block d
MEGATRON = RowGrid(sizes=(8, 4), parts=(1, 2), inner_first=True)


def _titan_ranks() -> dict[int, np.ndarray]:
    return {2 * d + t: held_rows(TITAN, np.arange(2 * d, 2 * d + 2), np.arange(4 * t, 4 * t + 4))
            for d in range(2) for t in range(2)}


def test_titan_ranks_are_blocks_in_the_order_and_not_before() -> None:
    ranks = _titan_ranks()
    assert check_blocks(TITAN, ranks) == {0: 0, 1: 1, 2: 2, 3: 3}
    rows = ranks[1]
    assert not np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows)))  # strided before


def test_megatron_data_parallel_rows_are_blocks_in_the_order() -> None:
    ranks = {d: held_rows(MEGATRON, np.arange(8), np.arange(2 * d, 2 * d + 2)) for d in range(2)}
    assert check_blocks(MEGATRON, ranks) == {0: 0, 1: 1}
    assert MEGATRON.order()[:4].tolist() == [0, 1, 4, 5]


def test_replicas_hold_the_same_block() -> None:
    ranks = {r: held_rows(MEGATRON, np.arange(8), np.arange(2 * (r // 2), 2 * (r // 2) + 2))
             for r in range(4)}
    assert check_blocks(MEGATRON, ranks) == {0: 0, 1: 0, 2: 1, 3: 1}


@pytest.mark.parametrize("grid", [TITAN, MEGATRON])
def test_the_chain_is_the_order_and_the_identity_on_a_rank(grid: RowGrid) -> None:
    x = torch.randn(*grid.sizes, 3, dtype=torch.float64)
    split, axes = grid.chain()
    chained = x.reshape(*split, 3).permute(*axes, 4).reshape(-1, 3)
    assert torch.equal(chained, x.flatten(0, 1)[torch.as_tensor(grid.order())])
    local = RowGrid(sizes=(grid.sizes[0] // grid.parts[0], grid.sizes[1] // grid.parts[1]),
                    parts=(1, 1), inner_first=grid.inner_first)
    y = torch.randn(*local.sizes, 3, dtype=torch.float64)
    split, axes = local.chain()
    assert torch.equal(y.reshape(*split, 3).permute(*axes, 4).reshape(-1, 3), y.flatten(0, 1))


def test_the_rank_block_of_the_relabelled_routing_is_its_replay() -> None:
    rng = np.random.default_rng(0)
    topk = rng.integers(0, 4, size=(TITAN.rows, 2))
    ordered = rows_in_order(topk, TITAN.order())
    for rank, rows in _titan_ranks().items():
        per = len(rows)
        assert np.array_equal(ordered[rank * per:(rank + 1) * per], topk[rows])


def test_numbers_relabelled_pick_the_same_rows_and_pairs() -> None:
    pi = TITAN.order()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((TITAN.rows, 3))
    idx = rng.integers(0, TITAN.rows, size=11)
    assert np.array_equal(x[pi][numbers_in_order(idx, pi)], x[idx])
    pairs = rng.standard_normal((TITAN.rows * 2, 3))
    p = rng.permutation(TITAN.rows * 2)
    assert np.array_equal(rows_in_order(pairs, pi, slots=2)[numbers_in_order(p, pi, slots=2)],
                          pairs[p])
    assert np.array_equal(inverse(pi)[pi], np.arange(TITAN.rows))


def _step(x: np.ndarray, w: np.ndarray, topk: np.ndarray, order: np.ndarray) -> np.ndarray:
    """A routed step on token rows: the experts' rows gathered at the
    recorded ``order`` of the (token, slot) pairs, an expert per pair, added
    back at their token, the router's gates applied row-wise."""
    gates = np.tanh(x @ w)
    picked = x[order // 2] * (1.0 + topk.reshape(-1)[order])[:, None]
    out = np.zeros_like(x)
    np.add.at(out, order // 2, picked)
    return out * gates[:, :1]


def test_a_routed_step_in_the_order_computes_the_same_rows() -> None:
    pi = TITAN.order()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((TITAN.rows, 3))
    w = rng.standard_normal((3, 4))
    topk = rng.integers(0, 4, size=(TITAN.rows, 2))
    order = np.argsort(topk.reshape(-1), kind="stable")
    single = _step(x, w, topk, order)
    reordered = _step(x[pi], w, rows_in_order(topk, pi),
                      numbers_in_order(order, pi, slots=2))
    assert np.allclose(reordered, single[pi], rtol=0, atol=1e-12)


def test_rows_that_are_no_block_are_refused() -> None:
    ranks = _titan_ranks()
    ranks[1] = ranks[1][::-1]  # its rows in another order
    with pytest.raises(LoweringError, match="rank 1's 8 token rows are no block"):
        check_blocks(TITAN, ranks)
    ranks = _titan_ranks()
    ranks[3] = ranks[0]  # two ranks on one block, one block on none
    with pytest.raises(LoweringError, match="no rank holds block 3"):
        check_blocks(TITAN, ranks)
    with pytest.raises(LoweringError, match="not cut into 3 equal blocks"):
        RowGrid(sizes=(4, 8), parts=(3, 1))


def test_a_constant_of_other_rows_is_refused() -> None:
    with pytest.raises(LoweringError, match="is not the 32 token rows"):
        rows_in_order(np.zeros((16, 2)), TITAN.order())
    with pytest.raises(LoweringError, match="outside the 32 token rows"):
        numbers_in_order(np.array([40]), TITAN.order())
