"""lowering: an all-gather whose form its readers decide (``ir.Gathered``)
runs once, where it was recorded, on every member: read twice it is one
node, never read it is still emitted (its members read theirs), and the
node stands at the recorded place among the rank's collectives. Emitted at
each read, a rank that read it twice ran two all-gathers and a rank that
skipped it (a ring's rank with no block to compute) none, and the ranks'
collectives did not match."""

from __future__ import annotations

import backends.torch.lowering  # noqa: F401 (registers the handlers)
from backends.torch.lowering.context import Lowerer, live_events
from backends.torch.lowering.registry import handlers

GATHER = "_c10d_functional.all_gather_into_tensor.default"
GROUP = (0, 1)


def _lowerer() -> tuple[Lowerer, int]:
    lw = Lowerer({"events": [], "shapes": {}, "consts": {}, "constants": set()}, vocab=10)
    x = lw.new((2, 3))
    lw.env[x] = x
    return lw, x


def _gather(lw: Lowerer, x: int):
    return handlers()[GATHER](lw, [("v", x), 2, "0"], {}, [(4, 3)], GROUP)


def _ops(lw: Lowerer) -> list[str]:
    return [n.op for n in lw.nodes]


def test_read_twice_is_one_all_gather() -> None:
    lw, x = _lowerer()
    g = _gather(lw, x)
    a, b = lw.materialize(g), lw.materialize(g)
    lw.settle()
    assert a == b
    assert _ops(lw) == ["all_gather"]


def test_never_read_is_still_emitted_once() -> None:
    lw, x = _lowerer()
    _gather(lw, x)
    lw.settle()
    assert _ops(lw) == ["all_gather"]
    assert lw.nodes[0].group == GROUP and lw.nodes[0].kwargs == {"dim": 0}


def test_emitted_where_it_was_recorded() -> None:
    lw, x = _lowerer()
    g = _gather(lw, x)
    y = lw.emit("all_reduce", [x], [(2, 3)], group=GROUP)[0]
    lw.emit("mul_scalar", [y], [(2, 3)], {"value": 2.0})
    lw.materialize(g)
    lw.settle()
    assert _ops(lw) == ["all_gather", "all_reduce", "mul_scalar"]


def test_read_along_another_dim_is_that_gather_in_the_same_place() -> None:
    lw, x = _lowerer()
    g = _gather(lw, x)
    lw.emit("mul_scalar", [x], [(2, 3)], {"value": 2.0})
    along = g.gather(lw, 1)
    assert lw.shapes[along] == (2, 6)
    lw.settle()
    assert _ops(lw) == ["all_gather", "mul_scalar"]
    assert lw.nodes[0].kwargs == {"dim": 1}


def test_an_unread_all_gather_is_live() -> None:
    trace = {"losses": [3], "grads": {}, "events": [
        (GATHER, ([("v", 0), 2, "0"], {}), [1], [(4,)], "", GROUP, -1),
        ("aten.mul.Tensor", ([("v", 2), 2.0], {}), [3], [()], "", None, -1)]}
    assert live_events(trace) == {0, 1}
