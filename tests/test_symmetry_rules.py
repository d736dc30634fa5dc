"""The uniformity rules of verdict/symmetry/rules.py as the two checks call
them: node by node (verdict/symmetry/uniform.py) and on arrays
(verdict/symmetry/blocks.py, glue.py)."""

from __future__ import annotations

import numpy as np

from verdict.symmetry.rules import (
    ends_with_chains,
    index_kwarg,
    last_writes,
    own_index,
    reads_outside,
    sum_of_ends,
)


def test_an_index_kwarg_is_read_as_each_check_always_read_it():
    assert index_kwarg({"index": 2}) == 2 == index_kwarg({"index": 2}, bool_is_int=True)
    assert index_kwarg({"index": True}) == -1  # on arrays: no index
    assert index_kwarg({"index": True}, bool_is_int=True) == 1  # node by node: the int 1
    assert index_kwarg({"index": "1"}) == -1 == index_kwarg({})


def test_own_index_names_the_collective_s_own_rank():
    ranks = np.array([10, 11, 12])

    def rank_at(valid: np.ndarray, k: np.ndarray) -> np.ndarray:
        return np.where(valid, ranks[np.where(valid, k, 0)], -1)

    index = np.array([1, 2, 3, -1])
    got = own_index(index, np.full(4, 3), rank_at, np.full(4, 11))
    assert got.tolist() == [True, False, False, False]


def test_only_sums_of_chain_ends_outside_microbatches_cross_replicas():
    is_sum = np.array([True, True, True, False])
    mb = np.array([-1, 0, -1, -1])
    of_ends = np.array([True, True, False, True])
    assert sum_of_ends(is_sum, mb, of_ends).tolist() == [True, False, False, False]


def test_a_block_reads_only_constants_computed_outside_microbatches():
    node_mb = np.array([0, 0, 0, -1, 1])
    t_mb = np.array([-1, -1, -1, -1, 1])
    computed = np.array([True, True, False, True, True])
    constant = np.array([False, True, False, False, False])
    got = reads_outside(node_mb, t_mb, computed, constant)
    assert got.tolist() == [True, False, False, False, False]
    assert not reads_outside(0, -1, True, True) and reads_outside(0, -1, True, False)


def test_the_last_write_of_each_buffer_in_the_order_of_the_buffers():
    key = np.array([1, 0, 1, 0, 1])
    writer = np.array([5, 7, 9, 2, 9])  # node 9 writes buffer 1 twice: the later is taken
    assert last_writes(key, writer).tolist() == [1, 4]
    assert last_writes(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)).tolist() == []
    assert ends_with_chains(np.array([True, False, False]),
                            np.array([False, True, False])).tolist() == [True, True, False]
