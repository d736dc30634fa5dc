"""Lowering of ``torch.linalg.solve_triangular`` with a unit diagonal (Gated
DeltaNet's UT transform, Qwen3.5's linear attention): ``X = A^-1 B`` for a
unit triangular A, without division.

Only A's strict triangle ``S`` is read (torch ignores the rest, the diagonal
being 1), so ``A = I + S`` with S strictly triangular, hence nilpotent:
``S^n = 0`` for an n x n matrix. With ``M = -S``,
``(I - M)(I + M)(I + M^2) ... (I + M^(2^(t-1))) = I - M^(2^t) = I`` once
``2^t >= n``, so ``A^-1`` is that product of t factors, exact in real
arithmetic for every A (docs/soundness.md, "Plans traced from PyTorch",
46). ``left=False`` solves ``X A = B``: ``X = B A^-1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input
from backends.torch.lowering.emit import arg
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _matmul(lw: Lowerer, a: int, b: int) -> int:
    shape = (*lw.shapes[a][:-1], lw.shapes[b][-1])
    return lw.emit("matmul", [a, b], [shape])[0]


def unit_triangular_inverse(lw: Lowerer, a: int, upper: bool) -> int:
    """``A^-1`` of the unit triangular matrices ``a`` (``[..., n, n]``)
    whose strict triangle is read (upper or lower)."""
    shape = lw.shapes[a]
    n = shape[-1]
    strict = np.triu(np.ones((n, n)), 1) if upper else np.tril(np.ones((n, n)), -1)
    m = lw.emit("mul", [a, constant_input(lw, -strict)], [shape])[0]  # M = -S
    eye = constant_input(lw, np.eye(n))
    inverse = lw.emit("add", [m, eye], [shape])[0]  # I + M
    power, reach = m, 2
    while reach < n:
        power = _matmul(lw, power, power)  # M^reach
        inverse = _matmul(lw, inverse, lw.emit("add", [power, eye], [shape])[0])
        reach *= 2
    return inverse


@lowers("aten.linalg_solve_triangular.default")
def solve_triangular(lw: Lowerer, args, kwargs, shapes, group):
    a, b = lw.val(args[0]), lw.val(args[1])
    upper = bool(arg(args, kwargs, 2, "upper", False))
    left = bool(arg(args, kwargs, 3, "left", True))
    unit = bool(arg(args, kwargs, 4, "unitriangular", False))
    if not unit:
        raise LoweringError(f"{lw.name}: a triangular solve without a unit diagonal "
                            f"(unitriangular=False) is not lowered: it divides by the diagonal")
    if lw.shapes[a][-1] != lw.shapes[a][-2]:
        raise LoweringError(f"{lw.name}: a triangular solve with a matrix that is not square")
    inverse = unit_triangular_inverse(lw, a, upper)
    out = _matmul(lw, inverse, b) if left else _matmul(lw, b, inverse)
    if lw.shapes[out] != tuple(shapes[0]):
        raise LoweringError(f"{lw.name}: a triangular solve whose operands broadcast "
                            f"({list(lw.shapes[a])}, {list(lw.shapes[b])}) is not lowered")
    return out
