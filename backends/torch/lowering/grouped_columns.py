"""Columns, comparisons and selections of grouped rows, kept grouped
(docs/soundness.md, "Plans traced from PyTorch", 104 (c)). A helper module:
``grouped`` registers these refinements around ``grouped_rows.as_rows``.

Grouped rows ``Experts(y, group, index)`` hold every group's result for
every row of a base (``y`` ``[G, N, ...]``), row i being ``y[group[i],
index[i]]``. ``grouped_rows.as_rows`` gives an op with a dim argument each
row's own group's result, ``sum_g M[g] * y[g]``: under expert parallelism
a rank holds only its local groups, so that sum is its share of the
single-device sum, which a nonlinear op after it (a clamp) must not read.
These ops act on each entry of y by itself, so they act on all of y and
the result stays grouped, no sum taken:

- ``slice`` of a dim other than the rows' (gpt_oss's interleaved gate and
  up columns, ``[..., ::2]`` and ``[..., 1::2]``) is the slice of y along
  that dim, one further out; its backward ``slice_backward`` likewise
  (the sizes' rows read as y's ``[G, N]``);
- a comparison with a number (``ge``, ``le``, ``gt``, ``lt``: clamp's
  backward mask), ``logical_and`` of two, and ``where`` reading one are
  entry by entry: on y, the comparison kept pending beside the groups
  (``ExpertsOf``) until a ``where`` on the same grouped rows reads it.

An operand that is not grouped rows of the same groups and index must not
vary along the rows (a number), else the op goes to ``as_rows``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.grouped_rows import Experts
from backends.torch.lowering.ir import Pending
from backends.torch.lowering.routed_rows import value_of
from backends.torch.lowering.routed_rowwise import tensor_refs
from backends.torch.lowering.stand_ins import standing_in

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]

#: entry-by-entry ops whose result may be a pending comparison
MASKS = frozenset({"aten.ge.Scalar", "aten.le.Scalar", "aten.gt.Scalar", "aten.lt.Scalar",
                   "aten.logical_and.default", "aten.logical_and_.default", "aten.where.self"})
#: ops that pick or place columns (a dim other than the rows')
COLUMNS = frozenset({"aten.slice.Tensor", "aten.slice_backward.default"})

#: first id of the temporary values a grouped op reads in place of grouped rows
_TEMP = 1 << 42


@dataclass(frozen=True, eq=False)
class ExpertsOf(Pending):
    """A comparison (``ir.Compare``, ``compose.Both``) of every entry of
    grouped rows' y, the groups and index beside it: a mask a ``where``
    on the same grouped rows selects with."""
    value: Any
    group: np.ndarray
    index: np.ndarray
    wide: tuple[int, ...]  # the shape of the compared y

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a comparison of grouped rows read other than by a "
                            f"where on the same grouped rows is not lowered")


def _is_comparison(x: Any) -> bool:
    from backends.torch.lowering.compose import Both
    from backends.torch.lowering.ir import Compare
    return isinstance(x, (Compare, Both))


def _dim(args: list, pos: int, default: int = 0) -> int:
    return int(args[pos]) if len(args) > pos and args[pos] is not None else default


def _wide_args(op: str, args: list, nd: int, wide: tuple[int, ...], rows: int) -> list | None:
    """The op's arguments on y (``wide``: one more leading dim, the
    groups'), for ``rows`` grouped rows of ``nd`` dims; None when the op
    reads the rows' dim."""
    if op == "aten.slice.Tensor":
        d = _dim(args, 1)
        if d % nd == 0:
            return None
        return [args[0], d + 1 if d >= 0 else d, *args[2:]]
    if op == "aten.slice_backward.default":
        sizes = list(args[1])
        d = _dim(args, 2)
        if d % nd == 0 or len(sizes) != nd or int(sizes[0]) != rows:
            return None
        return [args[0], [*wide[:2], *sizes[1:]], d + 1 if d >= 0 else d, *args[3:]]
    return list(args)


def grouped_entries(base: Handler) -> Handler:
    """A slice of columns, a comparison, a conjunction or a ``where`` on
    grouped rows: on all of y, the result grouped (``Experts``) or a
    pending comparison (``ExpertsOf``); anything else to ``base``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        refs = tensor_refs([args, kwargs])
        pending = [value_of(lw, r) for r in refs]
        grouped = [p for p in pending if isinstance(p, (Experts, ExpertsOf))]
        if not grouped:
            return base(lw, args, kwargs, shapes, group)
        op = lw.trace["events"][lw.event][0]
        if op not in MASKS | COLUMNS:
            return base(lw, args, kwargs, shapes, group)
        first = grouped[0]
        if any(not (np.array_equal(p.group, first.group) and np.array_equal(p.index, first.index))
               for p in grouped):
            return base(lw, args, kwargs, shapes, group)
        wide_shape = tuple(lw.shapes[first.y]) if isinstance(first, Experts) else first.wide
        gs, n = wide_shape[:2]
        rows = len(first.index)
        out_nd = max(len(s) for s in shapes)
        for ref, p in zip(refs, pending):
            if not isinstance(p, (Experts, ExpertsOf)):
                shape = tuple(lw.trace["shapes"][ref[1]])
                if len(shape) == out_nd and shape[0] != 1:
                    return base(lw, args, kwargs, shapes, group)  # varies along the rows
        if any(not s or s[0] != rows for s in shapes):
            return base(lw, args, kwargs, shapes, group)
        wide_args = _wide_args(op, list(args), len(wide_shape) - 1, wide_shape, rows)
        if wide_args is None:
            return base(lw, args, kwargs, shapes, group)
        wide = [(gs, n, *s[1:]) for s in shapes]
        with standing_in(lw, grouped, lambda p: p.y if isinstance(p, Experts) else p.value,
                         _TEMP) as sub:
            result = base(lw, sub(wide_args), sub(kwargs), wide, group)
        if _is_comparison(result):
            return ExpertsOf(result, first.group, first.index, tuple(wide[0]))
        return Experts(lw.materialize(result), first.group, first.index)
    return lower
