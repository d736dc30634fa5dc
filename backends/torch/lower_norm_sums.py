"""Lowering of gradient norms as trainers write them for clipping.

A trainer sums squared norms of its local gradient pieces in its own way:
``torch.stack(squares).sum()``, a Python ``sum`` (which starts from the
integer 0), an accumulator started from ``torch.zeros(())``, ``g.pow(2).sum()``
beside ``g.norm() ** 2``; a rank that counts nothing all-reduces a zero.
Each form is written as the additions it is, so that ``build`` can regroup
the terms across the group of an all-reduce (docs/soundness.md, "Plans
traced from PyTorch", 29):

- ``x + 0`` (a zero constant, ``zeros_like`` of a scalar, the number 0) is
  ``x`` when it has x's shape;
- a ``stack`` of 0-d values summed whole, or of norms squared and summed
  whole, is the chain of additions (of their square sums) in stack order;
- ``pow(x, 2)`` summed over every dim is ``sum(x * x)``, the square sum a
  norm is written with;
- an all-reduce whose input on this rank is an exact zero reads a ``zeros``
  node, which ``build`` counts as no term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lower_vocab_parallel import Zeros

SUMS = ("aten.sum.default", "aten.sum.dim_IntList")
ADDS = ("aten.add.Tensor", "aten.add_.Tensor")
ALL_REDUCES = ("_c10d_functional.all_reduce.default", "c10d.allreduce_.default")


@dataclass(frozen=True)
class _Scalars:
    """``torch.stack`` of 0-d values, not yet emitted: read by its sum."""
    items: tuple[Any, ...]

    def emit_into(self, lw) -> int:
        raise LoweringError(f"{lw.name}: a stack of {len(self.items)} scalars is read other "
                            f"than by its sum (not lowered)")


def _value(lw, a: Any) -> Any:
    return lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        else None


def is_zero(lw, a: Any) -> bool:
    """The argument is an exact zero: the number 0, a constant of zeros, or
    a ``zeros`` node this lowering emitted."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return a == 0
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
        return False
    x = lw.env.get(a[1])
    if isinstance(x, int):
        return x in lw.zero_values
    if isinstance(x, Zeros):
        return True
    if type(x).__name__ == "Const":
        value = lw.trace.get("constvals", {}).get(a[1])
        return value is not None and value.dtype.kind in "fiu" and not np.any(value)
    return False


def _shape(lw, a: Any) -> tuple[int, ...] | None:
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
        return None
    shape = lw.trace["shapes"][a[1]] if a[1] < len(lw.trace["shapes"]) else None
    return tuple(shape) if shape is not None else None


def norm_sum_handlers(base: dict) -> dict:
    """Handlers for the forms above; every other case goes to ``base``."""
    base = dict(base)

    def add(op: str):
        plain = base[op]

        def lower(lw, args, kwargs, shapes, group):
            if len(args) >= 2:
                for keep, zero in ((0, 1), (1, 0)):
                    if is_zero(lw, args[zero]) and _shape(lw, args[keep]) == tuple(shapes[0]) \
                            and (zero == 1 or kwargs.get("alpha", 1) == 1):
                        return _value(lw, args[keep])
            return plain(lw, args, kwargs, shapes, group)
        return lower

    def stack(lw, args, kwargs, shapes, group):
        dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
        items = [_value(lw, a) for a in args[0]]
        norms = all(type(x).__name__ == "_Norm" for x in items)
        if items and not norms and dim == 0 and all(_shape(lw, a) == () for a in args[0]):
            return _Scalars(tuple(items))
        return base["aten.stack.default"](lw, args, kwargs, shapes, group)

    def total(op: str):
        plain = base[op]

        def lower(lw, args, kwargs, shapes, group):
            x = _value(lw, args[0])
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
            whole = dims in (None, []) or (isinstance(x, _Scalars) and list(dims) in ([0], [-1]))
            if isinstance(x, _Scalars) and whole and not keepdim:
                acc = lw.materialize(x.items[0])
                for item in x.items[1:]:
                    acc = lw.emit("add", [acc, lw.materialize(item)], [()])[0]
                return acc
            if type(x).__name__ == "_NormStack" and x.squared and whole and not keepdim \
                    and all(n.share == 1 for n in x.norms):
                acc = x.norms[0].s
                for norm in x.norms[1:]:
                    acc = lw.emit("add", [acc, norm.s], [()])[0]
                return acc
            if isinstance(x, int) and x in lw.squares and whole and not keepdim:
                y = lw.squares[x]
                sq = lw.emit("mul", [y, y], [lw.shapes[y]])[0]
                return lw.emit("sum", [sq], [()], {"dim": None, "keepdim": False})[0]
            return plain(lw, args, kwargs, shapes, group)
        return lower

    def power(lw, args, kwargs, shapes, group):
        out = base["aten.pow.Tensor_Scalar"](lw, args, kwargs, shapes, group)
        x = _value(lw, args[0])
        if isinstance(out, int) and isinstance(x, int) and float(args[1]) == 2.0:
            lw.squares[out] = x
        return out

    def zeros_like(lw, args, kwargs, shapes, group):
        out = base["aten.zeros_like.default"](lw, args, kwargs, shapes, group)
        if isinstance(out, int) and tuple(shapes[0]) == () and out not in lw.fresh_state:
            lw.zero_values.add(out)
        return out

    def all_reduce(op: str):
        plain = base[op]

        def lower(lw, args, kwargs, shapes, group):
            arg = args[0][0] if op.startswith("c10d.") and len(args[0]) == 1 else args[0]
            if op.startswith("c10d.") and len(args[0]) != 1:
                return plain(lw, args, kwargs, shapes, group)
            if is_zero(lw, arg) and _shape(lw, arg) == ():
                z = lw.emit("zeros", [], [()], {"shape": []}, direction="none")[0]
                lw.zero_values.add(z)
                lw.env[arg[1]] = z
            return plain(lw, args, kwargs, shapes, group)
        return lower

    out = {op: add(op) for op in ADDS}
    out.update({op: total(op) for op in SUMS})
    out["aten.stack.default"] = stack
    out["aten.pow.Tensor_Scalar"] = power
    out["aten.zeros_like.default"] = zeros_like
    out.update({op: all_reduce(op) for op in ALL_REDUCES})
    return out
