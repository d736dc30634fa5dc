"""A sum over a dim of one row the rank skips (``tracer/align/rows.py``
``one_row_sums``; docs/soundness.md, "Plans traced from PyTorch", 126 (b)):
the single-device step sums the position embedding's gradient over the
batch rows (a broadcast's backward) before the embedding's backward; a
data-parallel rank holding one row reads its gradient as it is. The rank's
reader is given that sum of its input (the identity on a dim of size 1),
matched with the single-device sum; nothing is written when the reader
matches as it is, or when no sum makes it match."""

from __future__ import annotations

from types import SimpleNamespace

from backends.torch.lowering.context import LNode
from backends.torch.tracer.align.claim import Claim, key_kwargs
from backends.torch.tracer.align.rows import Rows

NAME = "M.embedding"


class _Rank(Rows):
    """One rank's state, as much of it as ``one_row_sums`` reads."""

    def __init__(self, single: list[LNode], shapes: dict[int, tuple[int, ...]]) -> None:
        self.low = SimpleNamespace(shapes=dict(shapes))
        by_key: dict[tuple, list[int]] = {}
        for i, n in enumerate(single):
            by_key.setdefault((n.op, n.dir, tuple(n.ins), key_kwargs(n.kwargs)), []).append(i)
        self.b = SimpleNamespace(s=SimpleNamespace(by_key=by_key, low=SimpleNamespace(nodes=single)))
        self.consumers: dict[int, list[LNode]] = {}
        # the rank's gradient (5) is the piece of the single-device one (105) its dp
        # coordinate holds along the batch dim; the positions (6) are the same (106)
        self.sv = {5: 105, 6: 106}
        self.claim = {5: Claim([["dp"], [], []]), 6: Claim([[], []])}

    def aligns(self, node: LNode) -> bool:  # as ``align.nodes``'s
        key = (node.op, node.dir, tuple(-1 if v < 0 else self.sv[v] for v in node.ins),
               key_kwargs(node.kwargs))
        return bool(self.b.s.by_key.get(key))


def _single() -> list[LNode]:
    return [LNode("sum", "fw", [105], [107], {"dim": 0, "keepdim": True}, NAME),
            LNode("embedding", "bw", [106, -1, 107], [-1, 108], {}, NAME)]


def test_the_skipped_sum_is_written_before_the_reader() -> None:
    rank = _Rank(_single(), {5: (1, 4, 16), 6: (1, 4)})
    reader = LNode("embedding", "bw", [6, -1, 5], [-1, 9], {}, NAME)
    made = rank.one_row_sums(reader)
    assert len(made) == 1 and made[0].op == "sum" and made[0].ins == [5]
    assert made[0].kwargs == {"dim": 0, "keepdim": True}
    u = made[0].outs[0]
    assert reader.ins == [6, -1, u] and rank.low.shapes[u] == (1, 4, 16)


def test_more_than_one_row_is_left_as_it_is() -> None:
    rank = _Rank(_single(), {5: (2, 4, 16), 6: (1, 4)})
    reader = LNode("embedding", "bw", [6, -1, 5], [-1, 9], {}, NAME)
    assert rank.one_row_sums(reader) == [] and reader.ins == [6, -1, 5]


def test_a_dim_no_axis_cuts_is_left_as_it_is() -> None:
    rank = _Rank(_single(), {5: (1, 4, 16), 6: (1, 4)})
    rank.claim[5] = Claim([[], [], []])
    reader = LNode("embedding", "bw", [6, -1, 5], [-1, 9], {}, NAME)
    assert rank.one_row_sums(reader) == []


def test_a_reader_that_matches_is_left_as_it_is() -> None:
    single = [*_single(), LNode("embedding", "bw", [106, -1, 105], [-1, 109], {}, NAME)]
    rank = _Rank(single, {5: (1, 4, 16), 6: (1, 4)})
    reader = LNode("embedding", "bw", [6, -1, 5], [-1, 9], {}, NAME)
    assert rank.one_row_sums(reader) == []
