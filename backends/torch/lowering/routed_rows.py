"""Rows at recorded routing: the pending values and handler bodies the
``routing`` family registers (docs/soundness.md, "Plans traced from
PyTorch", 36). A helper module: it registers nothing.

The routing (``topk``'s indices) and everything computed from it alone are
constants of the step (``routing.py``). What remains is lowered here, each
op given its meaning once:

- ``topk``'s values: ``sum(x[..., None, :] * R, -1)`` with ``R`` the
  one-hot rows of the recorded indices; its backward kernel (the values'
  gradient placed at the indices) ``sum(g[..., None] * R, -2)``.
- rows gathered at a recorded index (``x[idx]``, ``index_select``) are a
  pending ``Rows``: all rows of ``x`` with the index beside them. An op
  that acts row by row on such values with one index acts on all rows;
  adding them back at the same rows (``index_add_``, the accumulating
  ``index_put`` of a backward) is ``mask * rows`` with ``mask`` the 0/1
  column of the gathered rows; a product contracting two of them
  (``a^T @ b``, a weight gradient) is ``(mask * a)^T @ b``.
- a value picked at (row, slot) pairs of distinct rows
  (``w[token_idx, slot]``) is ``sum(w * P, 1)`` at the rows, with ``P`` the
  one-hot of the slots; its backward ``P * g``.

Every fact these rules use about a recorded index is checked on its values
(an index with a repeated row, an add at other rows than were gathered, is
refused, exit 2). The constants are plan inputs named by their value; the
verifier proves each stage for every value of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.context import LNode
from backends.torch.lowering.ir import Const, NewZeros, Pending, Zeros
from backends.torch.lowering.moved_rows import reread

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]

@dataclass(frozen=True, eq=False)
class Rows(Pending):
    """Rows ``index`` of the lowered value ``base`` (``[N, ...]``; the
    recorded tensor is ``base[index]``), the index without repeats."""
    base: int
    index: np.ndarray

    def materialize(self, lw: Lowerer) -> int:
        """The rows themselves: the one-hot rows of the index times the base."""
        shape = lw.shapes[self.base]
        flat = lw.reshape(self.base, (shape[0], int(np.prod(shape[1:], dtype=np.int64))))
        select = np.zeros((len(self.index), shape[0]))
        select[np.arange(len(self.index)), self.index] = 1.0
        out = lw.emit("embedding", [constant_input(lw, select), flat],
                      [(len(self.index), lw.shapes[flat][1])])[0]
        return lw.reshape(out, (len(self.index), *shape[1:]))


@dataclass(frozen=True, eq=False)
class RowsT(Pending):
    """The transpose of a two-dim ``Rows`` (a weight gradient's operand)."""
    rows: Rows

    def materialize(self, lw: Lowerer) -> int:
        x = lw.materialize(self.rows)
        n, d = lw.shapes[x]
        return lw.emit("transpose", [x], [(d, n)], {"dim0": 0, "dim1": 1})[0]


def value_of(lw: Lowerer, a: Any) -> Any:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" and isinstance(a[1], int):
        return lw.env.get(a[1])
    return None


def index_of(lw: Lowerer, a: Any) -> np.ndarray | None:
    """A recorded integer index (a constant of the step), or None."""
    if not isinstance(value_of(lw, a), Const):
        return None
    value = constant_value(lw, a)
    if value is None or value.dtype.kind not in "iu":
        return None
    return value.astype(np.int64)


def _distinct(lw: Lowerer, index: np.ndarray, rows: int) -> np.ndarray:
    if index.ndim != 1:
        raise LoweringError(f"{lw.name}: rows gathered at an index of {index.ndim} dims")
    index = np.where(index < 0, index + rows, index)
    if len(np.unique(index)) != len(index) or (len(index) and (index.min() < 0 or index.max() >= rows)):
        raise LoweringError(f"{lw.name}: rows gathered at a recorded index that repeats a row "
                            f"(or leaves the {rows} rows) are not lowered")
    return index


def _in_range(lw: Lowerer, index: np.ndarray, rows: int) -> np.ndarray:
    """A one-dim index into ``rows`` rows, repeats allowed (an accumulating
    write adds the rows a repeated index names: the one-hot rows' transpose
    times the values sums them)."""
    if index.ndim != 1:
        raise LoweringError(f"{lw.name}: rows put at an index of {index.ndim} dims")
    index = np.where(index < 0, index + rows, index)
    if len(index) and (index.min() < 0 or index.max() >= rows):
        raise LoweringError(f"{lw.name}: rows put at a recorded index that leaves the {rows} rows")
    return index


def _mask(lw: Lowerer, index: np.ndarray, shape: tuple[int, ...]) -> int:
    """The 0/1 column of the rows ``index`` of a ``shape`` value, expanded to it."""
    column = np.zeros((shape[0],) + (1,) * (len(shape) - 1))
    column[index] = 1.0
    mask = constant_input(lw, column)
    if tuple(column.shape) == tuple(shape):
        return mask
    return lw.emit("expand", [mask], [shape], {"shape": list(shape)})[0]


def masked(lw: Lowerer, rows: Rows) -> int:
    """``mask * base``: the gathered rows put back where they were (the
    index has no repeats), zero elsewhere. Every row gathered, the mask is
    all ones and still written: a rank whose rows all go to an expert
    then writes the node the single-device step writes for that expert
    (its mask's rows, ones there), so its term of the experts' sum is that
    node's piece (docs/soundness.md, "Plans traced from PyTorch", 121 a)."""
    shape = lw.shapes[rows.base]
    return lw.emit("mul", [rows.base, _mask(lw, rows.index, shape)], [shape])[0]


# -- topk ----------------------------------------------------------------------

def _one_hot(index: np.ndarray, classes: int) -> np.ndarray:
    out = np.zeros((*index.shape, classes))
    np.put_along_axis(out, index[..., None], 1.0, axis=-1)
    return out


def topk(lw: Lowerer, args, kwargs, shapes, group):
    """``topk(x, k, dim)`` with recorded indices: the values picked from x
    by the one-hot rows of the indices (their gradient flows to x). Scores
    masked with -inf (a group-limited router's experts outside the chosen
    groups) are read unmasked when every recorded index picks a kept
    position: topk's values are the entries at its indices, and there the
    masked scores are the scores."""
    from backends.torch.lowering.mask_values import Masked
    src = value_of(lw, args[0])
    x = src.x if isinstance(src, Masked) else lw.val(args[0])
    shape = tuple(lw.shapes[x])
    dim = (int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))) % len(shape)
    if dim != len(shape) - 1:
        raise LoweringError(f"{lw.name}: topk along a dim other than the last")
    outs = lw.trace["events"][lw.event][2]
    index = constant_value(lw, ("v", outs[1]))
    if index is None:
        raise LoweringError(f"{lw.name}: topk whose indices were not recorded as the routing")
    if isinstance(src, Masked):
        kept = np.broadcast_to(np.asarray(src.keep.value, dtype=bool), shape)
        if not np.take_along_axis(kept, index.astype(np.int64), -1).all():
            raise LoweringError(f"{lw.name}: topk picks a score masked with -inf")
    k = index.shape[-1]
    onehot = constant_input(lw, _one_hot(index.astype(np.int64), shape[-1]))
    wide = (*shape[:-1], k, shape[-1])
    spread = lw.emit("expand", [lw.reshape(x, (*shape[:-1], 1, shape[-1]))], [wide],
                     {"shape": list(wide)})[0]
    picked = lw.emit("mul", [spread, onehot], [wide])[0]
    values = lw.emit("sum", [picked], [tuple(shapes[0])], {"dim": len(wide) - 1, "keepdim": False})[0]
    return [values, Const(outs[1], lw.event)]


