"""lowering: a pack of flattened tensors (``torch.cat([k.flatten(),
v.flatten()])``, as PyTorch's ring attention moves its keys and values)
all-gathered or passed round a ring by an all-to-all, then cut back into
its tensors, is each tensor sent and received as it is: the pieces a rank
reads back are received values of the same shapes (claimed, by the build,
as the sender's pieces), never a slice of a flat buffer that no
single-device value is."""

from __future__ import annotations

import pytest

import backends.torch.lowering  # noqa: F401 (registers the handlers)
from backends.torch.errors import LoweringError
from backends.torch.lowering.context import Lowerer
from backends.torch.lowering.ir import Bucket
from backends.torch.lowering.registry import handlers

GATHER = "_c10d_functional.all_gather_into_tensor.default"
ALL_TO_ALL = "_c10d_functional.all_to_all_single.default"


def _pack(rank: int) -> tuple[Lowerer, int, int, int]:
    """A lowerer of ``rank`` holding k [1, 2, 2, 2] and v [1, 2, 2, 3]
    packed as the ring packs them (recorded value 9)."""
    lw = Lowerer({"events": [], "shapes": {}, "consts": {}, "constants": set(), "rank": rank},
                 vocab=10)
    k, v = lw.new((1, 2, 2, 2)), lw.new((1, 2, 2, 3))
    lw.env[k], lw.env[v] = k, v
    lw.env[9] = Bucket((k, v))
    return lw, k, v, 9


def _ops(lw: Lowerer) -> list[tuple[str, tuple | None]]:
    return [(n.op, n.group) for n in lw.nodes]


def test_all_gathered_pack_is_each_members_tensors() -> None:
    lw, k, v, pack = _pack(1)
    gathered = handlers()[GATHER](lw, [("v", pack), 2, "0"], {}, [(40,)], (0, 1))
    lw.env[10] = gathered
    mine, other = handlers()["aten.chunk.default"](lw, [("v", 10), 2], {}, [(20,), (20,)], None)
    assert mine.pieces == (k, v) or other.pieces == (k, v)
    theirs = mine if other.pieces == (k, v) else other
    assert [lw.shapes[p] for p in theirs.pieces] == [(1, 2, 2, 2), (1, 2, 2, 3)]
    assert _ops(lw) == [("send", (1, 0)), ("send", (1, 0)),
                        ("send_recv", (0, 1)), ("send_recv", (0, 1))]
    # cut back: the slice of the first 8 elements seen as k's shape is the received k
    lw.env[11] = theirs
    piece = handlers()["aten.slice.Tensor"](lw, [("v", 11), 0, 0, 8], {}, [(8,)], None)
    lw.env[12] = piece
    got = handlers()["aten.reshape.default"](lw, [("v", 12), [1, 2, 2, 2]], {}, [(1, 2, 2, 2)],
                                            None)
    assert lw.materialize(got) == theirs.pieces[0]


def test_a_ring_step_sends_the_pack_to_one_member_and_takes_one_members() -> None:
    lw, k, v, pack = _pack(0)
    got = handlers()[ALL_TO_ALL](lw, [("v", pack), [0, 20], [0, 20], "0"], {}, [(20,)], (0, 1))
    assert isinstance(got, Bucket) and len(got.pieces) == 2 and got.pieces != (k, v)
    assert _ops(lw) == [("send", (0, 1)), ("send", (0, 1)),
                        ("send_recv", (1, 0)), ("send_recv", (1, 0))]


def test_an_all_to_all_that_cuts_a_pack_is_refused() -> None:
    lw, _, _, pack = _pack(0)
    with pytest.raises(LoweringError, match="cuts a pack"):
        handlers()[ALL_TO_ALL](lw, [("v", pack), [10, 10], [10, 10], "0"], {}, [(20,)], (0, 1))
