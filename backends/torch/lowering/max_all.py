"""Lowering of the maximum and minimum of a whole tensor: ``x.max()``,
``x.min()`` (``aten.max.default``, ``aten.min.default``) and ``torch.amax(x)``
over every dim, with their backward.

The value is the ``max`` rule over every dim (a minimum is ``-max(-x)``).
Autograd's backward of ``x.max()`` (``evenly_distribute_backward``) is

    nan = isnan(x) & isnan(top);  hit = (x == top) | nan;  g / hit.sum() * hit

Plan values are real numbers, never NaN: ``isnan`` of a lowered value is
false everywhere, so ``hit`` is ``x == top``, and the rest is the pattern of
``max`` (``amax``'s backward: the count of maxima, the share, the
product), emitted as one ``max`` backward node (ties share the gradient
evenly, as torch's kernel does; docs/soundness.md, "Plans traced from
PyTorch", 26). The NaN flags are pending values that no reader but that
pattern may read.

``x.argmax()`` and ``x.argmin()`` stay refused: an index used as a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.ir import MaxCount, MaxHit, Pending
from backends.torch.lowering.registry import Handler, lowers, not_lowered, refines
from backends.torch.lowering.shapes import dim_set

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _unlowered(op: str) -> Handler:
    """``not_lowered``, naming the op without its ``.default`` overload."""
    return not_lowered(op.removesuffix(".default"))


@dataclass(frozen=True)
class NotNaN(Pending):
    """``isnan(v)`` of a lowered value (or a conjunction of such): false
    everywhere in real arithmetic."""

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: isnan of a computed tensor is read other than by the "
                            f"backward of x.max()/x.min(); it is not lowered")


def _env(lw: Lowerer, a: Any) -> Any:
    return lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        else None


def extreme_all(least: bool) -> Handler:
    """``x.max()`` (``x.min()``: ``-max(-x)``), a 0-d value."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.val(args[0])
        if least:
            x = lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": -1.0})[0]
        top = lw.emit("max", [x], [()], {"dim": None, "keepdim": False})[0]
        if least:
            top = lw.emit("mul_scalar", [top], [()], {"value": -1.0})[0]
        return top
    return lower


@refines("aten.isnan.default", absent=_unlowered)
def isnan(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _env(lw, args[0])
        if x is None:
            return base(lw, args, kwargs, shapes, group)
        lw.val(args[0])  # a lowered (real-valued) tensor
        return NotNaN()
    return lower


@refines("aten.logical_and.default", absent=_unlowered)
def logical_and(base: Handler) -> Handler:
    """``isnan(x) & isnan(top)``: false when either side is."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        if any(isinstance(_env(lw, a), NotNaN) for a in args[:2]):
            return NotNaN()
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.logical_or_.default", "aten.logical_or.default", absent=_unlowered)
def logical_or(base: Handler) -> Handler:
    """``(x == top) | nan``: the comparison itself when nan is false."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = _env(lw, args[0]), _env(lw, args[1])
        if isinstance(b, NotNaN) and isinstance(a, MaxHit):
            return a
        if isinstance(a, NotNaN) and isinstance(b, MaxHit):
            return b
        if isinstance(a, NotNaN) or isinstance(b, NotNaN):
            raise LoweringError(f"{lw.name}: isnan of a computed tensor is read other than by "
                                f"the backward of x.max()/x.min(); it is not lowered")
        return base(lw, args, kwargs, shapes, group)
    return lower


def _all_dims(hit: MaxHit, ndim: int) -> bool:
    return dim_set(hit.kwargs[0], ndim) == list(range(ndim))


@refines("aten.sum.default")
def count_all(base: Handler) -> Handler:
    """``hit.sum()``: the number of maxima of a maximum over every dim."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        hit = _env(lw, args[0])
        if not isinstance(hit, MaxHit):
            return base(lw, args, kwargs, shapes, group)
        if not _all_dims(hit, len(lw.shapes[hit.x])):
            raise LoweringError(f"{lw.name}: a comparison with a maximum (amax(x) == x) read "
                                f"other than by amax's backward is not lowered")
        return MaxCount(hit)
    return lower


lowers("aten.max.default")(extreme_all(least=False))
lowers("aten.min.default")(extreme_all(least=True))
