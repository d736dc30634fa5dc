"""Lowerings of ops as compositions of ops already lowered: the mask of
``clamp``'s backward (``(x >= lo) & (x <= hi)``, then ``where``),
``torch.stack`` of any tensors, ``Tensor.repeat``.

Registered by ``lower.py`` over its own table: each handler takes its own
cases and hands every other on to the handler it wraps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.torch.errors import LoweringError
from backends.torch.lower import _Compare, _Norm, _selected

Handler = Callable[..., Any]


@dataclass(frozen=True)
class Both:
    """``a & b`` of two comparisons with numbers, pending until a ``where``
    selects with it."""
    a: _Compare
    b: _Compare


def logical_and(base: Handler) -> Handler:
    def lower(lw: Any, args, kwargs, shapes, group):
        a, b = (lw.env.get(t[1]) if isinstance(t, (list, tuple)) else None for t in args[:2])
        if isinstance(a, _Compare) and isinstance(b, _Compare):
            return Both(a, b)
        return base(lw, args, kwargs, shapes, group)
    return lower


def where(base: Handler) -> Handler:
    """``where(a & b, t, 0)`` = ``t`` times both indicators: the selection
    by b, then by a (exact: a product of 0/1 indicators)."""
    def lower(lw: Any, args, kwargs, shapes, group):
        cond = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        if not isinstance(cond, Both):
            return base(lw, args, kwargs, shapes, group)
        if lw.const(args[2]) != 0:
            raise LoweringError(f"{lw.name}: where on two comparisons without a zero branch "
                                f"is not lowered")
        inner = _selected(lw, cond.b, lw.val(args[1]), True, shapes[0])
        return _selected(lw, cond.a, inner, True, shapes[0])
    return lower


def stack(base: Handler) -> Handler:
    """``torch.stack(xs, dim)``: each piece with a dim of 1 inserted at dim,
    concatenated along it (norms keep their own fold)."""
    def lower(lw: Any, args, kwargs, shapes, group):
        items = [lw.env.get(a[1]) for a in args[0]]
        if items and all(isinstance(x, _Norm) for x in items):
            return base(lw, args, kwargs, shapes, group)
        dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
        out = tuple(shapes[0])
        d = dim % len(out)
        piece = (*out[:d], 1, *out[d + 1:])
        pieces = [lw.reshape(lw.val(a), piece) for a in args[0]]
        if len(pieces) == 1:
            return pieces[0]
        return lw.emit("cat", pieces, [out], {"dim": d})[0]
    return lower


def repeat(lw: Any, args, kwargs, shapes, group):
    """``x.repeat(r_0, ..., r_k)``: x seen with leading dims of 1 for the
    extra repeats, then, along each dim with r > 1, r copies concatenated
    (``out[..., j] = x[..., j mod n]``, what ``repeat`` tiles)."""
    x = lw.val(args[0])
    reps = [int(r) for r in args[1]]
    shape = tuple(lw.shapes[x])
    if len(reps) < len(shape):
        raise LoweringError(f"{lw.name}: repeat with fewer repeats than dims")
    shape = (1,) * (len(reps) - len(shape)) + shape
    x = lw.reshape(x, shape)
    for d, r in enumerate(reps):
        if r == 1:
            continue
        if r < 1:
            raise LoweringError(f"{lw.name}: repeat {r} times")
        grown = list(lw.shapes[x])
        grown[d] *= r
        x = lw.emit("cat", [x] * r, [tuple(grown)], {"dim": d})[0]
    return x


def compose_handlers(table: dict[str, Handler]) -> dict[str, Handler]:
    """The entries this module adds to or wraps in ``table`` (lower.py's)."""
    return {
        "aten.logical_and_.default": logical_and(table.get("aten.logical_and_.default", _refused)),
        "aten.logical_and.default": logical_and(table.get("aten.logical_and.default", _refused)),
        "aten.where.self": where(table["aten.where.self"]),
        "aten.stack.default": stack(table["aten.stack.default"]),
        "aten.repeat.default": repeat,
    }


def _refused(lw: Any, args, kwargs, shapes, group):
    raise LoweringError(f"{lw.name}: logical_and other than of two comparisons with numbers "
                        f"is not lowered")