def gather(base: Handler) -> Handler:
    """``x.gather(-1, idx)`` at a recorded index (a router's scores at the
    experts it chose): ``sum(x[..., None, :] * R, -1)``, as topk's values."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        idx = index_of(lw, args[2])
        if idx is None or isinstance(value_of(lw, args[0]), (Rows, RowsT, Const)):
            return base(lw, args, kwargs, shapes, group)
        x = lw.val(args[0])
        shape = tuple(lw.shapes[x])
        dim = int(args[1]) % len(shape)
        if dim != len(shape) - 1 or idx.shape[:-1] != shape[:-1]:
            return base(lw, args, kwargs, shapes, group)
        k = idx.shape[-1]
        wide = (*shape[:-1], k, shape[-1])
        onehot = constant_input(lw, _one_hot(idx, shape[-1]))
        spread = lw.emit("expand", [lw.reshape(x, (*shape[:-1], 1, shape[-1]))], [wide],
                         {"shape": list(wide)})[0]
        picked = lw.emit("mul", [spread, onehot], [wide])[0]
        return lw.emit("sum", [picked], [tuple(shapes[0])], {"dim": len(wide) - 1, "keepdim": False})[0]
    return lower


def value_selecting_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``value_selecting_reduction_backward(g, dim, indices, sizes, keepdim)``:
    g placed at the recorded indices, zero elsewhere."""
    g = lw.val(args[0])
    sizes = tuple(int(s) for s in args[3])
    dim = int(args[1]) % len(sizes)
    index = index_of(lw, args[2])
    if index is None or dim != len(sizes) - 1 or (len(args) > 4 and not args[4]):
        raise LoweringError(f"{lw.name}: a value-selecting backward other than topk's along "
                            f"the last dim at recorded indices")
    k = index.shape[-1]
    wide = (*sizes[:-1], k, sizes[-1])
    onehot = constant_input(lw, _one_hot(index, sizes[-1]))
    spread = lw.emit("expand", [lw.reshape(g, (*sizes[:-1], k, 1))], [wide], {"shape": list(wide)})[0]
    placed = lw.emit("mul", [spread, onehot], [wide])[0]
    return lw.emit("sum", [placed], [sizes], {"dim": len(wide) - 2, "keepdim": False})[0]


