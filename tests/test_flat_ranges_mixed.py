"""flat_ranges.mixed: a view of a reduce-scattered range whose elements are
no block of one value (a collective that wrote another rank's range) is
lowered as exactly those elements in row-major order, and every node it
emits is marked loose (docs/soundness.md, "Plans traced from PyTorch",
91 (b))."""

from __future__ import annotations

import numpy as np

import backends.torch.lowering  # noqa: F401 (registers the handlers)
from backends.torch.lowering.context import Lowerer
from backends.torch.lowering.flat_ranges import mixed
from verdict.ops import get_op


def _run(lw: Lowerer, values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """The lowered nodes evaluated in float64 by the rule table."""
    env = dict(values)
    for node in lw.nodes:
        outs = get_op(node.op).forward(np, [env[v] for v in node.ins], **node.kwargs)
        env.update(zip(node.outs, outs))
    return env


def test_elements_of_two_values_and_zeros_seen_as_a_block() -> None:
    lw = Lowerer({"events": [], "shapes": {}, "consts": {}, "constants": set()}, vocab=10)
    a, b = lw.new((3, 4)), lw.new((5,))
    z = lw.emit("zeros", [], [(2,)], {"shape": [2]}, "none")[0]  # a padding's zeros
    start = len(lw.nodes)
    x = mixed(lw, [(a, 6, 12), (z, 0, 2), (b, 0, 4)], (3, 4))
    va, vb = np.arange(12.0).reshape(3, 4), np.arange(100.0, 105.0)
    got = _run(lw, {a: va, b: vb})[x]
    want = np.concatenate([va.reshape(-1)[6:12], np.zeros(2), vb[:4]]).reshape(3, 4)
    assert np.array_equal(got, want)
    assert all(o in lw.mixed for n in lw.nodes[start:] for o in n.outs)
    assert lw.mixed[x] is None  # no final block reads it yet


def test_a_1d_view_across_two_rows() -> None:
    lw = Lowerer({"events": [], "shapes": {}, "consts": {}, "constants": set()}, vocab=10)
    a = lw.new((4, 3))
    x = mixed(lw, [(a, 2, 8)], (6,))
    va = np.arange(12.0).reshape(4, 3)
    assert np.array_equal(_run(lw, {a: va})[x], va.reshape(-1)[2:8])
