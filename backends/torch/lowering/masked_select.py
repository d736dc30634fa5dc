"""Lowering of ``masked_select`` and ``masked_scatter`` at a constant mask
(docs/soundness.md, "Plans traced from PyTorch", 47 a).

Megatron-Core's token permutation picks, in the routing map's order, the
routing probabilities of the (expert, token) pairs routed
(``probs.T.masked_select(routing_map)``); autograd's backward of it is
``masked_scatter`` of the gradient into zeros at the same mask. With the
mask a constant of the step (the routing map, computed from the recorded
routing), each is a product with a constant 0/1 matrix, by definition:

- ``masked_select(x, m)`` is the entries of x at ``m``'s true positions
  ``p_0 < p_1 < ... < p_{k-1}`` (row-major order): ``S @ vec(x)`` with
  ``S[i, p_i] = 1``;
- ``masked_scatter(t, m, src)`` is t with the entry at ``p_i`` replaced by
  ``src[i]``: ``(1 - m) * t + S^T @ src[:k]``.

Both are exact for every x, t and src. A mask that is not a constant, or
one whose shape is not the input's (a broadcast), is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.emit import narrow, put
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _mask(lw: Lowerer, a, shape: tuple[int, ...]) -> np.ndarray:
    value = constant_value(lw, a)
    if value is None:
        raise LoweringError(f"{lw.name}: a masked select or scatter at a mask that is not a "
                            f"constant of the step is not lowered")
    mask = np.asarray(value).astype(bool)
    if tuple(mask.shape) != tuple(shape):
        raise LoweringError(f"{lw.name}: a masked select or scatter whose mask {list(mask.shape)} "
                            f"is broadcast to {list(shape)} is not lowered")
    return mask


def _select(positions: np.ndarray, n: int) -> np.ndarray:
    """``S``: row i the one-hot of position ``positions[i]`` among n."""
    s = np.zeros((len(positions), n))
    s[np.arange(len(positions)), positions] = 1.0
    return s


def _columns(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """For a two-dim mask ``[A, B]`` read in row-major order: each selected
    entry's column t and its copy number (how many selected entries of
    column t come before it), and C, the most any column holds."""
    rows, cols = np.nonzero(mask)
    seen: dict[int, int] = {}
    copy = np.empty(len(cols), dtype=np.int64)
    for i, t in enumerate(cols.tolist()):
        copy[i] = seen.get(t, 0)
        seen[t] = int(copy[i]) + 1
    return cols.astype(np.int64), copy, max(seen.values(), default=1)


def _pick_matrix(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``OH[t, c, a] = 1`` where the c-th selected entry of column t is in
    row a; the selected entries' rows of the C-fold copy (``t * C + c``)."""
    a_of = np.nonzero(mask)[0]
    cols, copy, c = _columns(mask)
    onehot = np.zeros((mask.shape[1], c, mask.shape[0]))
    onehot[cols, copy, a_of] = 1.0
    return onehot, cols * c + copy, c


@lowers("aten.masked_select.default")
def masked_select(lw: Lowerer, args, kwargs, shapes, group):
    """Of a two-dim x (``probs.T`` at the routing map): rows of the copies
    of x's columns, ``Q[t * C + c] = x[a, t]`` for the c-th selected entry
    a of column t, so that the result lines up, row for row, with the
    tokens' rows an index repeating each token reads (``grouped_rows``:
    the same numbering). Otherwise ``S @ vec(x)``."""
    from backends.torch.lowering.routed_rows import Rows
    x = lw.val(args[0])
    shape = tuple(lw.shapes[x])
    mask = _mask(lw, args[1], shape)
    positions = np.flatnonzero(mask)
    if len(shape) == 2 and len(positions):
        onehot, index, c = _pick_matrix(mask)
        a, b = shape
        xt = lw.emit("transpose", [x], [(b, a)], {"dim0": 0, "dim1": 1})[0]
        wide = (b, c, a)
        spread = lw.emit("expand", [lw.reshape(xt, (b, 1, a))], [wide], {"shape": list(wide)})[0]
        picked = lw.emit("mul", [spread, constant_input(lw, onehot)], [wide])[0]
        q = lw.emit("sum", [picked], [(b, c)], {"dim": 2, "keepdim": False})[0]
        return Rows(lw.reshape(q, (b * c,)), index)
    n = int(np.prod(shape, dtype=np.int64))
    flat = lw.reshape(x, (n, 1))
    out = lw.emit("embedding", [constant_input(lw, _select(positions, n)), flat],
                  [(len(positions), 1)])[0]
    return lw.reshape(out, (len(positions),))


