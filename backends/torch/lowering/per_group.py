"""Rows that are one per group of a grouped GEMM (docs/soundness.md, "Plans
traced from PyTorch", 104): a per-expert row read at each grouped row's own
group (torchtitan's gpt_oss adds ``b[repeat_interleave(counts)]``, its
experts' biases, to the grouped product) and the backward of that read,
rows added at a recorded index into a target of other rows than the rows'
tokens (each group's rows summed: the biases' gradient). A helper module:
``grouped`` registers these refinements around its own.

- Rows gathered at ``j`` with ``j[i]`` the group of grouped row i, read by
  an entrywise op beside the grouped rows ``Experts(y, group, index)``:
  row i is ``x[group[i]]``, so the rows are ``Experts(X, group, index)``
  with ``X[g, n] = x[g]`` for every n (the first G rows of x spread over
  the base's rows); rows that passed entrywise ops of a scalar since
  they were gathered (``b / tp``, torchtitan's ``ScaleBiasForward``) are
  those ops on x's first G rows (item 112 b). An entry off the routing (a row n that group g does
  not hold) is never read alone: ``Experts`` keeps only each row's own
  group's entry, the others multiplied by 0 before any sum.
- ``t.index_add(0, v, rows)``, v a recorded index into other rows than
  the rows' base's or their tokens' (those are adds back, ``grouped_rows``
  and ``routed_rows``): row i of the rows goes to ``t[v[i]]``. For grouped
  rows with ``v`` their own groups: ``t[g] + sum_n M[g, n] y[g, n]`` (M
  the 0/1 rows of group g), zero past the groups. For rows ``Rows(b, p)``
  (p without repeats): ``t[r] + sum_n S[r, n] b[n]`` with ``S[v[i], p[i]]
  = 1`` (the pairs distinct since p has no repeats) for the rows r of a
  grouped GEMM's groups when v is its rows' groups (``sum_rows``; else up
  to the last row the index reaches), zero past them, so that a rank's S is
  a piece of the single-device S whichever experts its tokens chose (an
  expert-parallel rank's: its local experts' rows): the row of zeros
  torchtitan appends to the biases is past it on both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.lowering.constants import constant_value
from backends.torch.lowering.grouped_rows import Experts, copies_of, group_mask, spread_rows
from backends.torch.lowering.ir import NewZeros, Pending, Zeros
from backends.torch.lowering.routed_rows import Rows, is_zeros, value_of
from backends.torch.lowering.routed_rowwise import tensor_refs

if TYPE_CHECKING:
    from backends.torch.lowering.context import LNode, Lowerer

Handler = Callable[..., Any]


#: lowered ops that, reading one tensor (their other operand a scalar), act
#: entry by entry: on a C-fold copy they are the copy of the op on its rows
SCALAR_ENTRYWISE = frozenset({"div", "mul", "add", "sub", "neg"})


def source_rows(lw: Lowerer, rows: Rows) -> tuple[int, np.ndarray, tuple[LNode, ...]]:
    """(x, j, ops): gathered row i is row ``j[i]`` of ``ops`` applied in
    turn to the lowered value x (the rows of a C-fold copy of x read back at
    x's own rows, through the entrywise ops of one tensor that ran on the
    copy since: a row of f(copy) is f of the row it copies)."""
    ops: list[LNode] = []
    v = rows.base
    for _ in range(8):
        for (x, c), copy in lw.grouped_copies.items():
            if copy == v:
                return x, rows.index // c, tuple(reversed(ops))
        made = next((node for node in reversed(lw.nodes) if v in node.outs), None)
        if made is None or made.op not in SCALAR_ENTRYWISE or len(made.ins) != 1 \
                or len(made.outs) != 1 or tuple(lw.shapes[made.ins[0]]) != tuple(lw.shapes[v]):
            break
        ops.append(made)
        v = made.ins[0]
    return rows.base, rows.index, ()


def at_groups(lw: Lowerer, rows: Rows, like: Experts) -> Experts | None:
    """``rows`` as grouped rows of ``like``'s groups and index, when each
    gathered row is the row of its own group (``x[group[i]]``); else None."""
    x, j, ops = source_rows(lw, rows)
    gs, n = lw.shapes[like.y][:2]
    shape = tuple(lw.shapes[x])
    if len(j) != len(like.group) or not np.array_equal(j, like.group) or shape[0] < gs:
        return None
    first = first_rows(lw, x, gs)
    for node in ops:  # the copy's entrywise ops, on the rows they copy
        first = lw.emit(node.op, [first], [tuple(lw.shapes[first])], dict(node.kwargs))[0]
    one = lw.reshape(first, (gs, 1, *shape[1:]))
    wide = (gs, n, *shape[1:])
    spread = lw.emit("expand", [one], [wide], {"shape": list(wide)})[0]
    return Experts(spread, like.group, like.index)


def first_rows(lw: Lowerer, x: int, n: int) -> int:
    """The first n rows of x: x itself, the first operand of a ``cat`` of
    rows that made x when it has n rows (torchtitan's biases with a row of
    zeros appended, ``cat([b, zeros])``, read as b: the ``cat``, which an
    expert-parallel rank runs on its local experts' rows, is then read by
    no node), else a ``narrow``."""
    rows = lw.shapes[x][0]
    if rows == n:
        return x
    made = next((node for node in reversed(lw.nodes) if x in node.outs), None)
    if made is not None and made.op == "cat" and made.kwargs.get("dim", 0) == 0 \
            and lw.shapes[made.ins[0]][0] == n:
        return made.ins[0]
    return lw.emit("narrow", [x], [(n, *lw.shapes[x][1:])], {"dim": 0, "start": 0, "length": n})[0]


def rowwise(base: Handler) -> Handler:
    """An entrywise op on grouped rows that also reads rows gathered at
    each grouped row's own group: those read as grouped rows
    (``at_groups``), then ``base`` (``grouped_rows.experts_rowwise``)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        refs = tensor_refs([args, kwargs])
        experts = [value_of(lw, r) for r in refs if isinstance(value_of(lw, r), Experts)]
        if not experts:
            return base(lw, args, kwargs, shapes, group)
        first = experts[0]
        swapped: dict[int, Any] = {}
        for r in refs:
            p = value_of(lw, r)
            if not isinstance(p, Rows) or r[1] in swapped or np.array_equal(p.index, first.index):
                continue
            laid = at_groups(lw, p, first)
            if laid is not None:
                swapped[r[1]] = p
                lw.env[r[1]] = laid
        try:
            return base(lw, args, kwargs, shapes, group)
        finally:
            lw.env.update(swapped)
    return lower


