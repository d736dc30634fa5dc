"""The operator rule table: every operator a plan may contain, by name."""

from __future__ import annotations

from verdict.ops import collectives, elementwise, layout, linalg, nn, step, torchside
from verdict.ops.rule import Op, Shape, ShapeError

OPS: dict[str, Op] = {
    op.name: op
    for module in (elementwise, linalg, layout, nn, step, collectives, torchside)
    for op in module.OPS
}


def get_op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown operator '{name}'") from None


__all__ = ["OPS", "Op", "Shape", "ShapeError", "get_op"]
