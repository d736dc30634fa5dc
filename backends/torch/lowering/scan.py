"""Lowering of ``torch.cumsum`` and ``torch.flip`` of computed tensors, each
as a product with a constant 0/1 matrix along the dim (moved last and back
with ``transpose``): ``cumsum(x)[i] = sum_{j <= i} x[j]`` is ``einsum(x, U)`` with
``U[j, i] = 1`` for ``j <= i``; ``flip(x)[i] = x[n - 1 - i]`` is ``x @ J``
with the anti-identity ``J``. Exact in real arithmetic. Also a constant
padding of computed tensors by zeros, or a crop, dim by dim."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.arranged import Arranged
from backends.torch.lowering.constants import constant_input
from backends.torch.lowering.emit import einsum, narrow, pad
from backends.torch.lowering.ir import IdRows, Ids
from backends.torch.lowering.registry import Handler, lowers, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _along(lw: Lowerer, x: int, dim: int, matrix: np.ndarray) -> int:
    shape = list(lw.shapes[x])
    dim %= len(shape)
    last = len(shape) - 1
    if dim != last:
        moved = list(shape)
        moved[dim], moved[last] = moved[last], moved[dim]
        x = lw.emit("transpose", [x], [tuple(moved)], {"dim0": dim, "dim1": last})[0]
    letters = "abcdefgh"[:len(shape) - 1]
    y = einsum(lw, f"{letters}y,yz->{letters}z", x, constant_input(lw, matrix))
    if dim != last:
        y = lw.emit("transpose", [y], [tuple(shape)], {"dim0": dim, "dim1": last})[0]
    return y


@lowers("aten.cumsum.default")
def cumsum(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.val(args[0])
    dim = int(args[1]) if len(args) > 1 else int(kwargs["dim"])
    if kwargs.get("dtype") is not None and "float" not in str(kwargs["dtype"]) \
            and "double" not in str(kwargs["dtype"]):
        raise LoweringError(f"{lw.name}: cumsum to {kwargs['dtype']} is not lowered")
    n = lw.shapes[x][dim]
    return _along(lw, x, dim, np.triu(np.ones((n, n))))


@lowers("aten.flip.default")
def flip(lw: Lowerer, args, kwargs, shapes, group):
    f = lw.env.get(args[0][1])
    if isinstance(f, Arranged):  # an all-to-all's blocks reordered: their elements moved
        return f.flipped([int(d) % f.pos.ndim for d in args[1]])
    x = lw.val(args[0])
    for dim in [int(d) for d in args[1]]:
        n = lw.shapes[x][dim]
        x = _along(lw, x, dim, np.eye(n)[::-1].copy())
    return x


@refines("aten.constant_pad_nd.default")
def constant_pad(plain_pad: Handler) -> Handler:
    """Zeros around a computed tensor, or a crop (negative widths: the
    backward of a padding), dim by dim; ids and DTensor's padding of an
    uneven piece before its all-gather go to the tokens family's entry."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        value = args[2] if len(args) > 2 else kwargs.get("value", 0)
        x = lw.env.get(args[0][1])
        pads = [int(p) for p in args[1]]
        simple = sum(1 for p in pads if p) == 1 and all(p >= 0 for p in pads[1::2]) \
            and not any(pads[0::2])
        if isinstance(x, (Ids, IdRows)) or float(value or 0) != 0.0 or simple:
            return plain_pad(lw, args, kwargs, shapes, group)
        y = lw.val(args[0])
        n = len(lw.shapes[y])
        for k in range(len(pads) // 2):
            dim, before, after = n - 1 - k, pads[2 * k], pads[2 * k + 1]
            if before < 0 or after < 0:
                length = lw.shapes[y][dim] + min(before, 0) + min(after, 0)
                y = narrow(lw, y, dim, -min(before, 0), length)
            y = pad(lw, y, dim, max(before, 0), max(after, 0))
        return y
    return lower
