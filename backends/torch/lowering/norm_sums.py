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

Its state on the ``Lowerer``: ``squares`` (``pow(x, 2)`` -> x) and
``zero_values`` (the exact zeros it made or met).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.lowering.ir import Const, Norm, NormStack, Pending, Zeros
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

SUMS = ("aten.sum.default", "aten.sum.dim_IntList")
ADDS = ("aten.add.Tensor", "aten.add_.Tensor")


@dataclass(frozen=True)
class Scalars(Pending):
    """``torch.stack`` of 0-d values, not yet emitted: its sum is the chain of
    additions; any other reader reads the stack itself, each value seen
    with one dim of 1 and the values concatenated in order (``stack``'s
    meaning, ``compose.stack``), emitted once for all such readers (a
    parameter's gradient through ``unbind``: HY-V4's ``scale``;
    docs/soundness.md, "Plans traced from PyTorch", 110 (b))."""
    items: tuple[Any, ...]

    def materialize(self, lw: Lowerer) -> int:
        key = ("stacked scalars", id(self))  # kept alive by the env that holds it
        if key in lw.emitted_once:
            return lw.emitted_once[key]
        pieces = [lw.reshape(lw.materialize(item), (1,)) for item in self.items]
        out = pieces[0] if len(pieces) == 1 else \
            lw.emit("cat", pieces, [(len(pieces),)], {"dim": 0})[0]
        lw.emitted_once[key] = out
        return out


def _value(lw: Lowerer, a: Any) -> Any:
    return lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        else None


def is_zero(lw: Lowerer, a: Any) -> bool:
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
    if isinstance(x, Const):
        value = lw.trace.get("constvals", {}).get(a[1])
        return value is not None and value.dtype.kind in "fiu" and not np.any(value)
    return False


def _shape(lw: Lowerer, a: Any) -> tuple[int, ...] | None:
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
        return None
    shape = lw.trace["shapes"][a[1]] if a[1] < len(lw.trace["shapes"]) else None
    return tuple(shape) if shape is not None else None


@refines(*ADDS)
def add(base: Handler) -> Handler:
    """``x + 0`` (either side) is ``x`` when it has the sum's shape."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if len(args) >= 2:
            for keep, zero in ((0, 1), (1, 0)):
                if is_zero(lw, args[zero]) and _shape(lw, args[keep]) == tuple(shapes[0]) \
                        and (zero == 1 or kwargs.get("alpha", 1) == 1):
                    return _value(lw, args[keep])
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.stack.default")
def stack(base: Handler) -> Handler:
    """A stack of 0-d values along 0 (not all norms) stays pending for its sum."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
        items = [_value(lw, a) for a in args[0]]
        norms = all(isinstance(x, Norm) for x in items)
        if items and not norms and dim == 0 and all(_shape(lw, a) == () for a in args[0]):
            return Scalars(tuple(items))
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines(*SUMS)
def total(base: Handler) -> Handler:
    """The whole sum of stacked scalars, of stacked squared norms, or of
    ``pow(x, 2)``: the additions it is."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _value(lw, args[0])
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        whole = dims in (None, []) or (isinstance(x, Scalars) and list(dims) in ([0], [-1]))
        if isinstance(x, Scalars) and whole and not keepdim:
            acc = lw.materialize(x.items[0])
            for item in x.items[1:]:
                acc = lw.emit("add", [acc, lw.materialize(item)], [()])[0]
            return acc
        if isinstance(x, NormStack) and x.squared and whole and not keepdim \
                and all(n.share == 1 for n in x.norms):
            acc = x.norms[0].s
            for norm in x.norms[1:]:
                acc = lw.emit("add", [acc, norm.s], [()])[0]
            return acc
        if isinstance(x, int) and x in lw.squares and whole and not keepdim:
            y = lw.squares[x]
            sq = lw.emit("mul", [y, y], [lw.shapes[y]])[0]
            return lw.emit("sum", [sq], [()], {"dim": None, "keepdim": False})[0]
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.pow.Tensor_Scalar")
def power(base: Handler) -> Handler:
    """``pow(x, 2)`` as lowered, remembered as the square of x."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        out = base(lw, args, kwargs, shapes, group)
        x = _value(lw, args[0])
        if isinstance(out, int) and isinstance(x, int) and float(args[1]) == 2.0:
            lw.squares[out] = x
        return out
    return lower


@refines("aten.zeros_like.default")
def zeros_like(base: Handler) -> Handler:
    """``zeros_like`` of a scalar (not an optimizer state) is an exact zero."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        out = base(lw, args, kwargs, shapes, group)
        if isinstance(out, int) and tuple(shapes[0]) == () and out not in lw.fresh_state:
            lw.zero_values.add(out)
        return out
    return lower


def all_reduce(c10d: bool):
    """An all-reduce of an exact scalar zero reads a ``zeros`` node
    (``c10d``: the input is a list of one tensor)."""
    def refine(base: Handler) -> Handler:
        def lower(lw: Lowerer, args, kwargs, shapes, group):
            arg = args[0][0] if c10d and len(args[0]) == 1 else args[0]
            if c10d and len(args[0]) != 1:
                return base(lw, args, kwargs, shapes, group)
            if is_zero(lw, arg) and _shape(lw, arg) == ():
                z = lw.emit("zeros", [], [()], {"shape": []}, direction="none")[0]
                lw.zero_values.add(z)
                lw.env[arg[1]] = z
            return base(lw, args, kwargs, shapes, group)
        return lower
    return refine


refines("_c10d_functional.all_reduce.default")(all_reduce(False))
refines("c10d.allreduce_.default")(all_reduce(True))
