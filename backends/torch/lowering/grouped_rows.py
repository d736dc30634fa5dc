"""Grouped GEMMs on rows gathered at recorded routing: the pending values
and handler bodies the ``grouped`` family registers (docs/soundness.md,
"Plans traced from PyTorch", 36 c). A helper module: it registers nothing.

- ``x[p // C]`` for a recorded index ``p`` without repeats (each token once
  per expert it chose, sorted by expert: torchtitan's local dispatch) is
  the rows ``p`` of the C-fold copy of ``x`` (``[T * C, ...]``, row
  ``t * C + c`` a copy of row t): ``Rows`` over the copies.
- ``torch._grouped_mm(A, B, offs)`` with A such rows: row i is
  ``A[i] @ B[g(i)]``, g(i) the group whose recorded offsets hold i. Written
  as ``Experts``: every group's matrix applied to every row of the base
  (one batched ``matmul``), row i being ``Y[g(i), index[i]]``. Ops that act
  row by row act on all of ``Y``; a second grouped GEMM with the same
  groups is the batched product of ``Y``; its backward for B
  (``_grouped_mm(A^T, G, offs)``: each group's rows contracted) is
  ``(M * A)^T @ G`` batched, ``M[g]`` the 0/1 column of group g's rows.
- the rows added back at their token (``scatter_add``, torchtitan's
  ``deterministic_scatter_add``, the accumulating ``index_put`` of the
  gather's backward) at ``p // C``: ``sum_g M[g] * Y[g]`` over the copies'
  rows, then summed over the C copies of each token.

Every fact used is checked on the recorded arrays (no repeated pair, rows
within the offsets, a token index that is the pair index divided by C);
anything else is refused (exit 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.ir import NewZeros, Pending, Zeros
from backends.torch.lowering.moved_rows import reread
from backends.torch.lowering.routed_rows import Rows, RowsT, is_zeros, value_of
from backends.torch.lowering.routed_rowwise import ROWWISE, tensor_refs
from backends.torch.lowering.stand_ins import standing_in

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

Handler = Callable[..., Any]

#: ops that give a constant another shape (followed back to a division)
_SHAPES = frozenset({"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                     "aten.expand.default", "aten.unsqueeze.default"})


@dataclass(frozen=True, eq=False)
class Experts(Pending):
    """Row i is ``y[group[i], index[i]]``: ``y`` ``[G, N, ...]`` holds
    every group's result for every row of a base of N rows."""
    y: int
    group: np.ndarray
    index: np.ndarray

    def materialize(self, lw: Lowerer) -> int:
        rows = as_gathered(lw, self)
        return rows if isinstance(rows, int) else lw.materialize(rows)


def as_gathered(lw: Lowerer, e: Experts) -> Rows | int:
    """Each row's own group's result (``collapse``) at e's rows; every row
    of the base in its order (grouped rows put back where they were
    computed) is that result itself, no rows picked."""
    dense = collapse(lw, e)
    if np.array_equal(e.index, np.arange(lw.shapes[e.y][1])):
        return dense
    return Rows(dense, e.index)


def producer(lw: Lowerer, v: int) -> tuple | None:
    """The recorded event that made value v (None: an input of the trace)."""
    producers = lw.grouped_producers
    if producers is None:
        producers = {o: i for i, ev in enumerate(lw.trace["events"]) for o in ev[2]}
        lw.grouped_producers = producers
    i = producers.get(v)
    return None if i is None else lw.trace["events"][i]


def copies_of(lw: Lowerer, a: Any) -> tuple[np.ndarray, int] | None:
    """(p, C) when the recorded index ``a`` is ``p // C`` (seen through
    views and expands) with p a recorded index without repeats."""
    v = a[1] if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" else None
    for _ in range(8):
        if v is None:
            return None
        ev = producer(lw, v)
        if ev is None:
            return None
        op, (args, _kw) = ev[0], ev[1]
        if op in _SHAPES:
            v = args[0][1] if isinstance(args[0], (list, tuple)) else None
            continue
        if op not in ("aten.floor_divide.default", "aten.div.Tensor_mode"):
            return _numbered_copies(lw, v)
        p = constant_value(lw, args[0])
        c = args[1] if isinstance(args[1], int) else lw.const(args[1])
        if p is None or c is None or p.ndim != 1 or int(c) != c or c < 1:
            return None
        p = p.astype(np.int64)
        if len(np.unique(p)) != len(p) or (len(p) and p.min() < 0):
            return None
        return p, int(c)
    return None


