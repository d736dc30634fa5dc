"""Grouped GEMMs on rows gathered at recorded routing (docs/soundness.md,
"Plans traced from PyTorch", 36 c): ``torch._grouped_mm`` and its
backward, rows of a C-fold copy, their adds back at the tokens, and the
row-wise ops on grouped results. The rules and their pending values are in
``grouped_rows``; rows that are one per group (a per-expert bias read at
each row's group, and its gradient, each group's rows summed) in
``per_group``; columns, comparisons and selections of grouped rows kept
grouped in ``grouped_columns``. Their refinements wrap ``grouped_rows``'s."""

from __future__ import annotations

from backends.torch.lowering import grouped_columns, per_group
from backends.torch.lowering import grouped_rows as g
from backends.torch.lowering.registry import not_lowered, refines
from backends.torch.lowering.routed_rowwise import ROWWISE

for _op in g.ELEMENTWISE:
    refines(_op, absent=not_lowered)(lambda base: per_group.rowwise(g.experts_rowwise(base)))
for _op in ROWWISE:
    if _op not in g.ELEMENTWISE | grouped_columns.MASKS | grouped_columns.COLUMNS:
        refines(_op, absent=not_lowered)(lambda base: g.as_rows(base))
for _op in grouped_columns.MASKS | grouped_columns.COLUMNS - {"aten.slice.Tensor"}:
    refines(_op, absent=not_lowered)(lambda base: grouped_columns.grouped_entries(g.as_rows(base)))
refines("aten.slice.Tensor", absent=not_lowered)(
    lambda base: per_group.slice_rows(grouped_columns.grouped_entries(g.as_rows(base))))
refines("aten._grouped_mm.default", absent=not_lowered)(
    lambda base: per_group.record_groups(g.grouped_mm(base)))
refines("aten.index.Tensor")(lambda base: g.index(base))
refines("aten.gather.default")(lambda base: g.gather_rows(base))
refines("aten.index_select.default")(lambda base: g.index_select(base))
refines("aten.scatter_add.default")(lambda base: g.scatter_add(base))
refines("aten.scatter_add_.default", absent=not_lowered)(lambda base: g.scatter_add(base))
refines("aten.index_add.default", "aten.index_add_.default")(
    lambda base: per_group.index_add(g.index_add(base)))
refines("aten.index_put.default")(lambda base: g.index_put(base))
refines("aten.transpose.int", "aten.t.default")(lambda base: g.transpose(base))
