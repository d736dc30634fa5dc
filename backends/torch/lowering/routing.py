"""Top-k routing on recorded routing data (docs/soundness.md, "Plans traced
from PyTorch", 36): ``topk`` and its backward, rows gathered at a recorded
index, and the row-wise ops, adds and products of such rows. The rules and
their pending values are in ``routed_rows`` and ``routed_rowwise``."""

from __future__ import annotations

from backends.torch.lowering.registry import lowers, not_lowered, refines
from backends.torch.lowering.routed_rows import (
    gather,
    index,
    index_add,
    index_put,
    index_select,
    mm,
    scatter,
    topk,
    transpose_rows,
    value_selecting_backward,
)
from backends.torch.lowering.routed_rowwise import ROWWISE, rowwise, sum_rows

lowers("aten.topk.default")(topk)
lowers("aten.value_selecting_reduction_backward.default")(value_selecting_backward)
for _op, _keeps in ROWWISE.items():
    if _op == "aten.sum.dim_IntList":  # a sum over the rows themselves first
        refines(_op, absent=not_lowered)(lambda base, keeps=_keeps: sum_rows(rowwise(base, keeps)))
    else:
        refines(_op, absent=not_lowered)(lambda base, keeps=_keeps: rowwise(base, keeps))
refines("aten.index.Tensor", absent=not_lowered)(lambda base: index(base))
refines("aten.index_select.default", absent=not_lowered)(lambda base: index_select(base))
refines("aten.index_add_.default", "aten.index_add.default", absent=not_lowered)(lambda base: index_add(base))
refines("aten.index_put.default", "aten.index_put_.default", absent=not_lowered)(lambda base: index_put(base))
refines("aten.scatter.src", "aten.scatter_add.default", absent=not_lowered)(lambda base: scatter(base))
refines("aten.gather.default", absent=not_lowered)(lambda base: gather(base))
refines("aten.t.default")(lambda base: transpose_rows(base))
refines("aten.mm.default")(lambda base: mm(base))
