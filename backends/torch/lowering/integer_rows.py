"""Bounded integers computed from the batch's ids (``Lowerer.integral``):
their bounds and the few values they may take, and their one-hot rows
``[v == k]`` written as Lagrange polynomials over those values (docs/soundness.md,
"Plans traced from PyTorch", 45). Read by the counts family's refinements.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.emit import pad
from backends.torch.lowering.ir import Const, Flag, pending_of

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: the widest bounds whose one-hot rows are written as a polynomial
MAX_POINTS = 64


def integer_bounds(lw: Lowerer, a: Any) -> tuple[int, int] | None:
    """The bounds of an integer argument: a flag (0 or 1), a value the layer
    bounded, or an integer number; None for anything else."""
    if isinstance(a, bool):
        return int(a), int(a)
    if isinstance(a, int):
        return a, a
    x = pending_of(lw, a)
    if isinstance(x, Flag):
        return 0, 1
    if isinstance(x, int) and x in lw.integral:
        return lw.integral[x]
    if not isinstance(x, (int, Const)):
        return None
    # a constant of integers (the same for every batch)
    try:
        value = constant_value(lw, a)
    except LoweringError:
        value = None
    value = None if value is None else np.asarray(value)
    if value is not None and value.size and value.dtype.kind in "biuf" \
            and np.all(np.isfinite(value)) and np.all(value == np.round(value)):
        return int(np.min(value)), int(np.max(value))
    return None


def integer_points(lw: Lowerer, a: Any) -> tuple[int, ...] | None:
    """The integers an argument may take, when few (a number, a flag, a
    bounded value's set or bounds, a constant's values); None otherwise."""
    bounds = integer_bounds(lw, a)
    if bounds is None:
        return None
    x = pending_of(lw, a)
    if isinstance(x, int) and x in lw.integral_sets:
        return lw.integral_sets[x]
    if isinstance(x, Const):
        value = np.asarray(constant_value(lw, a))
        found = tuple(int(k) for k in np.unique(value))
        return found if len(found) <= MAX_POINTS else None
    lo, hi = bounds
    return tuple(range(lo, hi + 1)) if hi - lo < MAX_POINTS else None


def integer_type(dtype: str) -> bool:
    return any(t in dtype for t in ("int", "long", "bool")) and "complex" not in dtype


def one_hot_rows(lw: Lowerer, v: int, rows: int) -> int:
    """``[v == k]`` for k in ``0 .. rows - 1`` (``[*v.shape, rows]``) of a
    bounded integer v, as Lagrange polynomials over its bounds; emitted once
    per (v, rows)."""
    key = (v, rows)
    if key in lw.integral_rows:
        return lw.integral_rows[key]
    lo, hi = lw.integral[v]
    if lo < 0 or hi >= rows:
        raise LoweringError(f"{lw.name}: a table of {rows} rows looked up at integers computed "
                            f"from the ids that may lie in [{lo}, {hi}] (outside its rows)")
    if v in lw.integral_where:
        # the rows of where(m, a, b): m a's rows + (1 - m) b's rows
        m, a, b = lw.integral_where[v]
        shape = (*lw.shapes[v], rows)
        first, second = (spread(lw, rows_of(lw, x, rows), shape) for x in (a, b))
        mask = spread(lw, lw.reshape(m, (*lw.shapes[m], 1)), shape)
        gap = lw.emit("sub", [first, second], [shape])[0]
        out = lw.emit("add", [second, lw.emit("mul", [mask, gap], [shape])[0]], [shape])[0]
        lw.integral_rows[key] = out
        return out
    out = pad(lw, value_rows(lw, v), len(lw.shapes[v]), lo, rows - hi - 1)
    lw.integral_rows[key] = out
    return out


def rows_of(lw: Lowerer, a: Any, rows: int) -> int:
    """The one-hot rows (``rows`` wide) of a selection's branch: a bounded
    value's, or a constant's or number's (a constant of the plan)."""
    if isinstance(a, int) and not isinstance(a, bool) and a in lw.integral:
        return one_hot_rows(lw, a, rows)
    value = np.asarray(a if isinstance(a, (int, float, bool)) else constant_value(lw, a))
    if value.size and (value.min() < 0 or value.max() >= rows):
        raise LoweringError(f"{lw.name}: a table of {rows} rows looked up at a constant outside "
                            f"its rows")
    onehot = (value[..., None] == np.arange(rows)).astype(np.float64)
    return constant_input(lw, onehot)