def index_add(base: Handler) -> Handler:
    """``t.index_add(0, v, rows)`` of grouped rows at their own groups, or
    of gathered rows at an index of other rows than their tokens'; the rest
    to ``base`` (``grouped_rows.index_add``: the rows back at their tokens)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        src = value_of(lw, args[3]) if len(args) > 3 else None
        alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
        if not isinstance(src, (Rows, Experts)) or int(args[1]) != 0 or alpha != 1:
            return base(lw, args, kwargs, shapes, group)
        v = constant_value(lw, args[2])
        shape = tuple(shapes[0])
        if v is None or v.ndim != 1 or v.dtype.kind not in "iu" or len(v) != len(src.index) \
                or len(v) == 0 or v.min() < 0 or v.max() >= shape[0]:
            return base(lw, args, kwargs, shapes, group)
        v = v.astype(np.int64)
        if not another_space(lw, args[2], src, shape):
            return base(lw, args, kwargs, shapes, group)
        if isinstance(src, Experts):
            if not np.array_equal(v, src.group) or shape[0] < lw.shapes[src.y][0]:
                return base(lw, args, kwargs, shapes, group)
            summed = padded(lw, group_sums(lw, src), shape)
        else:
            spread = spread_rows(lw, src.base, sum_rows(lw, v))
            summed = padded(lw, group_sums(lw, Experts(spread, v, src.index)), shape)
        if isinstance(value_of(lw, args[0]), (Zeros, NewZeros)) or is_zeros(lw, args[0]):
            return summed
        return lw.emit("add", [lw.val(args[0]), lw.materialize(summed)], [shape])[0]
    return lower


def sum_rows(lw: Lowerer, v: np.ndarray) -> int:
    """The rows of the sums of rows added at the groups ``v``: a grouped
    GEMM's number of groups when v is each of its rows' group (torchtitan's
    bias gradient, the rows added at the groups its biases were read at),
    so that the sum matrix's extent is the experts this rank holds, not the
    last one its tokens chose (every rank and the single device then build
    it over the same groups, an expert-parallel rank over its local ones);
    else the rows up to the last v reaches. Either is the same sum (the rows
    past the last reached are zero), only the constant's shape differs."""
    reached = int(v.max()) + 1
    for groups, count in reversed(lw.grouped_groups):
        if count >= reached and np.array_equal(groups, v):
            return count
    return reached


