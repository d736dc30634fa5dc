"""Row-wise ops on rows gathered at a recorded routing index (the pending
``routed_rows.Rows``; docs/soundness.md, "Plans traced from PyTorch", 36 c
and 93): an op that acts on each row alone acts on all rows of the base,
the index kept beside the result; a comparison of such rows stays pending
(``RowsOf``) until a ``where`` on the same rows reads it; a sum over the
rows' dim is the sum of the masked base. A helper module: it registers
nothing (``routing`` and ``grouped`` register ``ROWWISE``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.ir import Pending
from backends.torch.lowering.routed_rows import Rows, masked, reread_at, value_of
from backends.torch.lowering.stand_ins import standing_in

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]

#: first id of the temporary values a row-wise op reads in place of rows
_TEMP = 1 << 40


@dataclass(frozen=True, eq=False)
class RowsOf(Pending):
    """Rows ``index`` of a comparison (``ir.Compare``, ``compose.Both``) of
    all ``rows`` rows of a base: a mask a ``where`` selects with, row by row."""
    value: Any
    index: np.ndarray
    rows: int

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a comparison of gathered rows read other than by a "
                            f"where is not lowered")

    def gathered(self, lw: Lowerer) -> Any:
        """The same comparison of the gathered rows themselves (what an op
        that does not act row by row on all rows reads)."""
        from dataclasses import replace

        from backends.torch.lowering.compose import Both

        def of(c: Any) -> Any:
            return replace(c, x=lw.materialize(Rows(c.x, self.index)))
        v = self.value
        return Both(of(v.a), of(v.b)) if isinstance(v, Both) else of(v)


def _handed_on(base: Handler, lw: Lowerer, args, kwargs, shapes, group):
    """``base`` on the op as recorded, a pending comparison of gathered rows
    read as the comparison of those rows."""
    found = {r[1]: value_of(lw, r) for r in tensor_refs([args, kwargs])
             if isinstance(value_of(lw, r), RowsOf)}
    if not found:
        return base(lw, args, kwargs, shapes, group)
    for v, p in found.items():
        lw.env[v] = p.gathered(lw)
    try:
        return base(lw, args, kwargs, shapes, group)
    finally:
        lw.env.update(found)


def _not_rows_dim(pos: int, default: int = 0, added: int = 0) -> Callable[..., bool]:
    """The op's dim argument (at ``pos``; a list of dims, or one) is not the
    rows' dim 0; ``added``: the op adds that many dims (``unsqueeze``), so a
    negative dim counts from the output's end."""
    def ok(lw: Lowerer, args: tuple, kwargs: dict | None = None) -> bool:
        a = args[pos] if len(args) > pos else (kwargs or {}).get("dim", default)
        rows = next((value_of(lw, r) for r in tensor_refs(args) if isinstance(value_of(lw, r), Rows)), None)
        if a is None or rows is None:
            return False
        nd = len(lw.shapes[rows.base]) + added
        dims = a if isinstance(a, (list, tuple)) else [a]
        return bool(dims) and all(int(d) % nd != 0 for d in dims)
    return ok


def tensor_refs(args: Any) -> list[Any]:
    out: list[Any] = []
    if isinstance(args, (list, tuple)):
        if len(args) == 2 and args[0] == "v" and isinstance(args[1], int):
            return [args]
        for a in args:
            out.extend(tensor_refs(a))
    elif isinstance(args, dict):
        for a in args.values():
            out.extend(tensor_refs(a))
    return out


def _rows_total(lw: Lowerer, r: Rows | RowsOf) -> int:
    return r.rows if isinstance(r, RowsOf) else lw.shapes[r.base][0]


