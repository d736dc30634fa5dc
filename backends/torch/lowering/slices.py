"""Lowering of strided and empty slices of computed tensors, and of their
backwards.

Rotary embeddings slice the head dim: interleaved rotary (GLM, Helium, GPT-J)
takes every second value, ``x[..., 0::2]`` and ``x[..., 1::2]``; partial
rotary (Phi-3, StableLM, GPT-NeoX) keeps ``x[..., :rot]`` and passes
``x[..., rot:]`` through, which is empty when ``rot`` is the whole head dim
(and ``rotate_half`` of a one-value rotary part takes an empty first half).

A strided slice ``x[start:stop:step]`` along dim, of ``count`` values, is
the values at ``start + k step``: x narrowed to ``[start, start + (count - 1)
step + 1)``, padded with ``step - 1`` zeros at the end (``narrow``'s
backward), reshaped to ``(count, step)`` along dim and the first of each
pair kept (a ``narrow`` of length 1, reshaped back). Its backward
(``slice_backward`` with a step) is the adjoint: each gradient value followed
by ``step - 1`` zeros, cut to ``(count - 1) step + 1`` values and padded
with zeros to the input's size. Every step is a slice, a zero padding or a
reshape: exact rules (docs/soundness.md, "Plans traced from PyTorch", 24).

An empty slice holds no value: it is lowered to ``Empty``, which a ``cat``
drops from its operands and whose ``slice_backward`` (the gradient of the
input it was cut from) is zeros of the input's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import narrow, pad
from backends.torch.lowering.ir import Bucket, IdRows, Ids, Piece
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer




@dataclass(frozen=True)
class Empty:
    """A tensor with no values (a slice of length 0)."""
    shape: tuple[int, ...]


def _every(lw: Lowerer, x: int, dim: int, start: int, step: int, count: int) -> int:
    """The values of x at ``start + k step`` along dim, k < count."""
    x = narrow(lw, x, dim, start, (count - 1) * step + 1)
    x = pad(lw, x, dim, 0, step - 1)
    shape = lw.shapes[x]
    x = lw.reshape(x, (*shape[:dim], count, step, *shape[dim + 1:]))
    return lw.reshape(narrow(lw, x, dim + 1, 0, 1), (*shape[:dim], count, *shape[dim + 1:]))


def _spread(lw: Lowerer, g: int, dim: int, start: int, step: int, size: int) -> int:
    """The adjoint of ``_every``: g's values at ``start + k step`` of ``size``
    positions along dim, zeros elsewhere."""
    shape = lw.shapes[g]
    count = shape[dim]
    g = pad(lw, lw.reshape(g, (*shape[:dim], count, 1, *shape[dim + 1:])), dim + 1, 0, step - 1)
    g = lw.reshape(g, (*shape[:dim], count * step, *shape[dim + 1:]))
    span = (count - 1) * step + 1
    g = narrow(lw, g, dim, 0, span)
    return pad(lw, g, dim, start, size - start - span)


def _bounds(total: int, args, at: int) -> tuple[int, int, int]:
    """(start, stop, step) of a recorded slice whose start is ``args[at]``."""
    start = args[at] if len(args) > at else 0
    end = args[at + 1] if len(args) > at + 1 else None
    step = int(args[at + 2]) if len(args) > at + 2 else 1
    return slice(start or 0, end, step).indices(total)


def _computed(lw: Lowerer, a: Any) -> bool:
    """Whether a recorded argument is a computed tensor (not the batch's
    integer ids, which the layout family slices as one-hot rows)."""
    x = lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 else None
    return x is not None and not isinstance(x, (Ids, IdRows, Bucket))


def _source(lw: Lowerer, a: Any, dim: int) -> tuple[int, int, int]:
    """(tensor, offset, size) along dim of what a slice reads: an equal piece
    of a tensor along the same dim (``x[..., :half]``, not yet materialized)
    is read from the tensor itself at the piece's offset, so that the rank
    and the single-device step slice the same node."""
    src = lw.env.get(a[1])
    if isinstance(src, Piece) and src.dim == dim and isinstance(src.of, int):
        size = lw.shapes[src.of][dim] // src.parts
        return src.of, src.index * size, size
    x = lw.val(a)
    return x, 0, lw.shapes[x][dim]


@refines("aten.slice.Tensor")
def strided_slice(inner: Handler) -> Handler:
    def handler(lw: Lowerer, args, kwargs, shapes, group):
        out = tuple(shapes[0])
        dim = int(args[1]) % len(out) if len(args) > 1 else 0
        step = int(args[4]) if len(args) > 4 else 1
        if (step == 1 and out[dim]) or not _computed(lw, args[0]):
            return inner(lw, args, kwargs, shapes, group)
        if not out[dim]:
            return Empty(out)
        x, offset, total = _source(lw, args[0], dim)
        start, stop, step = _bounds(total, args, 2)
        if len(range(start, stop, step)) != out[dim]:
            raise LoweringError(f"{lw.name}: a strided slice of {out[dim]} values that its "
                                f"bounds do not give")
        return _every(lw, x, dim, offset + start, step, out[dim])
    return handler


@refines("aten.slice_backward.default")
def strided_slice_backward(inner: Handler) -> Handler:
    def handler(lw: Lowerer, args, kwargs, shapes, group):
        g = lw.env.get(args[0][1])
        sizes = tuple(int(s) for s in args[1])
        dim = int(args[2]) % len(sizes)
        if isinstance(g, Empty):
            return lw.emit("zeros", [], [sizes], {"shape": list(sizes)}, direction="none")[0]
        step = int(args[5])
        if step == 1:
            return inner(lw, args, kwargs, shapes, group)
        start, stop, step = _bounds(sizes[dim], args, 3)
        g = lw.val(args[0])
        if len(range(start, stop, step)) != lw.shapes[g][dim]:
            raise LoweringError(f"{lw.name}: the backward of a strided slice whose gradient "
                                f"its bounds do not give")
        return _spread(lw, g, dim, start, step, sizes[dim])
    return handler


@refines("aten.cat.default")
def cat_skipping_empty(inner: Handler) -> Handler:
    """A ``cat`` leaves out its operands of no entries (an empty slice, a
    cache started as ``torch.empty(0)``, XLM's): they add nothing."""
    def handler(lw: Lowerer, args, kwargs, shapes, group):
        shapes_of = lw.trace.get("shapes", [])
        tensors = [a for a in args[0] if not isinstance(lw.env.get(a[1]), Empty)
                   and not (a[1] < len(shapes_of) and 0 in tuple(shapes_of[a[1]]))]
        if not tensors:
            return Empty(tuple(shapes[0]))
        if len(tensors) == len(args[0]):
            return inner(lw, args, kwargs, shapes, group)
        return inner(lw, [tensors, *args[1:]], kwargs, shapes, group)
    return handler
