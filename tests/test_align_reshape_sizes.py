"""A rank's reshape keys alike with single-device reshapes whatever their
sizes (a rank's reshape runs on pieces), so only those whose outputs its
outputs can be pieces of are its matches; one keyed alike with none of
them, whose every reader reshapes back, is an identity of the rank's own
left out (docs/soundness.md, "Plans traced from PyTorch", 124 (e))."""

from __future__ import annotations

from types import SimpleNamespace

from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import key_kwargs
from backends.torch.tracer.align.nodes import NodeMatching


def _single(*nodes: LNode, shapes: dict[int, tuple[int, ...]]) -> SimpleNamespace:
    """A single-device step of these nodes, keyed as the builder keys them."""
    by_key: dict[tuple, list[int]] = {}
    for k, n in enumerate(nodes):
        by_key.setdefault((n.op, n.dir, tuple(n.ins), key_kwargs(n.kwargs)), []).append(k)
    low = SimpleNamespace(nodes=list(nodes), shapes=shapes)
    return SimpleNamespace(s=SimpleNamespace(low=low, by_key=by_key))


def _rank(b: SimpleNamespace, shapes: dict[int, tuple[int, ...]], sv: dict[int, int],
          readers: list[LNode] = (), own: dict[int, int] | None = None) -> NodeMatching:
    m = object.__new__(NodeMatching)
    m.b, m.sv = b, dict(sv)
    m.low = SimpleNamespace(shapes=shapes, anchors=set())
    m.stood, m.undone, m.own_tid = set(), set(), dict(own or {})
    m.consumers = {}
    for r in readers:
        for v in r.ins:
            m.consumers.setdefault(v, []).append(r)
    return m


# one device: the scores' gradient [16, 3] unflattened as a chain of token
# rows (item 98), [2, 2, 2, 2, 3]
CHAIN = LNode("unflatten", "fw", [1], [2], {"dim": 0, "sizes": [2, 2, 2, 2]}, "bw:moe")
MODULE = LNode("unflatten", "fw", [1], [3], {"dim": 0, "sizes": [4, 4]}, "bw:moe")
SINGLE_SHAPES = {1: (16, 3), 2: (2, 2, 2, 2, 3), 3: (4, 4, 3)}
# a rank: its piece [4, 3] read back as [2, 2, 3] and flattened again, for a
# lookup by its own constant 9
MINE = LNode("unflatten", "fw", [10], [11], {"dim": 0, "sizes": [2, 2]}, "bw:moe")
BACK = LNode("flatten", "fw", [11], [12], {"start": 0, "end": 1}, "bw:moe")
LOOKUP = LNode("embedding", "fw", [9, 12], [13], {}, "bw:moe")
RANK_SHAPES = {9: (4, 4), 10: (4, 3), 11: (2, 2, 3), 12: (4, 3), 13: (4, 3)}


def test_a_reshape_matches_only_single_device_reshapes_it_can_be_a_piece_of() -> None:
    m = _rank(_single(CHAIN, MODULE, shapes=SINGLE_SHAPES), RANK_SHAPES, {10: 1})
    assert m.reshaped_alike(MINE, [0, 1]) == [1]
    assert m.aligns(MINE) and not m.misshaped(MINE)


def test_a_reshape_keyed_alike_with_misshaped_nodes_only_aligns_with_none() -> None:
    m = _rank(_single(CHAIN, shapes=SINGLE_SHAPES), RANK_SHAPES, {10: 1})
    assert m.reshaped_alike(MINE, [0]) == []
    assert not m.aligns(MINE) and m.misshaped(MINE)


def test_other_operators_keep_their_keyed_candidates() -> None:
    m = _rank(_single(CHAIN, shapes=SINGLE_SHAPES), RANK_SHAPES, {10: 1})
    add = LNode("add", "fw", [10, 10], [11], {}, "moe")
    assert m.reshaped_alike(add, [0]) == [0]


def test_a_misshaped_reshape_read_back_by_flattens_alone_is_left_out() -> None:
    m = _rank(_single(CHAIN, shapes=SINGLE_SHAPES), RANK_SHAPES, {10: 1},
              readers=[BACK, LOOKUP], own={9: 0})
    assert m.undone_by_readers(MINE)
    assert 11 in m.undone


def test_a_misshaped_reshape_with_another_reader_is_not_left_out() -> None:
    other = LNode("mul_scalar", "fw", [11], [14], {"value": 2.0}, "bw:moe")
    shapes = {**RANK_SHAPES, 14: (2, 2, 3)}
    m = _rank(_single(CHAIN, shapes=SINGLE_SHAPES), shapes, {10: 1},
              readers=[BACK, LOOKUP, other], own={9: 0})
    assert not m.undone_by_readers(MINE)
    assert not m.undone


def test_a_flatten_back_read_by_the_model_backward_keeps_the_reshape() -> None:
    """The reader's output read by a backward node of no constant of the
    rank's own: as before, aligned (and refused) rather than left out."""
    m = _rank(_single(CHAIN, shapes=SINGLE_SHAPES), RANK_SHAPES, {10: 1},
              readers=[BACK, LOOKUP], own={})
    assert not m.undone_by_readers(MINE)


def test_a_reshape_that_aligns_is_never_left_out() -> None:
    m = _rank(_single(CHAIN, MODULE, shapes=SINGLE_SHAPES), RANK_SHAPES, {10: 1},
              readers=[BACK, LOOKUP], own={9: 0})
    assert not m.undone_by_readers(MINE)