def is_zeros(lw: Lowerer, a: Any) -> bool:
    x = value_of(lw, a)
    if isinstance(x, (Zeros, NewZeros)):
        return True
    of = getattr(x, "of", None)  # a piece of a lowered value (DTensor's chunk of a gradient)
    if isinstance(of, int) and hasattr(x, "parts"):
        made = next((n for n in reversed(lw.nodes) if of in n.outs), None)
        if made is not None and made.op == "zeros" and not made.ins:
            return True  # a piece of zeros is zeros
    value = constant_value(lw, a) if isinstance(x, Const) else None
    return value is not None and not np.any(value)


def op_of(lw: Lowerer) -> str:
    """The op of the event being lowered."""
    return lw.trace["events"][lw.event][0] if lw.event is not None and lw.event >= 0 else ""


def scatter(base: Handler) -> Handler:
    """``zeros.scatter(-1, indices, g)`` at recorded indices without repeats
    along the dim (topk's backward on the CPU): ``sum(g[..., None] * R, -2)``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        idx = index_of(lw, args[2])
        if idx is None or not is_zeros(lw, args[0]):
            return base(lw, args, kwargs, shapes, group)
        sizes = tuple(shapes[0])
        dim = int(args[1]) % len(sizes)
        if dim != len(sizes) - 1 or idx.shape[:-1] != sizes[:-1] \
                or any(len(np.unique(row)) != len(row) for row in idx.reshape(-1, idx.shape[-1])):
            if op_of(lw) != "aten.scatter.src":  # a scatter_add (or torchtitan's): others' rules
                return base(lw, args, kwargs, shapes, group)  # at a constant index (const_index)
            if dim != len(sizes) - 1 or idx.shape[:-1] != sizes[:-1]:
                raise LoweringError(f"{lw.name}: scatter at recorded indices other than along "
                                    f"the last dim")
            raise LoweringError(f"{lw.name}: scatter at recorded indices that repeat along the dim")
        k = idx.shape[-1]
        wide = (*sizes[:-1], k, sizes[-1])
        onehot = constant_input(lw, _one_hot(idx, sizes[-1]))
        g = lw.val(args[3])
        spread = lw.emit("expand", [lw.reshape(g, (*sizes[:-1], k, 1))], [wide], {"shape": list(wide)})[0]
        placed = lw.emit("mul", [spread, onehot], [wide])[0]
        return lw.emit("sum", [placed], [sizes], {"dim": len(wide) - 2, "keepdim": False})[0]
    return lower


# -- gathered rows -------------------------------------------------------------

def _pair_pick(lw: Lowerer, x: int, rows: np.ndarray, slots: np.ndarray) -> Rows:
    """``x[rows, slots]`` for distinct rows: ``sum(x * P, 1)`` at ``rows``."""
    shape = tuple(lw.shapes[x])
    rows = _distinct(lw, rows, shape[0])
    onehot = np.zeros(shape[:2] + (1,) * (len(shape) - 2))
    onehot[rows, slots] = 1.0
    p = constant_input(lw, onehot)
    if tuple(onehot.shape) != shape:
        p = lw.emit("expand", [p], [shape], {"shape": list(shape)})[0]
    picked = lw.emit("mul", [x, p], [shape])[0]
    summed = lw.emit("sum", [picked], [(shape[0], *shape[2:])], {"dim": 1, "keepdim": False})[0]
    return Rows(summed, rows)


#: ops that only give their input another shape
_VIEWS = frozenset({"aten.unsqueeze.default", "aten.view.default", "aten.reshape.default",
                    "aten._unsafe_view.default", "aten.squeeze.dim"})


def _seen_as(lw: Lowerer, a: Any) -> int:
    """A value read through a view op (``w.unsqueeze(-1)`` written again
    for each expert): the viewed value, reshaped once per shape, so that
    every expert's pick reads one node (on one device and on a rank)."""
    producers = lw.routing_producers
    if producers is None:
        producers = {v: i for i, ev in enumerate(lw.trace["events"]) for v in ev[2]}
        lw.routing_producers = producers
    i = producers.get(a[1])
    shape = tuple(lw.trace["shapes"][a[1]])
    if i is None or lw.trace["events"][i][0] not in _VIEWS:
        return lw.val(a)
    src = lw.trace["events"][i][1][0][0]
    if not isinstance(value_of(lw, src), int):
        return lw.val(a)
    x = lw.val(src)
    key = (x, shape)
    if key not in lw.routing_views:
        lw.routing_views[key] = lw.reshape(x, shape)
    return lw.routing_views[key]


