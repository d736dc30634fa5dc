"""Small emitters shared by the families: elementwise nodes, argument
readers, and the cuts and joins of a value along a dim (``narrow``, ``pad``
as narrow's backward, ``cat``, ``put_block``, a two-operand ``einsum``)."""

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


def narrow(lw: Lowerer, x: int, dim: int, start: int, length: int) -> int:
    shape = list(lw.shapes[x])
    if start == 0 and length == shape[dim]:
        return x
    shape[dim] = length
    return lw.emit("narrow", [x], [tuple(shape)], {"dim": dim, "start": start, "length": length})[0]


def pad(lw: Lowerer, x: int, dim: int, before: int, after: int) -> int:
    """x with ``before`` and ``after`` zeros along dim: the ``narrow`` rule's
    backward (its input's gradient, zero outside the slice), so that the
    zeros are laid out and scaled as x is on every rank."""
    if not before and not after:
        return x
    shape = list(lw.shapes[x])
    length = shape[dim]
    shape[dim] += before + after
    return lw.emit("narrow", [-1, x], [tuple(shape)],
                   {"dim": dim, "start": before, "length": length}, direction="bw")[0]


def cat(lw: Lowerer, parts: list[int], dim: int) -> int:
    if len(parts) == 1:
        return parts[0]
    shape = list(lw.shapes[parts[0]])
    shape[dim] = sum(lw.shapes[p][dim] for p in parts)
    return lw.emit("cat", parts, [tuple(shape)], {"dim": dim})[0]


def put_block(lw: Lowerer, x: int, starts: list[int], block: int) -> int:
    """``x`` with the block at ``starts`` (of ``block``'s shape) replaced by ``block``."""
    shape = lw.shapes[x]
    for d, (start, length) in enumerate(zip(starts, lw.shapes[block])):
        if length == shape[d]:
            continue
        inner = put_block(lw, narrow(lw, x, d, start, length), [0] * (d + 1) + starts[d + 1:], block)
        parts = [narrow(lw, x, d, 0, start)] if start else []
        parts.append(inner)
        if start + length < shape[d]:
            parts.append(narrow(lw, x, d, start + length, shape[d] - start - length))
        return cat(lw, parts, d)
    return block


def einsum(lw: Lowerer, eq: str, a: int, b: int) -> int:
    """The einsum ``eq`` of values a and b (its output shape from theirs)."""
    ins, out = eq.split("->")
    sizes: dict[str, int] = {}
    for sub, v in zip(ins.split(","), (a, b)):
        sizes.update(zip(sub, lw.shapes[v]))
    return lw.emit("einsum", [a, b], [tuple(sizes[c] for c in out)], {"eq": eq})[0]
