"""Constants' matches chosen again several at once, over a tree of forward
nodes (``tracer/align/rechoice.py`` ``tree``, ``replayed``;
docs/soundness.md, "Plans traced from PyTorch", 106)."""

from __future__ import annotations

import numpy as np

from backends.torch.tracer.align.claim import Claim
from tests.test_align_rechoice import _node, _Rank


def _rank(own: bool = False) -> tuple[_Rank, object]:
    """The single-device step multiplies expert e's mask (10 + e, expanded
    into 20 + e) with its gate (12 + e, into 22 + e), then with expert e's
    rows (30 + e). A rank matched its mask and gate of expert 1 (constants
    1 and 2) with expert 0's; their product (6) read with expert 1's rows
    (7) matches nothing until both are matched again."""
    single = [_node("expand", [10], [20], shape=[4, 1]), _node("expand", [11], [21], shape=[4, 1]),
              _node("expand", [12], [22], shape=[4, 1]), _node("expand", [13], [23], shape=[4, 1]),
              _node("mul", [20, 22], [40]), _node("mul", [21, 23], [41]),
              _node("mul", [30, 40], [50]), _node("mul", [31, 41], [51])]
    consts = {c: np.full((4, 1), float(c)) for c in (10, 11, 12, 13)}
    mask, gate = _node("expand", [1], [3], shape=[2, 1]), _node("expand", [2], [4], shape=[2, 1])
    both = _node("mul", [3, 4], [6])
    mul = _node("mul", [7, 6], [8])
    r = _Rank([mask, gate, both, mul], {1: np.ones((2, 1)), 2: np.ones((2, 1))}, single, consts)
    r.sv.update({1: 10, 2: 12, 3: 20, 4: 22, 6: 40, 7: 31})
    for c, options in ((1, (10, 11)), (2, (12, 13))):
        r.claim[c] = Claim([["dp"], []])
        if own:
            r.own_tid[c] = 100 + c
        else:
            r.matches[c] = [(sv, Claim([["dp"], []])) for sv in options]
    return r, mul


def test_two_constants_are_matched_again_together() -> None:
    r, mul = _rank()
    assert r.rechosen(mul) == [7]
    assert (r.sv[1], r.sv[2], r.sv[3], r.sv[4], r.sv[6]) == (11, 13, 21, 23, 41)
    assert sorted(r.retagged) == [1, 2, 3, 4, 6]


def test_inputs_of_their_own_are_matched_again_together() -> None:
    r, mul = _rank(own=True)
    assert r.rechosen(mul) == [7]
    assert (r.sv[1], r.sv[2], r.sv[6]) == (11, 13, 41)
    assert sorted(r.retagged) == [3, 4, 6]  # the constants keep their own inputs' tensors


def test_no_choice_that_makes_the_reader_match_changes_nothing() -> None:
    r, mul = _rank()
    r.sv[7] = 32  # rows no single-device mul reads
    assert r.rechosen(mul) == []
    assert (r.sv[1], r.sv[2], r.sv[6]) == (10, 12, 40) and not r.retagged


def test_a_tree_value_another_matched_node_reads_is_left_alone() -> None:
    r, mul = _rank()
    r.consumers[6].append(_node("neg", [6], [9]))
    r.sv[9] = 98
    assert r.rechosen(mul) == []


def test_an_input_of_its_own_read_elsewhere_is_not_copied() -> None:
    r, mul = _rank(own=True)
    r.consumers[2].append(_node("neg", [2], [9]))
    r.sv[9] = 98
    assert r.rechosen(mul) == []  # its gate would have to change: declined