def index(base: Handler) -> Handler:
    """``x[idx]`` and ``x[rows, slots]`` at recorded indices."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        found = [index_of(lw, a) if a is not None else None for a in indices]
        if not indices or any(f is None for f in found) or isinstance(value_of(lw, args[0]), RowsT):
            return base(lw, args, kwargs, shapes, group)
        inner = value_of(lw, args[0])
        if isinstance(inner, Rows) and len(found) == 1:  # rows of rows: one index
            picked = inner.index[_distinct(lw, found[0], len(inner.index))]
            return Rows(inner.base, picked)
        if len(found) == 2 and found[0].shape == found[1].shape and found[0].ndim == 1:
            return _pair_pick(lw, _seen_as(lw, args[0]), found[0], found[1])
        x = lw.val(args[0])
        if len(found) == 1:
            return Rows(x, _distinct(lw, found[0], lw.shapes[x][0]))
        raise LoweringError(f"{lw.name}: indexing at {len(found)} recorded indices")
    return lower


def index_select(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        idx = index_of(lw, args[2])
        if idx is None or int(args[1]) != 0:
            return base(lw, args, kwargs, shapes, group)
        x = lw.val(args[0])
        return Rows(x, _distinct(lw, idx, lw.shapes[x][0]))
    return lower


def _same_rows(lw: Lowerer, at: np.ndarray, rows: Rows) -> None:
    if not np.array_equal(np.where(at < 0, at + lw.shapes[rows.base][0], at), rows.index):
        raise LoweringError(f"{lw.name}: rows added back at other rows than they were gathered "
                            f"from are not lowered")


def index_add(base: Handler) -> Handler:
    """``x.index_add_(0, idx, src)`` with src the rows idx of a value like x:
    ``x + mask * src``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        idx = index_of(lw, args[2])
        src = value_of(lw, args[3])
        if idx is None or not isinstance(src, Rows):
            return base(lw, args, kwargs, shapes, group)
        alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
        if int(args[1]) != 0 or alpha != 1:
            raise LoweringError(f"{lw.name}: index_add_ along dim {args[1]} or with alpha {alpha}")
        _same_rows(lw, idx, src)
        if tuple(shapes[0]) != tuple(lw.shapes[src.base]):
            raise LoweringError(f"{lw.name}: index_add_ of rows of a value of another shape")
        if isinstance(value_of(lw, args[0]), (Zeros, NewZeros)):  # zeros_like(x).index_add_(...)
            return masked(lw, src)
        return lw.emit("add", [lw.val(args[0]), masked(lw, src)], [tuple(shapes[0])])[0]
    return lower