def rowwise(base: Handler, keeps_rows: Callable[..., bool]) -> Handler:
    """An op that acts on each row alone: on gathered rows of one index it
    acts on all rows of their base (its other tensors must not vary along
    the rows); anything else is handed on. A comparison of such rows stays
    the comparison of all rows (``RowsOf``) until a ``where`` reads it."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        refs = tensor_refs([args, kwargs])
        pending = [value_of(lw, a) for a in refs]
        rows = [p for p in pending if isinstance(p, (Rows, RowsOf))]
        if not rows:
            return _handed_on(base, lw, args, kwargs, shapes, group)
        first = rows[0]
        n, total = len(first.index), _rows_total(lw, first)
        if lw.rows_moved and isinstance(first, Rows):
            # rows of one base size read at two indices on a rank that added
            # rows back out of order: each read at the first's index
            for ref, p in zip(refs, pending):
                if isinstance(p, Rows) and lw.shapes[p.base][0] == total:
                    reread_at(lw, ref, p, first.index)
            pending = [value_of(lw, a) for a in refs]
            rows = [p for p in pending if isinstance(p, (Rows, RowsOf))]
        same = all(np.array_equal(r.index, first.index) and _rows_total(lw, r) == total for r in rows)
        if not same or not keeps_rows(lw, args, kwargs) \
                or any(s and s[0] != n for s in shapes):
            return _handed_on(base, lw, args, kwargs, shapes, group)
        out_nd = max(len(s) for s in shapes)
        for ref, p in zip(refs, pending):
            if isinstance(p, (Rows, RowsOf)):
                continue
            shape = tuple(lw.trace["shapes"][ref[1]])
            if len(shape) == out_nd and shape[0] != 1:
                return _handed_on(base, lw, args, kwargs, shapes, group)  # varies along the rows
        wide = [(total, *s[1:]) if s else s for s in shapes]
        with standing_in(lw, rows, lambda p: p.value if isinstance(p, RowsOf) else p.base,
                         _TEMP) as sub:
            args = sub(args)
            if keeps_rows in (_view_keeps_rows, _expand_keeps_rows, _slice_backward_keeps_rows):
                args = [args[0], [total, *args[1][1:]], *args[2:]]  # the size names the rows
            result = base(lw, args, sub(kwargs), wide, group)
        if _is_comparison(result):
            return RowsOf(result, first.index, total)
        if isinstance(result, list):
            return [Rows(lw.materialize(r), first.index) for r in result]
        return Rows(lw.materialize(result), first.index)
    return lower


def _view_keeps_rows(lw: Lowerer, args: tuple, kwargs: dict | None = None) -> bool:
    """A view (or expand) whose first dim stays the rows' (an expand to as
    many dims as its input)."""
    rows = value_of(lw, args[0])
    if not isinstance(rows, Rows):
        return False
    size = list(args[1]) if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
    return bool(size) and int(size[0]) in (len(rows.index), -1) and \
        all(isinstance(n, int) and n >= 0 for n in size[1:])


def _expand_keeps_rows(lw: Lowerer, args: tuple, kwargs: dict | None = None) -> bool:
    rows = value_of(lw, args[0])
    return _view_keeps_rows(lw, args) and len(args[1]) == len(lw.shapes[rows.base])


def _slice_backward_keeps_rows(lw: Lowerer, args: tuple, kwargs: dict | None = None) -> bool:
    """``slice_backward(g, sizes, dim, ...)`` of rows along another dim."""
    rows = value_of(lw, args[0])
    sizes = list(args[1]) if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
    return isinstance(rows, Rows) and len(sizes) == len(lw.shapes[rows.base]) \
        and int(sizes[0]) == len(rows.index) and _not_rows_dim(2)(lw, args, kwargs)


def _is_comparison(x: Any) -> bool:
    from backends.torch.lowering.compose import Both
    from backends.torch.lowering.ir import Compare
    return isinstance(x, (Compare, Both))


def _always(lw: Lowerer, args: tuple, kwargs: dict | None = None) -> bool:
    return True


def _entrywise_mask(lw: Lowerer, args: tuple, kwargs: dict | None = None) -> bool:
    """A comparison, a conjunction of two or a ``where``: entry by entry,
    as ``_always``, but its result is a pending comparison (``RowsOf``),
    which only the gathered rows' rule keeps (not ``grouped_rows``'s
    element-wise rule, which materializes every result)."""
    return True


def sum_rows(base: Handler) -> Handler:
    """A sum over the rows' dim (a bias's gradient) of rows gathered at an
    index without repeats: the same sum of ``mask * base``, all rows, the
    ungathered ones zero."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        rows = value_of(lw, args[0])
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(rows, Rows) or dims is None:
            return base(lw, args, kwargs, shapes, group)
        nd = len(lw.shapes[rows.base])
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        if not dims or all(int(d) % nd != 0 for d in dims):
            return base(lw, args, kwargs, shapes, group)
        key = _TEMP + lw.next_id
        lw.next_id += 1
        lw.env[key] = masked(lw, rows)
        try:
            return base(lw, [("v", key), *args[1:]], kwargs, shapes, group)
        finally:
            lw.env.pop(key, None)
    return lower


#: row-wise ops and when they keep the rows' dim
ROWWISE: dict[str, Callable[..., bool]] = {
    **{op: _always for op in (
        "aten.silu.default", "aten.mul.Tensor", "aten.mul.Scalar", "aten.add.Tensor", "aten.sub.Tensor",
        "aten.div.Tensor", "aten.neg.default", "aten._to_copy.default", "aten.silu_backward.default",
        "aten.gelu.default", "aten.gelu_backward.default", "aten.relu.default", "aten.sigmoid.default",
        "aten.tanh.default", "aten.exp.default", "aten.pow.Tensor_Scalar", "aten.div.Scalar",
        "aten.clamp.default", "aten.sigmoid_backward.default", "aten.tanh_backward.default",
        "aten.threshold_backward.default", "aten.addcmul.default")},
    **{op: _entrywise_mask for op in (
        "aten.ge.Scalar", "aten.le.Scalar", "aten.gt.Scalar", "aten.lt.Scalar",
        "aten.logical_and.default", "aten.logical_and_.default", "aten.where.self")},
    "aten.slice.Tensor": _not_rows_dim(1),
    "aten.slice_backward.default": _slice_backward_keeps_rows,
    "aten.split.Tensor": _not_rows_dim(2),
    "aten.split_with_sizes.default": _not_rows_dim(2),
    "aten.sum.dim_IntList": _not_rows_dim(1),
    "aten.cat.default": _not_rows_dim(1),
    "aten.unsqueeze.default": _not_rows_dim(1, added=1),
    "aten.squeeze.dim": _not_rows_dim(1),
    "aten.expand.default": _expand_keeps_rows,
    "aten.view.default": _view_keeps_rows,
    "aten._unsafe_view.default": _view_keeps_rows,
    "aten.reshape.default": _view_keeps_rows,
}