def value_rows(lw: Lowerer, v: int) -> int:
    """``[v == k]`` for k in ``lo .. hi`` (``[*v.shape, hi - lo + 1]``) of
    a bounded integer v taking the values ``S`` (its set, else every integer
    of its bounds): in column k of S, ``prod_{r in S, r != k} (v - r) / (k -
    r)``; in a column outside S, 0."""
    lo, hi = lw.integral[v]
    taken = lw.integral_sets.get(v) or tuple(range(lo, hi + 1))
    if len(taken) > MAX_POINTS:
        raise LoweringError(f"{lw.name}: a lookup or comparison at integers computed from the "
                            f"ids that may take {len(taken)} values (more than {MAX_POINTS})")
    columns = np.arange(lo, hi + 1, dtype=np.float64)
    shape = (*lw.shapes[v], len(columns))
    column = lw.reshape(v, (*lw.shapes[v], 1))
    spread = lw.emit("expand", [column], [shape], {"shape": list(shape)})[0]
    out = None
    for r in taken:
        if len(taken) == 1:
            break
        # (v - r) / (k - r) in column k != r, 1 in column r
        gap = columns - r
        scale = np.where(gap == 0, 0.0, 1.0 / np.where(gap == 0, 1.0, gap))
        shift = np.where(gap == 0, 1.0, -r * scale)
        factor = lw.emit("mul", [spread, constant_input(lw, scale)], [shape])[0]
        factor = lw.emit("add", [factor, constant_input(lw, shift)], [shape])[0]
        out = factor if out is None else lw.emit("mul", [out, factor], [shape])[0]
    if out is None:  # one possible value: its row is always 1
        out = lw.emit("ones", [], [shape], {"shape": list(shape)}, direction="none")[0]
    if len(taken) < len(columns):  # columns of no value the integer takes: 0
        inside = np.isin(columns, np.asarray(taken, dtype=np.float64)).astype(np.float64)
        out = lw.emit("mul", [out, constant_input(lw, inside)], [shape])[0]
    return out


def scaled_rows(lw: Lowerer, v: int) -> tuple[int, int]:
    """``D [v == k]`` for k in ``lo .. hi`` and the integer D, with integer
    coefficients only: column k of the set S is ``prod_{r in S, r != k} (v -
    r)`` times the integer ``D / prod_{r != k} (k - r)`` (D the least common
    multiple of those products), so that its constants are exact in a plan
    (``value_rows``'s fractions ``1 / (k - r)`` are not) and a comparison
    divides by D once, exactly."""
    lo, hi = lw.integral[v]
    taken = lw.integral_sets.get(v) or tuple(range(lo, hi + 1))
    columns = np.arange(lo, hi + 1)
    products = {k: math.prod(k - r for r in taken if r != k) for k in taken}
    common = math.lcm(*(abs(d) for d in products.values()))
    if len(taken) > MAX_POINTS or common * max(abs(d) for d in products.values()) >= 2 ** 52:
        raise LoweringError(f"{lw.name}: a comparison of integers counted from the ids that may "
                            f"take {len(taken)} values (too many to compare exactly)")
    shape = (*lw.shapes[v], len(columns))
    column = lw.reshape(v, (*lw.shapes[v], 1))
    spread = lw.emit("expand", [column], [shape], {"shape": list(shape)})[0]
    weight = np.array([common // products[k] if k in products else 0 for k in columns],
                      dtype=np.float64)
    out = lw.emit("mul", [lw.emit("ones", [], [shape], {"shape": list(shape)},
                                  direction="none")[0], constant_input(lw, weight)], [shape])[0]
    for r in taken:
        if len(taken) == 1:
            break
        # (v - r) in column k != r, 1 in column r
        gap = columns - r
        scale = np.where(gap == 0, 0.0, 1.0)
        shift = np.where(gap == 0, 1.0, -float(r))
        factor = lw.emit("mul", [spread, constant_input(lw, scale)], [shape])[0]
        factor = lw.emit("add", [factor, constant_input(lw, shift)], [shape])[0]
        out = lw.emit("mul", [out, factor], [shape])[0]
    return out, common


def bounded_value(lw: Lowerer, a: Any) -> int | None:
    x = pending_of(lw, a)
    return x if isinstance(x, int) and x in lw.integral else None


def spread(lw: Lowerer, x: int, shape: tuple[int, ...]) -> int:
    """x broadcast to ``shape`` (leading dims of 1 added, then expanded)."""
    if lw.shapes[x] == shape:
        return x
    lead = (1,) * (len(shape) - len(lw.shapes[x]))
    if lead:
        x = lw.reshape(x, (*lead, *lw.shapes[x]))
    return lw.emit("expand", [x], [shape], {"shape": list(shape)})[0]
