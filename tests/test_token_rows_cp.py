"""Token rows (batch, position) with the positions cut by context
parallelism (docs/soundness.md, "Plans traced from PyTorch", 115): the
ranks' order is item 89's with cp in tp's place (rank (d, c) holds block
``d * cp + c``), the single-device step written in it computes the same
loss and gradients, and a rank's chains are put at the flattens paired by
module with the single-device step's, not at every flatten of its sizes
(under CP its attention and its loss flatten rows of the same sizes).
Positions cut by both tp and cp are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import LNode, Lowered
from backends.torch.tracer.token_order import RowGrid
from backends.torch.tracer.token_rows import order_token_rows, row_ops
from tests.test_token_rows_paired import FLAT, B, H, L, _run

CP = 2
LOCAL = (B, L // CP)  # every batch row, the rank's chunk of the positions
GRID = RowGrid((B, L), (1, CP))


def _step(b: int, n: int, root: str) -> Lowered:
    """``_single``'s step on ``b`` batch rows of ``n`` positions (modules
    under ``root``), with one more flatten of the rows in its attention,
    outside the routing layer, as a cp rank's attention flattens its own."""
    rows, e = b * n, 2
    shapes = {0: (b, n, H), 1: (rows, H), 2: (H, e), 3: (rows, H), 4: (rows, e), 5: (b, n, e),
              6: (rows, H), 7: (rows, H), 8: (b, n, H), 9: (H, H), 10: (rows, H), 11: (rows, H),
              12: (b, n, H), 13: (b, n, H), 14: (), 15: (), 16: (), 17: (b, n, e),
              18: (rows, e), 19: (e, rows), 20: (e, H), 21: (e, H), 22: (rows, H),
              23: (b, n, H), 24: (rows, H)}
    unflat = {"dim": 0, "sizes": [b, n]}
    m = f"{root}.moe"
    nodes = [LNode("flatten", "fw", [0], [24], FLAT, f"{root}.attention"),
             LNode("flatten", "fw", [0], [3], FLAT, f"{m}.router.gate"),
             LNode("matmul", "fw", [3, 2], [4], {}, f"{m}.router.gate"),
             LNode("unflatten", "fw", [4], [5], unflat, f"{m}.router.gate"),
             LNode("flatten", "fw", [0], [6], FLAT, f"{m}.experts"),
             LNode("mul", "fw", [6, 1], [7], {}, f"{m}.experts"),
             LNode("unflatten", "fw", [7], [8], unflat, f"{m}.experts"),
             LNode("flatten", "fw", [0], [10], FLAT, f"{m}.shared"),
             LNode("matmul", "fw", [10, 9], [11], {}, f"{m}.shared"),
             LNode("unflatten", "fw", [11], [12], unflat, f"{m}.shared"),
             LNode("add", "fw", [8, 12], [13], {}, m),
             LNode("sum", "fw", [13], [14], {"dim": None, "keepdim": False}, "loss"),
             LNode("sum", "fw", [5], [15], {"dim": None, "keepdim": False}, "loss"),
             LNode("add", "fw", [14, 15], [16], {}, "loss"),
             LNode("flatten", "fw", [17], [18], FLAT, f"bw:{m}.shared"),
             LNode("transpose", "fw", [18], [19], {"dim0": 0, "dim1": 1}, f"bw:{m}.shared"),
             LNode("matmul", "fw", [19, 3], [20], {}, f"bw:{m}.shared"),
             LNode("transpose", "fw", [2], [21], {"dim0": 0, "dim1": 1}, f"bw:{m}.shared"),
             LNode("matmul", "fw", [18, 21], [22], {}, f"bw:{m}.shared"),
             LNode("unflatten", "fw", [22], [23], unflat, f"bw:{m}.shared")]
    rng = np.random.default_rng(0)
    return Lowered(rank=0, coords={}, shapes=shapes, nodes=nodes,
                   inputs={0: ("input", "x"), 1: ("buffer", "routing"), 2: ("param", "w"),
                           9: ("param", "v"), 17: ("input", "g")},
                   axes={}, losses=[16], grads={"w": 20, "x": 23},
                   constants={1: rng.standard_normal((rows, H))})


def _cp_rank(c: int) -> Lowered:
    low = _step(*LOCAL, "lm")
    low.rank, low.coords = c, {"cp": c}
    return low


def _single_step() -> dict:
    return {"routing": True, "batch_ids": {"tokens": np.zeros((B, L), dtype=np.int64)}}


def test_a_cp_ranks_rows_are_its_block_of_the_order() -> None:
    assert GRID.block(0, 1) == 1
    order = GRID.order()
    # rank 1's rows: every batch row at positions L/2 .. L - 1, contiguous in the order
    rows = [b * L + p for b in range(B) for p in range(L // CP, L)]
    assert list(order[len(rows):]) == rows


def test_row_ops_key_a_ranks_flattens_by_module() -> None:
    ops = row_ops(_cp_rank(0), LOCAL)
    assert ops[("attention", "flatten", 0)] == 0
    assert ops[("moe.router.gate", "flatten", 0)] == 1
    assert ops[("moe.router.gate", "unflatten", 0)] == 3
    assert ops[("moe.shared", "flatten", 1)] == 14  # the backward's, its root left out
    assert len(ops) == 9


def test_the_single_device_step_in_the_cp_order_computes_the_same() -> None:
    rng = np.random.default_rng(2)
    given = {0: rng.standard_normal((B, L, H)), 2: rng.standard_normal((H, 2)),
             9: rng.standard_normal((H, H)), 17: rng.standard_normal((B, L, 2))}
    before = _run(_step(B, L, "one"), given)
    low = _step(B, L, "one")
    ranks = [_cp_rank(c) for c in range(CP)]
    assert order_token_rows(_single_step(), low, ranks, dp=1, tp=1, cp=CP)
    after = _run(low, given)
    for v in (16, 20, 23):  # the loss and both gradients
        assert np.allclose(after[v], before[v])
    assert np.array_equal(low.constants[1], _step(B, L, "one").constants[1][GRID.order()])
    assert low.nodes[0].op == "flatten"  # the attention's flatten left as it was
    for rank in ranks:  # on a rank too; the routed ones chained
        assert rank.nodes[0].op == "flatten" and rank.nodes[0].name == "lm.attention"
        assert len(rank.nodes) > len(_cp_rank(0).nodes)


def test_positions_cut_by_tp_and_cp_are_refused() -> None:
    with pytest.raises(LoweringError, match="cut by both tp and cp"):
        order_token_rows(_single_step(), _step(B, L, "one"), [_cp_rank(0)], dp=1, tp=2,
                         cp=CP)
