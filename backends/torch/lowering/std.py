"""Lowering of ``aten.std`` (``x.std()``, ``torch.std(dim, correction)``)
and of the guard of its backward.

The standard deviation is ``pow(var, 0.5)`` with ``var`` the ``var``
lowering (``std.var``) and the root uninterpreted, as every
non-linear function. Autograd's backward of ``std`` is
``(g / (2 s)).masked_fill_(s == 0, 0)`` handed to ``var``'s backward,
which multiplies it by ``2 (x - mean(x)) / (n - correction)``; the fill is
the identity here, because where ``s = 0`` every ``x`` along the reduced
dims equals their mean and the product is 0 whatever the filled value
(docs/soundness.md, "Plans traced from PyTorch", 17).

Registered by ``lowering/`` over its own table: the comparison and the fill
take their own cases and hand every other on to the handler they wrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import arg, emit_binary, expand_to, number
from backends.torch.lowering.registry import Handler, lowers, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class StdIsZero:
    """``s == 0`` for ``s`` a lowered standard deviation, pending until the
    backward's fill reads it."""
    std: int


@lowers("aten.std.correction")
def std(lw: Lowerer, args, kwargs, shapes, group):
    s = lw.emit("pow", [var(lw, args, kwargs, shapes, group)], shapes, {"exponent": 0.5})[0]
    lw.stds.add(s)
    return s


def _arg(lw: Lowerer, a: Any) -> Any:
    return lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 else None


@refines("aten.eq.Scalar")
def std_is_zero(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        s = _arg(lw, args[0])
        if isinstance(s, int) and s in lw.stds and lw.const(args[1]) == 0:
            return StdIsZero(s)
        return base(lw, args, kwargs, shapes, group)
    return lower


def _twice(lw: Lowerer, t: int, s: int) -> bool:
    """t is ``s * 2`` (the backward's ``mul.Scalar(result, 2)``)."""
    return any(n.outs == [t] and n.op == "mul_scalar" and n.ins == [s]
               and n.kwargs.get("value") == 2.0 for n in reversed(lw.nodes))


@refines("aten.masked_fill_.Scalar")
def std_guard(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        mask = _arg(lw, args[1])
        if not isinstance(mask, StdIsZero):
            return base(lw, args, kwargs, shapes, group)
        q = lw.val(args[0])
        quotient = lw.quotients.get(q)
        if quotient is None or not _twice(lw, quotient[1], mask.std) or lw.const(args[2]) != 0:
            raise LoweringError(f"{lw.name}: a fill where a standard deviation is 0 of other than "
                                f"its backward's g / (2 std) is not lowered")
        return q
    return lower


@lowers("aten.var.correction")
def var(lw: Lowerer, args, kwargs, shapes, group):
    """``sum((x - mean(x))^2, dims) / (n - correction)`` along dims."""
    x = lw.val(args[0])
    nd = len(lw.shapes[x])
    dims = arg(args, kwargs, 1, "dim", None)
    dims = list(range(nd)) if dims is None else [int(d) % nd for d in dims]
    correction = number(lw, kwargs.get("correction", 1), "var's correction")
    keepdim = bool(kwargs.get("keepdim", False))
    n = 1
    for d in dims:
        n *= lw.shapes[x][d]
    if n - correction <= 0:
        raise LoweringError(f"{lw.name}: var over {n} values with correction {correction}")
    dim = dims[0] if len(dims) == 1 else dims
    kept = tuple(1 if d in dims else k for d, k in enumerate(lw.shapes[x]))
    mean = lw.emit("mean", [x], [kept], {"dim": dim, "keepdim": True})[0]
    centered = emit_binary(lw, "sub", x, expand_to(lw, mean, lw.shapes[x]))
    total = lw.emit("sum", [emit_binary(lw, "mul", centered, centered)], shapes,
                    {"dim": dim, "keepdim": keepdim})[0]
    return lw.emit("div", [total], shapes, {"value": float(n - correction)})[0]
