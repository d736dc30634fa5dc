"""Small emitters of elementwise nodes, and argument readers, shared by the
families of pointwise ops."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def arg(args, kwargs, i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def number(lw: Lowerer, a: Any, what: str) -> float:
    value = lw.const(a)
    if value is None:
        raise LoweringError(f"{lw.name}: {what} is not a number")
    return value


def scaled(lw: Lowerer, x: int, c: float) -> int:
    if c == 1.0:
        return x
    return lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": float(c)})[0]


def shifted(lw: Lowerer, x: int, c: float) -> int:
    if c == 0.0:
        return x
    return lw.emit("add_scalar", [x], [lw.shapes[x]], {"value": float(c)})[0]


def emit_binary(lw: Lowerer, op: str, a: int, b: int) -> int:
    return lw.emit(op, [a, b], [lw.shapes[a]])[0]


def emit_unary(lw: Lowerer, op: str, x: int) -> int:
    return lw.emit(op, [x], [lw.shapes[x]])[0]


def step_times(lw: Lowerer, y: int, t: int) -> int:
    """``t * step(y)``: the relu rule's backward node."""
    return lw.emit("relu", [y, t], [lw.shapes[t]], direction="bw")[0]


def expand_to(lw: Lowerer, w: int, shape: tuple[int, ...]) -> int:
    if tuple(lw.shapes[w]) == tuple(shape):
        return w
    return lw.emit("expand", [w], [tuple(shape)], {"shape": list(shape)})[0]

