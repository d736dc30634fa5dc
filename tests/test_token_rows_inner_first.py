"""The ranks' order of sequence-first token rows cut by both dims, the
inner dim's parts first (Megatron-Core's ``[s, b]`` at dp x tp with
sequence parallelism: rank (d, t) holds positions block t at batch rows
block d, block ``d * tp + t``): the entry chain lays the flattened rows out
as pi, the exit chain undoes it, and on a rank (parts of one) both are the
identity (docs/soundness.md, "Plans traced from PyTorch", 103 (f))."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from backends.torch.lowering.context import LNode
from backends.torch.tracer.token_order import RowGrid
from backends.torch.tracer.token_rows import _Chains
from verdict.ops import get_op


def _run(nodes: list[LNode], values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    env = dict(values)
    for node in nodes:
        outs = get_op(node.op).forward(np, [env[v] for v in node.ins], **node.kwargs)
        env.update(zip(node.outs, outs))
    return env


def _chains(shape: tuple[int, ...], parts: tuple[int, int], local: bool):
    low = SimpleNamespace(shapes={0: shape, 1: (shape[0] * shape[1], *shape[2:])})
    return low, _Chains(low, parts, True, local)


def test_the_entry_chain_is_pi_and_the_exit_undoes_it() -> None:
    s, b, h = 8, 4, 3
    grid = RowGrid((s, b), (2, 2), inner_first=True)
    low, chains = _chains((s, b, h), grid.parts, local=False)
    flat = LNode("flatten", "fw", [0], [1], {"start": 0, "end": 1}, "mlp", None, 0)
    x = np.arange(s * b * h, dtype=np.float64).reshape(s, b, h)
    got = _run(chains.entry(flat), {0: x})[1]
    assert np.array_equal(got, x.reshape(s * b, h)[grid.order()])
    # rank (d, t) = (1, 0): positions block 0 at batch rows block 1 is block d * tp + t = 2
    lo, li = s // 2, b // 2
    block = got[2 * lo * li:3 * lo * li]
    assert np.array_equal(block, x[:lo, li:].reshape(lo * li, h))
    back = LNode("unflatten", "fw", [1], [2], {"dim": 0, "sizes": [s, b]}, "mlp", None, 0)
    low.shapes[2] = (s, b, h)
    assert np.array_equal(_run(chains.exit(back), {1: got})[2], x)


def test_on_a_rank_the_chains_are_the_identity() -> None:
    lo, li, h = 4, 2, 3
    low, chains = _chains((lo, li, h), (2, 2), local=True)
    flat = LNode("flatten", "fw", [0], [1], {"start": 0, "end": 1}, "mlp", None, 0)
    x = np.arange(lo * li * h, dtype=np.float64).reshape(lo, li, h)
    got = _run(chains.entry(flat), {0: x})[1]
    assert np.array_equal(got, x.reshape(lo * li, h))
    back = LNode("unflatten", "fw", [1], [2], {"dim": 0, "sizes": [lo, li]}, "mlp", None, 0)
    low.shapes[2] = (lo, li, h)
    assert np.array_equal(_run(chains.exit(back), {1: got})[2], x)
