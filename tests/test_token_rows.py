"""The one-device trace written in the ranks' order of its token rows
(docs/soundness.md, "Plans traced from PyTorch", 89), on small traces run
with the rule table's numeric meaning: the chains lay out the rows and undo
the order, a constant read along the rows is relabelled so the step's
values outside the rows are unchanged, a rank's chain is the identity; a
node that reads the rows other than row by row, a relabelled constant read
outside the rows, and a result carrying rows are refused in one line."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import LNode, Lowered
from backends.torch.tracer.token_order import RowGrid
from backends.torch.tracer.token_rows import check_and_relabel, write_chains
from verdict.numeric import NumericXP, run_node
from verdict.plan import Node

S, B, H = 4, 2, 3
GRID = RowGrid((S, B), (1, 2), inner_first=True)  # Megatron's [s, b] at dp 2


def _trace(extra: list[LNode] | None = None, grads: dict | None = None) -> Lowered:
    """x [s, b, h] flattened to rows, times a recorded constant of the rows,
    unflattened back, summed (the loss)."""
    shapes = {0: (S, B, H), 1: (S * B, H), 2: (S * B, H), 3: (S * B, H), 4: (S, B, H), 5: (),
              6: (S * B, H), 7: (S * B, H)}
    nodes = [LNode("flatten", "fw", [0], [2], {"start": 0, "end": 1}, "m"),
             LNode("mul", "fw", [2, 1], [3], {}, "m"),
             *(extra or []),
             LNode("unflatten", "fw", [3], [4], {"dim": 0, "sizes": [S, B]}, "m"),
             LNode("sum", "fw", [4], [5], {"dim": None, "keepdim": False}, "loss")]
    rng = np.random.default_rng(0)
    return Lowered(rank=0, coords={}, shapes=shapes, nodes=nodes,
                   inputs={0: ("input", "x"), 1: ("buffer", "const.rows"), 6: ("param", "y")},
                   axes={}, losses=[5], grads=grads or {},
                   constants={1: rng.standard_normal((S * B, H))})


def _run(low: Lowered, x: np.ndarray, y: np.ndarray) -> dict[int, np.ndarray]:
    values = {0: x, 6: y, **{v: np.asarray(c) for v, c in low.constants.items()}}
    for node in low.nodes:
        fake = Node(0, 0, node.op, node.dir, tuple(node.ins), tuple(node.outs), dict(node.kwargs))
        outs = run_node(NumericXP(), fake, [values[v] for v in node.ins],
                        [low.shapes[o] for o in node.outs])
        values.update(zip(node.outs, outs))
    return values


def _reorder(low: Lowered) -> Lowered:
    seeds, chains = write_chains(low, GRID.sizes, GRID.parts, GRID.inner_first, {"m"})
    check_and_relabel(low, GRID.rows, seeds, chains, GRID.order())
    return low


def test_the_step_in_the_order_computes_the_same_values() -> None:
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((S, B, H)), rng.standard_normal((S * B, H))
    before = _run(_trace(), x, y)
    low = _reorder(_trace())
    assert [n.op for n in low.nodes][:3] == ["unflatten", "transpose", "flatten"]
    after = _run(low, x, y)
    pi = GRID.order()
    assert np.allclose(after[2], before[2][pi])  # the rows in the ranks' order
    assert np.allclose(after[4], before[4]) and np.isclose(after[5], before[5])
    assert np.array_equal(low.constants[1], _trace().constants[1][pi])


def test_a_rank_chain_is_the_identity() -> None:
    rng = np.random.default_rng(2)
    low = _trace()
    low.shapes = {v: (s[0], B // 2, *s[2:]) if len(s) == 3 else
                  ((S * B // 2, *s[1:]) if s else s) for v, s in low.shapes.items()}
    low.nodes[2] = LNode("unflatten", "fw", [3], [4], {"dim": 0, "sizes": [S, B // 2]}, "m")
    low.constants = {1: rng.standard_normal((S * B // 2, H))}
    x, y = rng.standard_normal((S, B // 2, H)), rng.standard_normal((S * B // 2, H))
    before = _run(low, x, y)
    chained = copy.deepcopy(low)
    write_chains(chained, (S, B // 2), GRID.parts, GRID.inner_first, {"m"}, local=True)
    after = _run(chained, x, y)
    assert len(chained.nodes) == len(low.nodes) + 4
    assert all(np.array_equal(after[v], before[v]) for v in (2, 3, 4, 5))


def test_a_cut_along_the_rows_is_refused() -> None:
    narrow = LNode("narrow", "fw", [2], [7], {"dim": 0, "start": 0, "length": S * B}, "m")
    low = _trace([narrow])
    low.shapes[7] = (S * B, H)
    with pytest.raises(LoweringError, match="ranks' order of the token rows: .*narrow at m "
                                            "cuts, joins or repeats along"):
        _reorder(low)


def test_a_relabelled_constant_read_outside_the_rows_is_refused() -> None:
    outside = LNode("add", "fw", [1, 6], [7], {}, "other")
    low = _trace()
    low.nodes.insert(0, outside)
    with pytest.raises(LoweringError, match="add at other ties"):
        _reorder(low)


def test_a_result_carrying_rows_is_refused() -> None:
    with pytest.raises(LoweringError, match="carries token rows"):
        _reorder(_trace(grads={"y": 3}))