@lowers("aten.masked_scatter.default")
def masked_scatter(lw: Lowerer, args, kwargs, shapes, group):
    t = lw.val(args[0])
    shape = tuple(lw.shapes[t])
    mask = _mask(lw, args[1], shape)
    positions = np.flatnonzero(mask)
    k = len(positions)
    from backends.torch.lowering.grouped_rows import Experts, collapse
    from backends.torch.lowering.routed_rows import Rows, masked, reread_at
    rows = lw.env.get(args[2][1])
    if isinstance(rows, Experts) and len(lw.shapes[rows.y]) == 2:
        # each row's own group's value (the experts' gradients of the
        # routing probabilities), on the base
        rows = Rows(collapse(lw, rows), rows.index)
    if isinstance(rows, Rows) and len(shape) == 2 and k and len(lw.shapes[rows.base]) == 1:
        onehot, index, c = _pick_matrix(mask)
        a, b = shape
        if lw.rows_moved:  # rows added back out of order: read at the pick's index
            rows = reread_at(lw, args[2], rows, index, b * c)
        if np.array_equal(rows.index, index) and lw.shapes[rows.base][0] == b * c:
            # the copies' rows put back at their entries: the pick's transpose
            q = lw.reshape(masked(lw, rows), (b, c, 1))
            wide = (b, c, a)
            spread = lw.emit("expand", [q], [wide], {"shape": list(wide)})[0]
            placed = lw.emit("mul", [spread, constant_input(lw, onehot)], [wide])[0]
            summed = lw.emit("sum", [placed], [(b, a)], {"dim": 1, "keepdim": False})[0]
            placed = lw.emit("transpose", [summed], [(a, b)], {"dim0": 0, "dim1": 1})[0]
            kept = lw.emit("mul", [t, constant_input(lw, (~mask).astype(np.float64))], [shape])[0]
            return lw.emit("add", [kept, placed], [shape])[0]
    src = lw.val(args[2])
    count = int(np.prod(lw.shapes[src], dtype=np.int64))
    if count < k:
        raise LoweringError(f"{lw.name}: masked_scatter of {count} values at {k} positions")
    if not k:
        return t
    n = int(np.prod(shape, dtype=np.int64))
    values = narrow(lw, lw.reshape(src, (count, 1)), 0, 0, k)
    placed = lw.emit("embedding", [constant_input(lw, _select(positions, n).T), values],
                     [(n, 1)])[0]
    placed = lw.reshape(placed, shape)
    kept = lw.emit("mul", [t, constant_input(lw, (~mask).astype(np.float64))], [shape])[0]
    return lw.emit("add", [kept, placed], [shape])[0]


@lowers("aten.scatter_add_.default")
def scatter_add_rows(lw: Lowerer, args, kwargs, shapes, group):
    """``zeros.scatter_add_(0, idx[:, None].expand(-1, D), src)`` at a
    constant index (Megatron's unpermutation, each token's rows summed back
    at the token): ``S^T @ src`` with ``S[i, idx[i]] = 1``, repeats adding
    (docs/soundness.md, "Plans traced from PyTorch", 47 a)."""
    from backends.torch.lowering.routed_rows import is_zeros
    index = constant_value(lw, args[2])
    sizes = tuple(shapes[0])
    if not is_zeros(lw, args[0]) or index is None or int(args[1]) != 0 or index.ndim != 2 \
            or len(sizes) != 2 or index.shape[1] != sizes[1] \
            or not np.all(index == index[:, :1]):
        raise LoweringError(f"{lw.name}: scatter_add_ other than rows added into zeros at a "
                            f"constant row index is not lowered")
    rows = index[:, 0].astype(np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= sizes[0]):
        raise LoweringError(f"{lw.name}: scatter_add_ at a row outside the {sizes[0]} rows")
    src = lw.val(args[3])
    if tuple(lw.shapes[src]) != (len(rows), sizes[1]):
        raise LoweringError(f"{lw.name}: scatter_add_ of rows {list(lw.shapes[src])} at "
                            f"{len(rows)} indices")
    return lw.emit("embedding", [constant_input(lw, _select(rows, sizes[0]).T), src],
                   [sizes])[0]


def _index_add_along(lw: Lowerer, args, sizes: tuple[int, ...], dim: int,
                     index: np.ndarray) -> int:
    """``t.index_add(dim, idx, src)`` along a dim other than 0 (the backward
    of ``index_select`` there, XLNet's relative shift): each slice i of src
    along dim put among zeros at slice ``idx[i]`` (the ``narrow`` rule's
    backward), the puts and t added."""
    from backends.torch.lowering.routed_rows import is_zeros
    if len(index) and (index.min() < -sizes[dim] or index.max() >= sizes[dim]):
        raise LoweringError(f"{lw.name}: index_add at an index outside a dim of size {sizes[dim]}")
    src = lw.val(args[3])
    if lw.shapes[src] != (*sizes[:dim], len(index), *sizes[dim + 1:]):
        raise LoweringError(f"{lw.name}: index_add of {list(lw.shapes[src])} at {len(index)} "
                            f"indices along dim {dim} of {list(sizes)}")
    added = put(lw, src, dim, [int(v) for v in index % sizes[dim]], sizes[dim])
    if added is None:
        raise LoweringError(f"{lw.name}: index_add at an empty index is not lowered")
    if is_zeros(lw, args[0]):
        return added
    return lw.emit("add", [lw.val(args[0]), added], [sizes])[0]


@lowers("aten.index_add.default", "aten.index_add_.default")
def index_add_rows(lw: Lowerer, args, kwargs, shapes, group):
    """``t.index_add(0, idx, src)`` at a constant index (the backward of
    ``index_select`` at an index that repeats rows): ``t + S^T @ src``,
    repeats adding."""
    index = constant_value(lw, args[2])
    alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
    sizes = tuple(shapes[0])
    if index is None or index.dtype.kind not in "iu" or index.ndim > 1 or alpha != 1:
        raise LoweringError(f"{lw.name}: index_add other than at a constant index (alpha 1) "
                            f"is not lowered")
    dim = int(args[1]) % max(len(sizes), 1)
    if dim != 0:
        return _index_add_along(lw, args, sizes, dim, index.reshape(-1).astype(np.int64))
    rows = index.astype(np.int64) % sizes[0]
    rest = int(np.prod(sizes[1:], dtype=np.int64))
    src = lw.reshape(lw.val(args[3]), (len(rows), rest))
    added = lw.emit("embedding", [constant_input(lw, _select(rows, sizes[0]).T), src],
                    [(sizes[0], rest)])[0]
    added = lw.reshape(added, sizes)
    from backends.torch.lowering.routed_rows import is_zeros
    if is_zeros(lw, args[0]):
        return added
    return lw.emit("add", [lw.val(args[0]), added], [sizes])[0]