def _numbered_copies(lw: Lowerer, v: int) -> tuple[np.ndarray, int] | None:
    """(p, C) for a recorded one-dim index ``idx`` that repeats a row (each
    token once per expert it chose, in the routing map's order: Megatron's
    permutation): C the most times a row occurs, and p[i] = idx[i] * C +
    (how many times idx[i] occurred before i), so that p has no repeats and
    ``p // C == idx`` (docs/soundness.md, "Plans traced from PyTorch", 47 b).
    The numbering is a function of idx alone: the same index read again
    (the backward's scatter) gets the same p."""
    if v not in lw.trace.get("constants", ()):
        return None
    idx = lw.trace.get("constvals", {}).get(v)
    if idx is None or np.asarray(idx).ndim != 1 or np.asarray(idx).dtype.kind not in "iu":
        return None
    idx = np.asarray(idx).astype(np.int64)
    if len(idx) == 0 or idx.min() < 0 or len(np.unique(idx)) == len(idx):
        return None
    seen: dict[int, int] = {}
    occurrence = np.empty_like(idx)
    for i, t in enumerate(idx.tolist()):
        occurrence[i] = seen.get(t, 0)
        seen[t] = occurrence[i] + 1
    c = int(max(seen.values()))
    return idx * c + occurrence, c


def index_select(base: Handler) -> Handler:
    """``x.index_select(0, idx)`` at a recorded index that repeats rows: the
    rows p of x's C-fold copy (``_numbered_copies``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if int(args[1]) != 0 or not isinstance(value_of(lw, args[0]), int):
            return base(lw, args, kwargs, shapes, group)
        found = copies_of(lw, args[2])
        if found is None or found[1] == 1:
            return base(lw, args, kwargs, shapes, group)
        p, c = found
        x = lw.val(args[0])
        _check_copies(lw, p, c, lw.shapes[x][0])
        return Rows(copied(lw, x, c), p)
    return lower


def copied(lw: Lowerer, x: int, c: int) -> int:
    """x's rows, each repeated c times in place (``[T * c, ...]``), once per
    value and count."""
    memo = lw.grouped_copies
    if (x, c) not in memo:
        shape = tuple(lw.shapes[x])
        wide = (shape[0], c, *shape[1:])
        spread = lw.emit("expand", [lw.reshape(x, (shape[0], 1, *shape[1:]))], [wide],
                         {"shape": list(wide)})[0]
        memo[(x, c)] = lw.reshape(spread, (shape[0] * c, *shape[1:]))
    return memo[(x, c)]


def _check_copies(lw: Lowerer, p: np.ndarray, c: int, rows: int) -> None:
    if len(p) and p.max() >= rows * c:
        raise LoweringError(f"{lw.name}: a pair index beyond {rows} rows of {c} copies")


def _groups(lw: Lowerer, offs: np.ndarray, n: int) -> np.ndarray:
    ends = offs.astype(np.int64)
    if len(ends) == 0 or np.any(np.diff(ends) < 0) or ends[-1] != n:
        raise LoweringError(f"{lw.name}: a grouped GEMM whose offsets do not end at its {n} rows")
    return np.searchsorted(ends, np.arange(n), side="right")


def group_mask(lw: Lowerer, e: Experts, shape: tuple[int, ...]) -> int:
    """The 0/1 ``[G, N, 1, ...]`` of each group's rows, expanded to shape."""
    mask = np.zeros((shape[0], shape[1]) + (1,) * (len(shape) - 2))
    mask[e.group, e.index] = 1.0
    m = constant_input(lw, mask)
    if tuple(mask.shape) == tuple(shape):
        return m
    return lw.emit("expand", [m], [shape], {"shape": list(shape)})[0]


