"""Rows moved by a permutation of their own (docs/soundness.md, "Plans
traced from PyTorch", 103): a combine that adds rows back at other copies
than they were gathered at is lowered exactly, as a lookup of the dense
rows by a one-hot constant of the rank's own; rows of one base read at two
indices are re-read at one, the same values; nothing changes on a rank
whose rows stayed in order."""

from __future__ import annotations

import numpy as np

import backends.torch.lowering  # noqa: F401 (registers the handlers)
from backends.torch.lowering.context import Lowerer
from backends.torch.lowering.grouped_rows import Experts, _summed_copies
from backends.torch.lowering.moved_rows import moved_rows, nearest_window, reread
from backends.torch.lowering.routed_rows import Rows, RowsT, mm
from verdict.ops import get_op


def _lowerer() -> Lowerer:
    return Lowerer({"events": [], "shapes": {}, "consts": {}, "constants": set(), "rank": 0},
                   vocab=10)


def _run(lw: Lowerer, values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """The lowered nodes evaluated in float64 by the rule table."""
    env = {**lw.const_values, **values}
    for node in lw.nodes:
        outs = get_op(node.op).forward(np, [env[v] for v in node.ins], **node.kwargs)
        env.update(zip(node.outs, outs))
    return env


def _never(*args, **kwargs):
    raise AssertionError("handed on to the base rule")


def test_the_permutation_puts_each_source_at_its_target_and_keeps_the_rest() -> None:
    order = moved_rows(np.array([4, 1]), np.array([0, 5]), 6)
    assert sorted(order.tolist()) == list(range(6))
    assert order[0] == 4 and order[5] == 1
    assert order[2] == 2 and order[3] == 3  # rows neither read nor written stay


def test_rows_reread_at_another_index_are_the_same_rows() -> None:
    lw = _lowerer()
    base = lw.new((6, 3))
    moved = reread(lw, base, np.array([4, 1, 2]), np.array([0, 5, 3]))
    values = np.arange(18.0).reshape(6, 3)
    got = _run(lw, {base: values})[moved]
    assert np.array_equal(got[[0, 5, 3]], values[[4, 1, 2]])
    lookups = [n for n in lw.nodes if n.op == "embedding"]
    assert len(lookups) == 1 and tuple(lw.shapes[moved]) == (6, 3)


def test_a_1d_base_is_reread_without_a_reshape() -> None:
    lw = _lowerer()
    base = lw.new((5,))
    moved = reread(lw, base, np.array([3, 0]), np.array([1, 4]))
    values = np.arange(10.0, 15.0)
    got = _run(lw, {base: values})[moved]
    assert got[1] == values[3] and got[4] == values[0]
    assert [n.op for n in lw.nodes] == ["embedding"]


def test_rows_of_every_rank_cut_to_the_window_they_are_most_read_from() -> None:
    # 8 dense rows, this rank's copies a window of 4: rows 5 and 6 read at copies 1 and 2
    assert nearest_window(np.array([5, 6]), np.array([1, 2]), 8, 4) == 4
    lw = _lowerer()
    base = lw.new((8, 2))
    moved = reread(lw, base, np.array([5, 6]), np.array([2, 1]), 4)
    values = np.arange(16.0).reshape(8, 2)
    got = _run(lw, {base: values})[moved]
    assert got.shape == (4, 2)
    assert np.array_equal(got[[2, 1]], values[[5, 6]])


def test_indices_that_cannot_be_related_are_left_alone() -> None:
    lw = _lowerer()
    base = lw.new((4, 2))
    assert reread(lw, base, np.array([1, 1]), np.array([0, 2])) is None  # a repeat
    assert reread(lw, base, np.array([1]), np.array([0, 2])) is None  # other lengths
    assert not lw.nodes


def test_rows_added_back_at_other_copies_are_summed_where_the_combine_puts_them() -> None:
    lw = _lowerer()
    base = lw.new((6, 2))  # 3 tokens, 2 copies each
    p = np.array([0, 1, 2, 4])  # the combine's copies
    index = np.array([2, 0, 5, 1])  # where the rows were gathered
    out = _summed_copies(lw, Rows(base, index), p, 2, (3, 2))
    values = np.arange(12.0).reshape(6, 2)
    got = _run(lw, {base: values})[out]
    want = np.zeros((3, 2))
    for i, copy in enumerate(p):
        want[copy // 2] += values[index[i]]
    assert np.array_equal(got, want)
    assert lw.rows_moved


def test_grouped_rows_of_every_rank_added_back_elsewhere() -> None:
    lw = _lowerer()
    y = lw.new((2, 4, 1))  # 2 experts' results for the 4 rows of both ranks
    src = Experts(y, np.array([0, 1]), np.array([3, 0]))
    out = _summed_copies(lw, src, np.array([0, 1]), 1, (2, 1))
    values = np.arange(8.0).reshape(2, 4, 1)
    got = _run(lw, {y: values})[out]
    assert got.ravel().tolist() == [values[0, 3, 0], values[1, 0, 0]]


def test_rows_in_order_take_the_usual_sum() -> None:
    lw = _lowerer()
    base = lw.new((4, 2))
    p = np.array([0, 2, 3])
    out = _summed_copies(lw, Rows(base, p), p, 2, (2, 2))
    assert not lw.rows_moved
    assert not any(n.op == "embedding" for n in lw.nodes)
    values = np.arange(8.0).reshape(4, 2)
    got = _run(lw, {base: values})[out]
    assert np.array_equal(got, np.stack([values[0], values[2] + values[3]]))


def test_a_weight_gradient_of_rows_at_two_indices_reads_them_at_one() -> None:
    lw = _lowerer()
    act, grad = lw.new((4, 3)), lw.new((4, 2))
    lw.env.update({1: RowsT(Rows(act, np.array([0, 2]))), 2: Rows(grad, np.array([3, 1]))})
    handed = []
    mm(lambda *a: handed.append(a) or "base")(lw, [("v", 1), ("v", 2)], {}, [(3, 2)], None)
    assert handed  # in order elsewhere: the rows are materialized as before
    lw.rows_moved = True
    out = mm(_never)(lw, [("v", 1), ("v", 2)], {}, [(3, 2)], None)
    a, g = np.arange(12.0).reshape(4, 3), np.arange(8.0).reshape(4, 2)
    got = _run(lw, {act: a, grad: g})[out]
    assert np.allclose(got, a[[0, 2]].T @ g[[3, 1]])
    assert lw.env[2].index.tolist() == [0, 2]  # bound for every later reader
