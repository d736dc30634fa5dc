"""The rules Megatron-Core's expert-parallel step rests on
(docs/soundness.md, "Plans traced from PyTorch", 48), each on
small arrays: blocks of one grouped result put side by side, and the
replayed routing of a sequence-first model's rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backends.torch.errors import LoweringError
from backends.torch.lowering.expert_rows import cat, split
from backends.torch.lowering.grouped_rows import Experts
from backends.torch.tracer.routing import Routing, RoutingError


def _lowerer(env: dict) -> SimpleNamespace:
    return SimpleNamespace(env=env, name="experts", shapes={}, trace={"shapes": []})


def _never(*args, **kwargs):
    raise AssertionError("handed on to the base rule")


def test_blocks_of_one_grouped_result_put_side_by_side_are_its_rows_at_their_pairs() -> None:
    whole = Experts(7, np.array([0, 0, 1, 1, 1]), np.array([3, 0, 4, 1, 2]))
    lw = _lowerer({1: whole})
    blocks = split(_never)(lw, [("v", 1), [2, 3], 0], {}, [(2, 8), (3, 8)], None)
    lw.env.update({2: blocks[0], 3: blocks[1]})
    # the unsort: the second block first
    joined = cat(_never)(lw, [[("v", 3), ("v", 2)], 0], {}, [(5, 8)], None)
    assert isinstance(joined, Experts) and joined.y == 7
    assert joined.group.tolist() == [1, 1, 1, 0, 0]
    assert joined.index.tolist() == [4, 1, 2, 3, 0]


def test_a_grouped_row_taken_twice_is_refused() -> None:
    block = Experts(7, np.array([0, 1]), np.array([3, 4]))
    lw = _lowerer({2: block})
    with pytest.raises(LoweringError, match="repeat a row"):
        cat(_never)(lw, [[("v", 2), ("v", 2)], 0], {}, [(4, 8)], None)


def test_blocks_of_two_grouped_results_are_handed_on() -> None:
    lw = _lowerer({2: Experts(7, np.array([0]), np.array([1])),
                   3: Experts(8, np.array([0]), np.array([2]))})
    handed = []
    cat(lambda *a: handed.append(a) or "base")(lw, [[("v", 2), ("v", 3)], 0], {}, [(2, 8)], None)
    assert handed


def test_a_sequence_first_replay_reads_the_ranks_positions_at_its_batch_rows() -> None:
    # 4 positions x 2 batch rows, position outer; row (s, b) routes to expert 10 s + b
    full = np.array([[10 * s + b] for s in range(4) for b in range(2)])
    tp_block = Routing(None, (0, 1), (1, 2), sequence_first=True)
    tp_block.batch = 2
    assert tp_block.rows(full, (4, 1)).ravel().tolist() == [20, 21, 30, 31]
    dp_block = Routing(None, (1, 2), (0, 1), sequence_first=True)
    dp_block.batch = 2
    assert dp_block.rows(full, (4, 1)).ravel().tolist() == [1, 11, 21, 31]
    both = Routing(None, (0, 2), (1, 2), sequence_first=True)
    both.batch = 2
    assert both.rows(full, (2, 1)).ravel().tolist() == [20, 30]


def test_a_sequence_first_replay_of_an_unknown_batch_is_refused() -> None:
    routing = Routing(None, (0, 2), (0, 1), sequence_first=True)
    full = np.zeros((8, 1), dtype=np.int64)
    with pytest.raises(RoutingError):
        routing.rows(full, (4, 1))