def collapse(lw: Lowerer, e: Experts) -> int:
    """``sum_g M[g] * y[g]``: each row's own group's result, on the base."""
    shape = tuple(lw.shapes[e.y])
    if len(np.unique(e.index)) != len(e.index):
        raise LoweringError(f"{lw.name}: grouped rows that repeat a row of their base")
    kept = lw.emit("mul", [e.y, group_mask(lw, e, shape)], [shape])[0]
    return lw.emit("sum", [kept], [shape[1:]], {"dim": 0, "keepdim": False})[0]


def spread_rows(lw: Lowerer, base: int, groups: int) -> int:
    shape = tuple(lw.shapes[base])
    wide = (groups, *shape)
    return lw.emit("expand", [lw.reshape(base, (1, *shape))], [wide], {"shape": list(wide)})[0]


def grouped_mm(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = value_of(lw, args[0]), value_of(lw, args[1])
        offs_ref = args[2] if len(args) > 2 else kwargs.get("offs")
        offs = constant_value(lw, offs_ref) if offs_ref is not None else None
        if offs is None:
            return base(lw, args, kwargs, shapes, group)
        if isinstance(a, (Transposed, RowsT)):  # the B gradient: each group's rows contracted
            return _grouped_mm_bw(lw, a, args, offs, shapes)
        if not isinstance(a, (Rows, Experts)) or isinstance(b, (Rows, Experts, Transposed, RowsT)):
            return base(lw, args, kwargs, shapes, group)
        n = len(a.index)
        g = _groups(lw, offs, n)
        w = lw.val(args[1])
        gs, inner, out = lw.shapes[w]
        if isinstance(a, Experts):
            if not np.array_equal(a.group, g):
                raise LoweringError(f"{lw.name}: grouped GEMMs of one value with other groups")
            y = a.y
        else:
            y = spread_rows(lw, a.base, gs)
        rows = lw.shapes[y][1]
        product = lw.emit("matmul", [y, w], [(gs, rows, out)])[0]
        return Experts(product, g, a.index)
    return lower


@dataclass(frozen=True, eq=False)
class Transposed(Pending):
    """The transpose of grouped rows (a grouped GEMM's B gradient reads it)."""
    of: Any

    def materialize(self, lw: Lowerer) -> int:
        x = lw.materialize(self.of)
        n, d = lw.shapes[x]
        return lw.emit("transpose", [x], [(d, n)], {"dim0": 0, "dim1": 1})[0]


def _grouped_mm_bw(lw: Lowerer, a: Any, args, offs: np.ndarray, shapes) -> int:
    """``_grouped_mm(A^T, G, offs)``: out[g] = A[rows of g]^T @ G[rows of g]."""
    g_val = value_of(lw, args[1])
    left = a.of if isinstance(a, Transposed) else a.rows
    if not isinstance(left, (Rows, Experts)) or not isinstance(g_val, (Rows, Experts)) \
            or not np.array_equal(left.index, g_val.index):
        raise LoweringError(f"{lw.name}: a grouped GEMM's B gradient of rows gathered otherwise")
    n = len(left.index)
    g = _groups(lw, offs, n)
    gs = len(offs)
    ys = []
    for side in (left, g_val):
        if isinstance(side, Experts):
            if not np.array_equal(side.group, g):
                raise LoweringError(f"{lw.name}: a grouped GEMM's B gradient with other groups")
            ys.append(side.y)
        else:
            ys.append(spread_rows(lw, side.base, gs))
    ya, yg = ys
    shape = tuple(lw.shapes[ya])
    masked = lw.emit("mul", [ya, group_mask(lw, Experts(ya, g, left.index), shape)], [shape])[0]
    flipped = lw.emit("transpose", [masked], [(shape[0], shape[2], shape[1])], {"dim0": 1, "dim1": 2})[0]
    return lw.emit("matmul", [flipped, yg], [tuple(shapes[0])])[0]


def index(base: Handler) -> Handler:
    """``x[p // C]``: the rows p of x's C-fold copy."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        if len(indices) != 1 or indices[0] is None or not isinstance(value_of(lw, args[0]), int):
            return base(lw, args, kwargs, shapes, group)
        found = copies_of(lw, indices[0])
        value = constant_value(lw, indices[0])
        if found is None or found[1] == 1 or value is None \
                or not np.array_equal(value, found[0] // found[1]):
            return base(lw, args, kwargs, shapes, group)
        p, c = found
        x = lw.val(args[0])
        _check_copies(lw, p, c, lw.shapes[x][0])
        return Rows(copied(lw, x, c), p)
    return lower


def gather_rows(base: Handler) -> Handler:
    """``x.gather(0, (p // C)[:, None].expand(-1, D))``: the rows p of x's
    C-fold copy (a scatter_add's backward)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if int(args[1]) != 0 or not isinstance(value_of(lw, args[0]), int):
            return base(lw, args, kwargs, shapes, group)
        found = copies_of(lw, args[2])
        idx = constant_value(lw, args[2])
        if found is None or idx is None or idx.ndim != 2:
            return base(lw, args, kwargs, shapes, group)
        p, c = found
        x = lw.val(args[0])
        if idx.shape[1] != lw.shapes[x][1] or not np.all(idx == (p // c)[:, None]):
            return base(lw, args, kwargs, shapes, group)
        _check_copies(lw, p, c, lw.shapes[x][0])
        return Rows(copied(lw, x, c), p)
    return lower


def _summed_copies(lw: Lowerer, src: Any, p: np.ndarray, c: int, shape: tuple[int, ...]) -> int:
    """Rows (p's rows of a C-fold copy) added into zeros of ``shape`` at
    their token p // C; rows gathered at other copies than p
    (``_summed_elsewhere``)."""
    if not np.array_equal(src.index, p):
        return _summed_elsewhere(lw, src, p, c, shape)
    if isinstance(src, Experts):
        dense = collapse(lw, src)  # zero on the rows no group holds
    else:
        dense = src.base
        rows = lw.shapes[dense][0]
        if len(p) != rows:  # the copies no row came from: zero
            column = np.zeros((rows,) + (1,) * (len(lw.shapes[dense]) - 1))
            column[p] = 1.0
            mask = constant_input(lw, column)
            if tuple(column.shape) != tuple(lw.shapes[dense]):
                mask = lw.emit("expand", [mask], [lw.shapes[dense]], {"shape": list(lw.shapes[dense])})[0]
            dense = lw.emit("mul", [dense, mask], [lw.shapes[dense]])[0]
    if lw.shapes[dense][0] != shape[0] * c:
        raise LoweringError(f"{lw.name}: copies of {lw.shapes[dense][0]} rows added into "
                            f"{shape[0]} rows")
    split = lw.reshape(dense, (shape[0], c, *shape[1:]))
    return lw.emit("sum", [split], [shape], {"dim": 1, "keepdim": False})[0]


def _summed_elsewhere(lw: Lowerer, src: Any, p: np.ndarray, c: int,
                      shape: tuple[int, ...]) -> int:
    """Rows added back at other copies than the ones they were gathered at
    (a dispatcher that put rows out of order between the dispatch and the
    combine): row i of ``src``, the dense row ``src.index[i]``, lands at
    copy ``p[i]``. Written as the dense rows moved by a permutation of
    their own rows (``moved``: a lookup by a one-hot constant of the
    rank's own, of the dense rows' shape), a ``narrow`` to the window of
    copies the combine adds up, then the usual sum of each token's copies
    at ``p``. Exact (the op's definition); the lookup stands in for the
    dense rows, a claim refuted wherever the permutation moves a row
    (docs/soundness.md, "Plans traced from PyTorch", 103)."""
    index = np.asarray(src.index, dtype=np.int64)
    if len(np.unique(index)) != len(index):
        raise LoweringError(f"{lw.name}: rows added back at other tokens than they came from, "
                            f"some of them twice (rank {lw.trace.get('rank', 0)})")
    dense = collapse(lw, src) if isinstance(src, Experts) else src.base
    moved = reread(lw, dense, index, p, shape[0] * c)
    if moved is None:
        raise LoweringError(f"{lw.name}: rows added back at other tokens than they came from, "
                            f"{lw.shapes[dense][0]} dense rows for {shape[0] * c} copies (rank "
                            f"{lw.trace.get('rank', 0)})")
    lw.rows_moved = True
    return _summed_copies(lw, Rows(moved, p), p, c, shape)


def scatter_add(base: Handler) -> Handler:
    """``zeros.scatter_add(0, (p // C)[:, None].expand(-1, D), rows)``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        target, src = value_of(lw, args[0]), value_of(lw, args[-1])
        index_ref = args[2] if len(args) == 4 else args[1]
        if not (isinstance(target, (Zeros, NewZeros)) or is_zeros(lw, args[0])) \
                or not isinstance(src, (Rows, Experts)):
            return base(lw, args, kwargs, shapes, group)
        if len(args) == 4 and int(args[1]) != 0:
            return base(lw, args, kwargs, shapes, group)
        found = copies_of(lw, index_ref)
        value = constant_value(lw, index_ref)
        if found is None or value is None or value.ndim != 2 \
                or value.shape != (len(found[0]), shapes[0][-1]) \
                or not np.all(value == (found[0] // found[1])[:, None]):
            return base(lw, args, kwargs, shapes, group)
        return _summed_copies(lw, src, found[0], found[1], tuple(shapes[0]))
    return lower


def index_put(base: Handler) -> Handler:
    """``zeros.index_put([p // C], rows, accumulate=True)``: the backward of
    ``x[p // C]``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        target, src = value_of(lw, args[0]), value_of(lw, args[2])
        indices = args[1] if isinstance(args[1], (list, tuple)) else []
        if not isinstance(target, NewZeros) or not isinstance(src, (Rows, Experts)) or len(indices) != 1:
            return base(lw, args, kwargs, shapes, group)
        found = copies_of(lw, indices[0])
        value = constant_value(lw, indices[0])
        accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
        if found is None or found[1] == 1 or not accumulate or value is None \
                or not np.array_equal(value, found[0] // found[1]):
            return base(lw, args, kwargs, shapes, group)
        return _summed_copies(lw, src, found[0], found[1], tuple(shapes[0]))
    return lower


def index_add(base: Handler) -> Handler:
    """``t.index_add(0, p // C, rows)`` with rows the rows p of a C-fold
    copy (the backward of ``x.index_select(0, p // C)``): ``t`` plus the
    rows summed back at their token; ``t.index_add(0, p, rows)`` with
    grouped rows at p: ``t`` plus each row's own group's result on the
    base."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        src = value_of(lw, args[3]) if len(args) > 3 else None
        alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
        if not isinstance(src, (Rows, Experts)) or int(args[1]) != 0 or alpha != 1:
            return base(lw, args, kwargs, shapes, group)
        value = constant_value(lw, args[2])
        if isinstance(src, Experts) and _at_own_rows(lw, value, src, tuple(shapes[0])):
            # each row added back at the row of the base it was computed for
            # (JetMoE's attention experts put their (token, slot) rows back
            # in order): each row's own group's result on the base, zero on
            # the rows no index holds
            dense = collapse(lw, src)
            if isinstance(value_of(lw, args[0]), (Zeros, NewZeros)):
                return dense
            return lw.emit("add", [lw.val(args[0]), dense], [tuple(shapes[0])])[0]
        found = copies_of(lw, args[2])
        if found is None or found[1] == 1 or value is None \
                or not np.array_equal(value, found[0] // found[1]):
            return base(lw, args, kwargs, shapes, group)
        summed = _summed_copies(lw, src, found[0], found[1], tuple(shapes[0]))
        if isinstance(value_of(lw, args[0]), (Zeros, NewZeros)):
            return summed
        return lw.emit("add", [lw.val(args[0]), summed], [tuple(shapes[0])])[0]
    return lower


def _at_own_rows(lw: Lowerer, value: np.ndarray | None, src: Experts,
                 shape: tuple[int, ...]) -> bool:
    """The recorded index ``value`` is the grouped rows' own index into
    their base (no row divided into tokens), and ``shape`` the base's."""
    if value is None or value.ndim != 1 or value.dtype.kind not in "iu" \
            or tuple(lw.shapes[src.y][1:]) != shape:
        return False
    at = np.where(value < 0, value + shape[0], value).astype(np.int64)
    return np.array_equal(at, src.index)


def transpose(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = value_of(lw, args[0])
        dims = [int(a) for a in args[1:3]] if len(args) > 2 else [0, 1]
        if len(shapes[0]) == 2 and sorted(d % 2 for d in dims) == [0, 1]:
            if isinstance(x, Experts):
                return Transposed(x)
            if isinstance(x, Rows) and len(lw.shapes[x.base]) == 2:
                return RowsT(x)
        return base(lw, args, kwargs, shapes, group)
    return lower


def experts_rowwise(base: Handler) -> Handler:
    """A row-wise op on grouped rows (and rows gathered at the same index):
    on all of ``y`` (a row's other tensors must not vary along the rows)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        refs = tensor_refs([args, kwargs])
        pending = [value_of(lw, a) for a in refs]
        experts = [p for p in pending if isinstance(p, Experts)]
        if not experts:
            return base(lw, args, kwargs, shapes, group)
        first = experts[0]
        n = len(first.index)
        gs, rows = lw.shapes[first.y][:2]
        for p in pending:
            if isinstance(p, Experts) and not (np.array_equal(p.group, first.group)
                                               and np.array_equal(p.index, first.index)):
                return base(lw, args, kwargs, shapes, group)
            if isinstance(p, Rows) and not (np.array_equal(p.index, first.index)
                                            and lw.shapes[p.base][0] == rows):
                return base(lw, args, kwargs, shapes, group)
        out_nd = max(len(s) for s in shapes)
        for ref, p in zip(refs, pending):
            if not isinstance(p, (Rows, Experts)):
                shape = tuple(lw.trace["shapes"][ref[1]])
                if len(shape) == out_nd and shape[0] != 1:
                    return base(lw, args, kwargs, shapes, group)
        if any(s and s[0] != n for s in shapes) or lw.trace["events"][lw.event][0] not in ELEMENTWISE:
            return base(lw, args, kwargs, shapes, group)
        wide = [(gs, rows, *s[1:]) for s in shapes]
        stand_in = [p for p in pending if isinstance(p, (Rows, Experts))]
        with standing_in(lw, stand_in,
                         lambda p: p.y if isinstance(p, Experts) else spread_rows(lw, p.base, gs),
                         1 << 41) as sub:
            result = base(lw, sub(args), sub(kwargs), wide, group)
        return Experts(lw.materialize(result), first.group, first.index)
    return lower


def as_rows(base: Handler) -> Handler:
    """An op with a dim argument on grouped rows: on each row's own group's
    result (``collapse``) seen as gathered rows, which ``routed_rows``'s
    row-wise rule takes."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        refs = tensor_refs([args, kwargs])
        experts = {r[1]: value_of(lw, r) for r in refs if isinstance(value_of(lw, r), Experts)}
        if not experts:
            return base(lw, args, kwargs, shapes, group)
        saved = {v: lw.env[v] for v in experts}
        for v, e in experts.items():
            lw.env[v] = as_gathered(lw, e)
        try:
            return base(lw, args, kwargs, shapes, group)
        finally:
            lw.env.update(saved)
    return lower


#: element by element ops (no dim argument) that run on grouped rows
ELEMENTWISE = frozenset(op for op, keeps in ROWWISE.items()
                         if op.startswith("aten.") and keeps.__name__ == "_always")