def record_groups(base: Handler) -> Handler:
    """``torch._grouped_mm`` by ``base`` (``grouped_rows.grouped_mm``); the
    groups of grouped rows it makes are recorded for ``sum_rows``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        out = base(lw, args, kwargs, shapes, group)
        if isinstance(out, Experts):
            lw.grouped_groups.append((out.group, int(lw.shapes[out.y][0])))
        return out
    return lower


def another_space(lw: Lowerer, index_ref: Any, src: Rows | Experts, shape: tuple[int, ...]) -> bool:
    """The target's rows are neither the rows' base's (an add back at the
    rows gathered: ``routed_rows``, ``grouped_rows._at_own_rows``) nor the
    tokens whose C-fold copy the base is, at ``q // C`` (an add back at the
    tokens: ``grouped_rows``, which refuses one at other tokens than the
    gather's, item 75)."""
    rows = lw.shapes[src.y][1] if isinstance(src, Experts) else lw.shapes[src.base][0]
    if shape[0] == rows:
        return False
    found = copies_of(lw, index_ref)
    return not (found is not None and found[1] > 1 and shape[0] * found[1] == rows)


def group_sums(lw: Lowerer, e: Experts) -> int:
    """Row g: ``sum_n M[g, n] * y[g, n]``, the sum of group g's rows."""
    wide = tuple(lw.shapes[e.y])
    kept = lw.emit("mul", [e.y, group_mask(lw, e, wide)], [wide])[0]
    return lw.emit("sum", [kept], [(wide[0], *wide[2:])], {"dim": 1, "keepdim": False})[0]


@dataclass(frozen=True)
class ZeroRows(Pending):
    """x's rows followed by zero rows up to ``rows``, not yet emitted: a
    slice of x's rows reads x, a slice of the zero rows zeros (so that an
    expert-parallel rank's sums of its local experts, followed by the zero
    row of the bias it appended, are read as the sums: ``slice_rows``); any
    other reader the ``cat`` of x and zeros."""
    x: int
    rows: int

    def materialize(self, lw: Lowerer) -> int:
        shape = tuple(lw.shapes[self.x])
        zeros = lw.materialize(Zeros((self.rows - shape[0], *shape[1:])))
        return lw.emit("cat", [self.x, zeros], [(self.rows, *shape[1:])], {"dim": 0})[0]


def padded(lw: Lowerer, x: int, shape: tuple[int, ...]) -> int | ZeroRows:
    """x's rows followed by zero rows up to ``shape``."""
    return x if lw.shapes[x][0] == shape[0] else ZeroRows(x, shape[0])


def slice_rows(base: Handler) -> Handler:
    """``t[start:end]`` along dim 0 of x followed by zero rows
    (``ZeroRows``): x when it is x's rows, zeros when it is past them; the
    rest to ``base`` on the materialized value."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        t = value_of(lw, args[0])
        dim = int(args[1]) if len(args) > 1 else 0
        step = int(args[4]) if len(args) > 4 else 1
        if not isinstance(t, ZeroRows) or dim % len(shapes[0]) != 0 or step != 1:
            return base(lw, args, kwargs, shapes, group)
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        start = int(start) + (t.rows if int(start) < 0 else 0)
        rows = lw.shapes[t.x][0]
        if start == 0 and shapes[0][0] == rows:
            return t.x
        if start >= rows:
            return Zeros(tuple(shapes[0]))
        return base(lw, args, kwargs, shapes, group)
    return lower
