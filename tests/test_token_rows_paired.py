"""Token rows (batch, position) cut over dp and tp, the single-device step
written in the ranks' order (docs/soundness.md, "Plans traced from
PyTorch", 89 and 98): the forward entries are the flattens paired with the
ranks' flattens of their own rows (not those of all positions, gathered);
the backward's entries and every exit are found by reaching the rows back
from the nodes that tie them to unordered values; the trace so written
computes the same loss and gradients. Reaching back to an input of the
step, modules that flatten another number of times than every rank, and
ranks that flatten as often at other flattens, are refused in one line; a
rank whose own hook flattens once more is paired from the others."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import LNode, Lowered
from backends.torch.tracer.token_order import RowGrid
from backends.torch.tracer.token_rows import _rank_chains, grow_chains, paired_entries
from verdict.numeric import NumericXP, run_node
from verdict.plan import Node

B, L, H, E = 2, 4, 3, 2
GRID = RowGrid((B, L), (2, 2))  # torchtitan's rows at dp 2 tp 2: block d * tp + t
LOCAL = (B // 2, L // 2)
FLAT = {"start": 0, "end": 1}


def _unflat(sizes: tuple[int, int]) -> dict:
    return {"dim": 0, "sizes": list(sizes)}


def _single() -> Lowered:
    """A router's gate, routed experts (a recorded constant of the rows)
    and a shared expert, each flattening x; a backward named after the
    shared expert (as torchtitan's is) that flattens the router's gradient
    and ties it to the gate's flattened input (the gate weight's gradient)."""
    bl = B * L
    shapes = {0: (B, L, H), 1: (bl, H), 2: (H, E), 3: (bl, H), 4: (bl, E), 5: (B, L, E),
              6: (bl, H), 7: (bl, H), 8: (B, L, H), 9: (H, H), 10: (bl, H), 11: (bl, H),
              12: (B, L, H), 13: (B, L, H), 14: (), 15: (), 16: (), 17: (B, L, E),
              18: (bl, E), 19: (E, bl), 20: (E, H), 21: (E, H), 22: (bl, H), 23: (B, L, H)}
    nodes = [LNode("flatten", "fw", [0], [3], FLAT, "one.moe.router.gate"),
             LNode("matmul", "fw", [3, 2], [4], {}, "one.moe.router.gate"),
             LNode("unflatten", "fw", [4], [5], _unflat((B, L)), "one.moe.router.gate"),
             LNode("flatten", "fw", [0], [6], FLAT, "one.moe.experts"),
             LNode("mul", "fw", [6, 1], [7], {}, "one.moe.experts"),
             LNode("unflatten", "fw", [7], [8], _unflat((B, L)), "one.moe.experts"),
             LNode("flatten", "fw", [0], [10], FLAT, "one.moe.shared"),
             LNode("matmul", "fw", [10, 9], [11], {}, "one.moe.shared"),
             LNode("unflatten", "fw", [11], [12], _unflat((B, L)), "one.moe.shared"),
             LNode("add", "fw", [8, 12], [13], {}, "one.moe"),
             LNode("sum", "fw", [13], [14], {"dim": None, "keepdim": False}, "loss"),
             LNode("sum", "fw", [5], [15], {"dim": None, "keepdim": False}, "loss"),
             LNode("add", "fw", [14, 15], [16], {}, "loss"),
             LNode("flatten", "fw", [17], [18], FLAT, "bw:one.moe.shared"),
             LNode("transpose", "fw", [18], [19], {"dim0": 0, "dim1": 1}, "bw:one.moe.shared"),
             LNode("matmul", "fw", [19, 3], [20], {}, "bw:one.moe.shared"),
             LNode("transpose", "fw", [2], [21], {"dim0": 0, "dim1": 1}, "bw:one.moe.shared"),
             LNode("matmul", "fw", [18, 21], [22], {}, "bw:one.moe.shared"),
             LNode("unflatten", "fw", [22], [23], _unflat((B, L)), "bw:one.moe.shared")]
    rng = np.random.default_rng(0)
    return Lowered(rank=0, coords={}, shapes=shapes, nodes=nodes,
                   inputs={0: ("input", "x"), 1: ("buffer", "routing"), 2: ("param", "w"),
                           9: ("param", "v"), 17: ("input", "g")},
                   axes={}, losses=[16], grads={"w": 20, "x": 23},
                   constants={1: rng.standard_normal((bl, H))})


def _run(low: Lowered, given: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    values = {**given, **{v: np.asarray(c) for v, c in low.constants.items()}}
    for node in low.nodes:
        fake = Node(0, 0, node.op, node.dir, tuple(node.ins), tuple(node.outs), dict(node.kwargs))
        outs = run_node(NumericXP(), fake, [values[v] for v in node.ins],
                        [low.shapes[o] for o in node.outs])
        values.update(zip(node.outs, outs))
    return values


def _rank(rank: int, shared_rows: int = L) -> Lowered:
    """A rank's forward flattens: its own rows in the gate and the experts,
    all positions (gathered) in the shared expert."""
    lo, li = LOCAL
    shapes = {0: (lo, li, H), 1: (lo * li, H), 2: (lo * li, H), 3: (lo, shared_rows, H),
              4: (lo * shared_rows, H), 5: (lo * li, H), 6: (lo * li, H)}
    nodes = [LNode("flatten", "fw", [0], [1], FLAT, "lm.moe.router.gate"),
             LNode("flatten", "fw", [0], [2], FLAT, "lm.moe.experts"),
             LNode("mul", "fw", [2, 5], [6], {}, "lm.moe.experts"),
             LNode("flatten", "fw", [3], [4], FLAT, "lm.moe.shared"),
             LNode("flatten", "fw", [0], [1], FLAT, "lm.attention")]  # outside the routing layer
    return Lowered(rank=rank, coords={}, shapes=shapes, nodes=nodes, inputs={}, axes={},
                   losses=[], grads={}, constants={5: np.zeros((lo * li, H))})


def test_entries_are_paired_with_the_ranks_own_flattens() -> None:
    lows = [_rank(r) for r in range(4)]
    entries = paired_entries(_single(), lows, GRID, {r: LOCAL for r in range(4)})
    assert entries == {0, 3}  # the gate's and the experts' flattens, not the shared expert's
    # (the root class is left out of the names: "lm" on the ranks, none on one device)


def test_the_rows_reached_back_write_the_same_step() -> None:
    rng = np.random.default_rng(1)
    given = {0: rng.standard_normal((B, L, H)), 2: rng.standard_normal((H, E)),
             9: rng.standard_normal((H, H)), 17: rng.standard_normal((B, L, E))}
    before = _run(_single(), given)
    low = _single()
    entries, exits = grow_chains(low, GRID, {0, 3})
    assert (len(entries), len(exits)) == (3, 3)  # the backward's flatten found, 3 exits
    after = _run(low, given)
    for v in (16, 20, 23):  # the loss and both gradients
        assert np.allclose(after[v], before[v])
    assert np.allclose(after[3], before[3][GRID.order()])  # the gate's rows in the order
    assert np.allclose(after[10], before[10])  # the shared expert's left as they were
    assert np.array_equal(low.constants[1], _single().constants[1][GRID.order()])


def test_a_module_flattening_another_number_of_times_is_refused() -> None:
    lows = [_rank(r) for r in range(4)]
    for low in lows:
        low.nodes.append(copy.copy(low.nodes[0]))
    with pytest.raises(LoweringError, match="moe.router.gate flattens the token rows 1 times on "
                                            "one device, its batch rows 2 times on the ranks"):
        paired_entries(_single(), lows, GRID, {r: LOCAL for r in range(4)})


def test_a_rank_flattening_its_rows_once_more_is_paired_from_the_others() -> None:
    # a hook of ranks 0 and 1 alone flattens their rows once more in the experts
    # (torchtitan's titan_ep_combine_other_gate at dp 2 ep 2 tp 2): the pairing is
    # read from ranks 2 and 3, which flatten as the one-device step does
    lows = [_rank(r) for r in range(4)]
    for low in lows[:2]:
        low.nodes.insert(1, copy.copy(low.nodes[1]))
    assert paired_entries(_single(), lows, GRID, {r: LOCAL for r in range(4)}) == {0, 3}
    # and a module only some ranks flatten in, never the one-device step, pairs nothing
    lows[2].nodes[0] = LNode("flatten", "fw", [0], [1], FLAT, "lm.moe.other")
    assert paired_entries(_single(), lows, GRID, {r: LOCAL for r in range(4)}) == {0, 3}


def test_ranks_flattening_as_often_at_other_flattens_are_refused() -> None:
    # the experts flatten twice everywhere: ranks 0, 1 their own rows first, then all
    # positions; ranks 2, 3 the other way round
    single = _single()
    single.nodes.insert(4, LNode("flatten", "fw", [0], [6], FLAT, "one.moe.experts"))
    lows = [_rank(r) for r in range(4)]
    for low in lows:
        extra = LNode("flatten", "fw", [3], [4], FLAT, "lm.moe.experts")
        low.nodes.insert(2 if low.rank < 2 else 1, extra)
    with pytest.raises(LoweringError, match="rank 2 flattens its own token rows in "
                                            "moe.experts at other flattens than rank 0"):
        paired_entries(single, lows, GRID, {r: LOCAL for r in range(4)})


def test_rows_reached_back_to_an_input_are_refused() -> None:
    low = _single()
    # the gate weight's gradient taken against an input of the step's rows
    low.shapes[24] = (B * L, H)
    low.inputs[24] = ("input", "rows")
    low.nodes[15] = LNode("matmul", "fw", [19, 24], [20], {}, "bw:one.moe.shared")
    low.nodes.insert(15, LNode("mul", "fw", [3, 24], [25], {}, "one.moe.router.gate"))
    low.shapes[25] = (B * L, H)
    with pytest.raises(LoweringError, match="ranks. order of the token rows: .*mul at one."
                                            "moe.router.gate ties"):
        grow_chains(low, GRID, {0, 3})


def test_a_cut_along_rows_reached_back_is_refused() -> None:
    low = _single()
    # the router's gradient rows taken from a wider value by a narrow
    low.shapes[24] = (B * L + 2, E)
    low.inputs[24] = ("input", "wide")
    low.nodes[13] = LNode("narrow", "fw", [24], [18], {"dim": 0, "start": 0, "length": B * L},
                          "bw:one.moe.shared")
    with pytest.raises(LoweringError, match="narrow at bw:one.moe.shared makes a value carrying "
                                            "token rows from no dim"):
        grow_chains(low, GRID, {0, 3})


def test_a_ranks_own_reshape_read_back_by_a_flatten_is_no_chain_site() -> None:
    # dp rank 0's hook flattens its scores, permutes them, puts them back in
    # their shape, and the experts flatten them again: the unflatten and the
    # flatten back compose to the identity, so the chain goes at the hook's flatten
    lo, li = LOCAL
    shapes = {0: (lo, li, E), 1: (lo * li, E), 2: (lo * li, E), 3: (lo, li, E),
              4: (lo * li, E), 5: (lo * li, lo * li), 6: (lo * li, E)}
    nodes = [LNode("flatten", "fw", [0], [1], FLAT, "lm.moe.experts"),
             LNode("matmul", "fw", [5, 1], [2], {}, "lm.moe.experts"),
             LNode("unflatten", "fw", [2], [3], _unflat(LOCAL), "lm.moe.experts"),
             LNode("flatten", "fw", [3], [4], FLAT, "lm.moe.experts"),
             LNode("mul", "fw", [4, 4], [6], {}, "lm.moe.experts")]
    low = Lowered(rank=0, coords={}, shapes=shapes, nodes=nodes, inputs={}, axes={}, losses=[],
                  grads={}, constants={5: np.eye(lo * li)[::-1]})
    # (the single-device chain's key is none of the rank's: no pairing by key)
    wanted = [{("moe.router", "flatten", 0)}, set()]
    assert _rank_chains(low, LOCAL, wanted) == ({0}, set())
    # an unflatten read by another reader too is no such pair: refused
    nodes.append(LNode("sum", "fw", [3], [7], {"dim": None, "keepdim": False}, "lm.moe"))
    shapes[7] = ()
    with pytest.raises(LoweringError, match="rank 0 flattens its token rows 2 times and "
                                            "unflattens them 1 times"):
        _rank_chains(low, LOCAL, wanted)
