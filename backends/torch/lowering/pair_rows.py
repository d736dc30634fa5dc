"""Token-space values behind (token, slot) rows: the pending values and
handler bodies the ``pair_combine`` family registers (docs/soundness.md,
"Plans traced from PyTorch", 54). A helper module: it registers
nothing.

An expert-parallel step in the style of transformers' ``AllToAllEP`` moves
one row per (token, slot) pair to the rank of the pair's expert, runs each
expert on the rows it received and sends each result back, where the pairs
are put back in (token, slot) order, weighted by their gates and summed per
token. Every such row is a row of a value of token space (one row per
token), picked at the row's token, so the rows are kept as that value with
the picks beside it:

- ``Assembled``: row r is ``values[group[r]][index[r]]`` (a zero row where
  ``group[r]`` is -1): the rows an experts loop adds into zeros
  (``index_add_``, the accumulating ``index_put`` of a backward) from rows
  of token-space values, and what an all-to-all of them receives (each
  member's values sent whole, the groups renumbered).
- ``Pairs``: row r is ``g[t] * w[t, s]`` for the pair ``p = pair[r] = t * K
  + s``: the gradient a combine's backward sends to the experts (a token's
  gradient times its gate at each slot).

Read where they are summed back per token, they are written in the
single-device experts loop's token-space form, each fact about the picks
checked on their recorded arrays (docs/soundness.md names each):

- ``sum_s A[t, s] * w[t, s]`` (the combine): for each group g in order,
  ``mask_g * (F_g[rows] * sum_s(w * P_g))``, P_g the one-hot of the pairs
  of group g, ``mask_g`` the 0/1 column of the tokens with one;
- ``sum_h A[t, s, h] * g[t, h]`` (the gates' gradient): for each group,
  ``P_g * sum_h(g * F_g[rows])``;
- ``sum over the slots of A`` at the pairs' tokens (the input's gradient):
  for each group, ``mask_g * F_g[rows]``;
- the rows of ``Pairs`` one expert received, its tokens distinct: the rows
  of ``g * sum_s(w * P)`` at those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input
from backends.torch.lowering.ir import Pending
from backends.torch.lowering.moved_rows import reread
from backends.torch.lowering.routed_rows import Rows

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True, eq=False)
class Assembled(Pending):
    """Rows (shaped ``group.shape``) each a row of one of ``values`` (token
    space values of one shape ``[N, ...]``), or zero where ``group`` is -1."""
    values: tuple[int, ...]
    group: np.ndarray
    index: np.ndarray

    def materialize(self, lw: Lowerer) -> int:
        """``sum_g S_g @ values[g]``, ``S_g`` the one-hot picks of group g."""
        rows = self.group.reshape(-1)
        index = self.index.reshape(-1)
        shape = tuple(lw.shapes[self.values[0]]) if self.values else ()
        if not self.values:
            raise LoweringError(f"{lw.name}: rows of no value read as a tensor")
        width = int(np.prod(shape[1:], dtype=np.int64))
        out = None
        for g, v in enumerate(self.values):
            select = np.zeros((len(rows), shape[0]))
            hit = np.flatnonzero(rows == g)
            select[hit, index[hit]] = 1.0
            flat = lw.reshape(v, (shape[0], width))
            part = lw.emit("embedding", [constant_input(lw, select), flat], [(len(rows), width)])[0]
            out = part if out is None else lw.emit("add", [out, part], [(len(rows), width)])[0]
        return lw.reshape(out, (*self.group.shape, *shape[1:]))


@dataclass(frozen=True, eq=False)
class Pairs(Pending):
    """Rows (shaped ``pair.shape``) ``g[p // k] * w[p // k, p % k]`` for
    ``p = pair[r]``: g ``[T, ...]``, w ``[T, k, 1, ...]``."""
    g: int
    w: int
    k: int
    pair: np.ndarray

    def materialize(self, lw: Lowerer) -> int:
        t, *rest = lw.shapes[self.g]
        wide = (t, self.k, *rest)
        spread = lw.emit("expand", [lw.reshape(self.g, (t, 1, *rest))], [wide],
                         {"shape": list(wide)})[0]
        w = self.w
        if tuple(lw.shapes[w]) != wide:
            w = lw.emit("expand", [w], [wide], {"shape": list(wide)})[0]
        scaled = lw.emit("mul", [spread, w], [wide])[0]
        flat = lw.reshape(scaled, (t * self.k, *rest))
        picked = self.pair.reshape(-1)
        whole = np.array_equal(picked, np.arange(t * self.k))
        out = flat if whole else lw.materialize(Rows(flat, picked))
        return lw.reshape(out, (*self.pair.shape, *rest))


@dataclass(frozen=True, eq=False)
class Weighted(Pending):
    """``A[t, s, ...] * w[t, s, 1...]`` of pair rows ``A`` (rows ``[T, K]``)."""
    rows: Assembled
    w: int

    def materialize(self, lw: Lowerer) -> int:
        a = lw.materialize(self.rows)
        shape = tuple(lw.shapes[a])
        w = self.w
        if tuple(lw.shapes[w]) != shape:
            w = lw.emit("expand", [w], [shape], {"shape": list(shape)})[0]
        return lw.emit("mul", [a, w], [shape])[0]


@dataclass(frozen=True, eq=False)
class Dotted(Pending):
    """``A[t, s, ...] * g[t, ...]`` of pair rows ``A`` (rows ``[T, K]``)."""
    rows: Assembled
    g: int

    def materialize(self, lw: Lowerer) -> int:
        a = lw.materialize(self.rows)
        shape = tuple(lw.shapes[a])
        t, *rest = lw.shapes[self.g]
        spread = lw.emit("expand", [lw.reshape(self.g, (t, 1, *rest))], [shape],
                         {"shape": list(shape)})[0]
        return lw.emit("mul", [a, spread], [shape])[0]


@dataclass(frozen=True, eq=False)
class Viewed(Pending):
    """The lowered value ``v`` seen with ``shape`` (one more or fewer dims
    of size 1), not yet emitted: a view back to v's own shape is v."""
    v: int
    shape: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        return lw.reshape(self.v, self.shape)


# -- facts about the picks, checked -------------------------------------------

def token_rows(lw: Lowerer, a: Assembled) -> tuple[int, int]:
    """(o, T): the pairs of token t (row t of ``a``'s ``[T, K]`` rows) all
    read row ``o + t`` of their values, and no token has one group twice."""
    group, index = a.group, a.index
    if group.ndim != 2:
        raise LoweringError(f"{lw.name}: pair rows summed per token with rows of shape "
                            f"{list(group.shape)}")
    t = group.shape[0]
    live = group >= 0
    if not live.any():
        raise LoweringError(f"{lw.name}: pair rows of no value summed per token")
    first_t, first_s = np.argwhere(live)[0]
    o = int(index[first_t, first_s]) - int(first_t)
    want = np.broadcast_to(np.arange(t)[:, None] + o, group.shape)
    if not np.array_equal(index[live], want[live]):
        raise LoweringError(f"{lw.name}: a token's pairs read rows of other tokens")
    for row in group:
        kept = row[row >= 0]
        if len(np.unique(kept)) != len(kept):
            raise LoweringError(f"{lw.name}: a token sends two slots to one expert's rows")
    n = lw.shapes[a.values[0]][0]
    if o < 0 or o + t > n:
        raise LoweringError(f"{lw.name}: pair rows beyond their values' {n} rows")
    return o, t


def own_rows(lw: Lowerer, v: int, o: int, t: int) -> int:
    """Rows ``[o, o + t)`` of v (a ``narrow``; all of them: v)."""
    shape = list(lw.shapes[v])
    if o == 0 and t == shape[0]:
        return v
    shape[0] = t
    return lw.emit("narrow", [v], [tuple(shape)], {"dim": 0, "start": o, "length": t})[0]


def _column(lw: Lowerer, column: np.ndarray, shape: tuple[int, ...]) -> int:
    """A constant ``[T, 1...]`` expanded to ``shape``."""
    c = constant_input(lw, column.reshape((shape[0],) + (1,) * (len(shape) - 1)))
    if tuple(lw.shapes[c]) == tuple(shape):
        return c
    return lw.emit("expand", [c], [tuple(shape)], {"shape": list(shape)})[0]


def _slot_pick(lw: Lowerer, w: int, onehot: np.ndarray) -> int:
    """``sum_s(w * P)`` ``[T, 1...]`` of w ``[T, K, 1...]``."""
    shape = tuple(lw.shapes[w])
    p = constant_input(lw, onehot.reshape(shape[:2] + (1,) * (len(shape) - 2)))
    if tuple(lw.shapes[p]) != shape:
        p = lw.emit("expand", [p], [shape], {"shape": list(shape)})[0]
    picked = lw.emit("mul", [w, p], [shape])[0]
    return lw.emit("sum", [picked], [(shape[0], *shape[2:])], {"dim": 1, "keepdim": False})[0]


def _add_all(lw: Lowerer, parts: list[int], shape: tuple[int, ...]) -> int:
    out = parts[0]
    for p in parts[1:]:
        out = lw.emit("add", [out, p], [shape])[0]
    return out


def combine(lw: Lowerer, x: Weighted, out_shape: tuple[int, ...]) -> int:
    """``sum_s A[t, s] * w[t, s]``: the single-device loop's token-space sum."""
    a = x.rows
    o, t = token_rows(lw, a)
    parts = []
    for g, v in enumerate(a.values):
        hit = a.group == g  # no pair of these tokens reads g: its term is zero here
        f = own_rows(lw, v, o, t)
        shape = tuple(lw.shapes[f])
        s = _slot_pick(lw, x.w, hit.astype(np.float64))
        prod = lw.emit("mul", [f, s], [shape])[0]
        mask = _column(lw, hit.any(1).astype(np.float64), shape)
        parts.append(lw.emit("mul", [prod, mask], [shape])[0])
    if not parts:
        raise LoweringError(f"{lw.name}: a combine of no expert's rows")
    out = _add_all(lw, parts, tuple(lw.shapes[parts[0]]))
    if tuple(lw.shapes[out]) != tuple(out_shape):
        out = lw.reshape(out, tuple(out_shape))
    return out


def gate_grad(lw: Lowerer, x: Dotted, out_shape: tuple[int, ...]) -> int:
    """``sum_h A[t, s, h] * g[t, h]`` (keepdim): each group's ``sum_h(g *
    F_g[rows])`` placed at its pairs, ``[T, K]`` each, added."""
    a = x.rows
    o, t = token_rows(lw, a)
    k = a.group.shape[1]
    parts = []
    for g, v in enumerate(a.values):
        hit = a.group == g  # no pair of these tokens reads g: its term is zero here
        f = own_rows(lw, v, o, t)
        shape = tuple(lw.shapes[f])
        prod = lw.emit("mul", [x.g, f], [shape])[0]
        summed = lw.emit("sum", [prod], [(shape[0], 1)], {"dim": 1, "keepdim": True})[0]
        spread = lw.emit("expand", [lw.reshape(summed, (t, 1, 1))], [(t, k, 1)],
                         {"shape": [t, k, 1]})[0]
        p = constant_input(lw, hit.astype(np.float64).reshape(t, k, 1))
        placed = lw.emit("mul", [spread, p], [(t, k, 1)])[0]
        parts.append(lw.reshape(placed, (t, k)))
    if not parts:
        raise LoweringError(f"{lw.name}: a gate gradient of no expert's rows")
    out = _add_all(lw, parts, (t, k))
    return out if tuple(out_shape) == (t, k) else Viewed(out, tuple(out_shape))


def gathered_back(lw: Lowerer, a: Assembled, tokens: np.ndarray, shape: tuple[int, ...]) -> int:
    """Rows of ``a`` added into zeros of ``shape`` at ``tokens`` (row r to
    token ``tokens[r]``): each group's ``mask_g * F_g[rows]``, added."""
    group, index = a.group.reshape(-1), a.index.reshape(-1)
    if len(tokens) != len(group):
        raise LoweringError(f"{lw.name}: {len(group)} rows added at {len(tokens)} rows")
    t = shape[0]
    tokens = np.where(tokens < 0, tokens + t, tokens)
    live = group >= 0
    if not live.any():
        raise LoweringError(f"{lw.name}: rows of no value added back")
    if tokens[live].min() < 0 or tokens[live].max() >= t:
        raise LoweringError(f"{lw.name}: rows added beyond the {t} rows")
    o = int(index[live][0] - tokens[live][0])
    if not np.array_equal(index[live], tokens[live] + o):
        return _moved_back(lw, a, tokens, live, shape)
    parts = []
    for g, v in enumerate(a.values):
        hit = live & (group == g)
        f = own_rows(lw, v, o, t)
        count = np.bincount(tokens[hit], minlength=t).astype(np.float64)
        parts.append(lw.emit("mul", [f, _column(lw, count, tuple(lw.shapes[f]))],
                             [tuple(lw.shapes[f])])[0])
    return _add_all(lw, parts, tuple(shape))


def _moved_back(lw: Lowerer, a: Assembled, tokens: np.ndarray, live: np.ndarray,
                shape: tuple[int, ...]) -> int:
    """``gathered_back`` where rows are added back at other tokens than the
    rows they hold (a gate picked at a permuted index, its gradient put
    back at the pairs' own): for each value, its rows moved by a
    permutation of their own (``moved_rows.reread``: a lookup by a one-hot
    constant of the rank's own, standing in for the value) so that the row
    added at token ``tokens[r]`` is the row it holds, then masked to the
    tokens that receive one. Exact (index_put's definition) when no token
    receives two rows of one value and no row of a value is added twice;
    refused in one line otherwise (docs/soundness.md, "Plans traced from
    PyTorch", 124)."""
    group, index = a.group.reshape(-1), a.index.reshape(-1)
    t = shape[0]
    parts = []
    for g, v in enumerate(a.values):
        hit = live & (group == g)
        if not hit.any():
            continue
        at, held = tokens[hit], index[hit]
        moved = None
        if lw.shapes[v][0] == t and len(np.unique(at)) == len(at):
            moved = reread(lw, v, held, at)
        if moved is None:
            raise LoweringError(f"{lw.name}: rows added back at other tokens than they hold "
                                f"(rank {lw.trace.get('rank', 0)})")
        mask = np.zeros(t)
        mask[at] = 1.0
        parts.append(lw.emit("mul", [moved, _column(lw, mask, tuple(lw.shapes[moved]))],
                             [tuple(lw.shapes[moved])])[0])
    lw.rows_moved = True
    return _add_all(lw, parts, tuple(shape))


def expert_rows(lw: Lowerer, p: Pairs, at: np.ndarray) -> Rows:
    """Rows ``at`` of ``p`` when their tokens are distinct: the rows of ``g *
    sum_s(w * P)`` at the tokens, P the one-hot of their pairs."""
    pairs = p.pair.reshape(-1)[at]
    tokens = pairs // p.k
    if len(np.unique(tokens)) != len(tokens):
        raise LoweringError(f"{lw.name}: rows of one token twice picked from pair rows")
    t = lw.shapes[p.g][0]
    onehot = np.zeros((t, p.k))
    onehot[tokens, pairs % p.k] = 1.0
    s = _slot_pick(lw, p.w, onehot)
    shape = tuple(lw.shapes[p.g])
    return Rows(lw.emit("mul", [p.g, s], [shape])[0], tokens)


def add_assembled(lw: Lowerer, a: Assembled, b: Assembled) -> Assembled:
    """Two pair-row values written at disjoint rows, added: their union."""
    if a.group.shape != b.group.shape:
        raise LoweringError(f"{lw.name}: pair rows of other shapes added")
    if np.any((a.group >= 0) & (b.group >= 0)):
        raise LoweringError(f"{lw.name}: pair rows written twice at one row")
    shift = len(a.values)
    group = np.where(b.group >= 0, b.group + shift, a.group)
    index = np.where(b.group >= 0, b.index, a.index)
    return Assembled(a.values + b.values, group, index)


def written(lw: Lowerer, dest: Any, at: np.ndarray, src: Rows, rows: int) -> Assembled:
    """``dest`` (zeros of ``rows`` rows, or pair rows) with ``src``'s rows
    added at the distinct rows ``at``."""
    at = np.where(at < 0, at + rows, at)
    if at.ndim != 1 or len(at) != len(src.index) or len(np.unique(at)) != len(at) \
            or (len(at) and (at.min() < 0 or at.max() >= rows)):
        raise LoweringError(f"{lw.name}: rows added at a recorded index that repeats a row or "
                            f"leaves the {rows} rows")
    group = np.full(rows, -1, dtype=np.int64)
    index = np.zeros(rows, dtype=np.int64)
    group[at] = 0
    index[at] = src.index
    new = Assembled((src.base,), group, index)
    return new if dest is None else add_assembled(lw, dest, new)
