"""Lowerings of ops as compositions of ops already lowered: the mask of
``clamp``'s backward (``(x >= lo) & (x <= hi)``, then ``where``),
``torch.stack`` of any tensors, ``Tensor.repeat``, ``unbind``, and
``tril``/``triu`` of a computed tensor.

Registered by ``lowering/`` over its own table: each handler takes its own
cases and hands every other on to the handler it wraps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input
from backends.torch.lowering.fills import selected
from backends.torch.lowering.ir import Compare, Norm
from backends.torch.lowering.registry import Handler, lowers, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class Both:
    """``a & b`` of two comparisons with numbers, pending until a ``where``
    selects with it."""
    a: Compare
    b: Compare


@refines("aten.logical_and_.default", "aten.logical_and.default", absent=lambda op: _refused)
def logical_and(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        a, b = (lw.env.get(t[1]) if isinstance(t, (list, tuple)) else None for t in args[:2])
        if isinstance(a, Compare) and isinstance(b, Compare):
            return Both(a, b)
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.where.self")
def where(base: Handler) -> Handler:
    """``where(a & b, t, 0)`` = ``t`` times both indicators: the selection
    by b, then by a (exact: a product of 0/1 indicators)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        cond = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        if not isinstance(cond, Both):
            return base(lw, args, kwargs, shapes, group)
        if lw.const(args[2]) != 0:
            raise LoweringError(f"{lw.name}: where on two comparisons without a zero branch "
                                f"is not lowered")
        inner = selected(lw, cond.b, lw.val(args[1]), True, shapes[0])
        return selected(lw, cond.a, inner, True, shapes[0])
    return lower


@refines("aten.stack.default")
def stack(base: Handler) -> Handler:
    """``torch.stack(xs, dim)``: each piece with a dim of 1 inserted at dim,
    concatenated along it (norms keep their own fold)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        items = [lw.env.get(a[1]) for a in args[0]]
        if items and all(isinstance(x, Norm) for x in items):
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


@lowers("aten.repeat.default")
def repeat(lw: Lowerer, args, kwargs, shapes, group):
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


@lowers("aten.unbind.int")
def unbind(lw: Lowerer, args, kwargs, shapes, group):
    """``x.unbind(dim)``: each index along dim, a ``narrow`` of length 1 with
    the dim dropped (its backward is a ``stack``)."""
    x = lw.val(args[0])
    shape = list(lw.shapes[x])
    d = (int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))) % len(shape)
    piece = (*shape[:d], 1, *shape[d + 1:])
    return [lw.reshape(lw.emit("narrow", [x], [piece], {"dim": d, "start": i, "length": 1})[0],
                       tuple(out)) for i, out in enumerate(shapes)]


def triangle(keep: Callable[..., Any]):
    """``torch.tril``/``triu`` of a computed tensor: times the constant 0/1
    mask of the kept triangle of its last two dims (exact: each entry is
    kept or made 0)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.val(args[0])
        k = int(args[1]) if len(args) > 1 else int(kwargs.get("diagonal", 0))
        shape = tuple(lw.shapes[x])
        if len(shape) < 2:
            raise LoweringError(f"{lw.name}: tril/triu of fewer than two dims")
        mask = keep(np.ones(shape[-2:]), k)
        m = constant_input(lw, mask)
        if shape[-2:] != shape:
            m = lw.emit("expand", [m], [shape], {"shape": list(shape)})[0]
        return lw.emit("mul", [x, m], [shape])[0]
    return lower


def _refused(lw: Lowerer, args, kwargs, shapes, group):
    raise LoweringError(f"{lw.name}: logical_and other than of two comparisons with numbers "
                        f"is not lowered")


def _written_back(base: Handler | None) -> Handler | None:
    """An in-place op lowered as its out-of-place op; written into a
    parameter, its value is what the parameter holds from then on, which an
    optimizer step updates (``Lowerer.written_params``)."""
    if base is None:
        return None

    def lower(lw: Lowerer, args, kwargs, shapes, group):
        out = base(lw, args, kwargs, shapes, group)
        x = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        name = lw.params.get(x) or lw.written_params.get(x) if isinstance(x, int) else None
        if name is not None and isinstance(out, int):
            lw.written_params[out] = name
        return out
    return lower


def _same(base: Handler | None) -> Handler | None:
    """The base itself: an op lowered as another is."""
    return base


# split without view tracking
refines("aten.unsafe_split.Tensor", base="aten.split.Tensor")(_same)
# in-place forms of activations (recurrent cells write their gates in place)
for _op in ("sigmoid", "tanh", "relu"):
    refines(f"aten.{_op}_.default", base=f"aten.{_op}.default")(_same)
refines("aten.transpose_.default", base="aten.transpose.int")(_same)
# in-place clamps (Gemma 3n's AltUp clips a parameter's ``.data`` in the forward):
# the clamp, its result written back (the recorder binds it to the tensor
# and to the parameter a ``.data`` alias shares memory with, so later reads
# read it; docs/soundness.md, "Plans traced from PyTorch", 128 (a))
refines("aten.clamp_.default", base="aten.clamp.default")(lambda base: _written_back(base))
refines("aten.clamp_min_.default", base="aten.clamp_min.default")(lambda base: _written_back(base))
# clamp_min by a one-value constant tensor (F.cosine_similarity's eps) is clamp by its value
refines("aten.clamp_min.Tensor", "aten.clamp_min_.Tensor", base="aten.clamp_min.default")(_same)
lowers("aten.tril.default")(triangle(np.tril))
lowers("aten.triu.default")(triangle(np.triu))