def index_put(base: Handler) -> Handler:
    """``zeros.index_put([idx], rows, accumulate=True)`` (the backward of a
    gather): ``mask * rows``; at (row, slot) pairs, ``P * rows``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        target = value_of(lw, args[0])
        src = value_of(lw, args[2])
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        found = [index_of(lw, a) if a is not None else None for a in indices]
        if not isinstance(target, NewZeros) or not found or any(f is None for f in found):
            return base(lw, args, kwargs, shapes, group)
        accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
        shape = tuple(shapes[0])
        if not isinstance(src, Rows):
            if len(found) != 1:
                return base(lw, args, kwargs, shapes, group)
            at = _in_range(lw, found[0], shape[0]) if accumulate else _distinct(lw, found[0], shape[0])
            return _scatter_rows(lw, lw.val(args[2]), at, shape)
        if not accumulate and len(np.unique(found[0])) != len(found[0]):
            raise LoweringError(f"{lw.name}: index_put at repeated rows without accumulate")
        _same_rows(lw, found[0], src)
        if len(found) == 1:
            if tuple(lw.shapes[src.base]) != shape:
                raise LoweringError(f"{lw.name}: rows put into zeros of another shape")
            return masked(lw, src)
        if len(found) != 2 or tuple(lw.shapes[src.base]) != (shape[0], *shape[2:]):
            raise LoweringError(f"{lw.name}: index_put at {len(found)} recorded indices of rows "
                                f"of another shape")
        onehot = np.zeros(shape[:2] + (1,) * (len(shape) - 2))
        onehot[src.index, found[1]] = 1.0
        g = lw.reshape(src.base, (shape[0], 1, *shape[2:]))
        g = lw.emit("expand", [g], [shape], {"shape": list(shape)})[0]
        p = constant_input(lw, onehot)
        if tuple(onehot.shape) != shape:
            p = lw.emit("expand", [p], [shape], {"shape": list(shape)})[0]
        return lw.emit("mul", [g, p], [shape])[0]
    return lower


def _scatter_rows(lw: Lowerer, g: int, index: np.ndarray, shape: tuple[int, ...]) -> int:
    """Rows ``g`` put at rows ``index`` of zeros of ``shape``: the one-hot
    rows' transpose times g (the ``embedding`` rule's backward); rows put
    at one row twice are added there."""
    n = len(index)
    width = int(np.prod(shape[1:], dtype=np.int64))
    if tuple(lw.shapes[g]) != (n, *shape[1:]):
        raise LoweringError(f"{lw.name}: rows of shape {list(lw.shapes[g])} put into zeros of "
                            f"shape {list(shape)}")
    select = np.zeros((n, shape[0]))
    select[np.arange(n), index] = 1.0
    flat = lw.reshape(g, (n, width))
    out = lw.new((shape[0], width))
    lw.nodes.append(LNode("embedding", "bw", [constant_input(lw, select), -1, flat], [-1, out], {},
                          lw.name, None, lw.mb))
    return lw.reshape(out, shape)


def reread_at(lw: Lowerer, ref: Any, rows: Rows, at: np.ndarray, window: int | None = None
              ) -> Rows:
    """``rows`` read at the index ``at`` instead, on a rank that added rows
    back out of order (``Lowerer.rows_moved``): rows ``at`` of its base
    moved by a permutation (``moved_rows.reread``), the same values; the
    recorded tensor ``ref`` is bound to them for every later reader. Rows
    of another length, or of a base of another size, are left as they
    are. ``window``: the rows of the base ``at`` numbers, when fewer than
    the base's (``moved_rows.reread``)."""
    if np.array_equal(rows.index, at):
        return rows
    moved = reread(lw, rows.base, rows.index, at, window)
    if moved is None:
        return rows
    rows = Rows(moved, np.asarray(at, dtype=np.int64))
    lw.env[ref[1]] = rows
    return rows


def transpose_rows(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        if isinstance(x, Rows) and len(lw.shapes[x.base]) == 2:
            return RowsT(x)
        return base(lw, args, kwargs, shapes, group)
    return lower


def mm(base: Handler) -> Handler:
    """``a^T @ b`` of rows gathered at one index: ``(mask * a)^T @ b``;
    ``rows @ w``: row-wise."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = value_of(lw, args[0]), value_of(lw, args[1])
        if isinstance(a, RowsT) and isinstance(b, Rows) and lw.rows_moved:
            b = reread_at(lw, args[1], b, a.rows.index)
        if isinstance(a, RowsT) and isinstance(b, Rows) and np.array_equal(a.rows.index, b.index) \
                and lw.shapes[a.rows.base][0] == lw.shapes[b.base][0]:
            left = masked(lw, a.rows)
            n, d = lw.shapes[left]
            left = lw.emit("transpose", [left], [(d, n)], {"dim0": 0, "dim1": 1})[0]
            return lw.emit("matmul", [left, b.base], [tuple(shapes[0])])[0]
        if isinstance(a, Rows) and not isinstance(b, (Rows, RowsT)):
            w = lw.val(args[1])
            total = lw.shapes[a.base][0]
            return Rows(lw.emit("matmul", [a.base, w], [(total, lw.shapes[w][1])])[0], a.index)
        return base(lw, args, kwargs, shapes, group)
    return lower
