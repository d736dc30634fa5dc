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

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import every, put_region, spread
from backends.torch.lowering.ir import Bucket, Empty, IdRows, Ids, Piece
from backends.torch.lowering.registry import Handler, lowers, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer




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
        return every(lw, x, dim, offset + start, step, out[dim])
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
        return spread(lw, g, dim, start, step, sizes[dim])
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


def _zeros_or_val(lw: Lowerer, a: Any) -> int:
    """A recorded constant whose kept value is all zeros (the zeros autograd
    scatters into the gradient in ``slice_scatter``'s backward) as a
    ``zeros`` node, zeros by its making, which a reader's claim may take at
    the factor of its other inputs (docs/soundness.md, "Plans traced from
    PyTorch", 40); any other value as it is."""
    value = lw.trace.get("constvals", {}).get(a[1]) if a[1] in lw.trace.get("constants", ()) \
        else None
    if value is not None and value.dtype.kind in "fiu" and not value.any():
        return lw.emit("zeros", [], [tuple(value.shape)], {"shape": list(value.shape)},
                       direction="none")[0]
    return lw.val(a)


@lowers("aten.slice_scatter.default")
def slice_scatter(lw: Lowerer, args, kwargs, shapes, group):
    """``torch.slice_scatter(x, src, dim, start, end, step)``: x with its
    entries at ``start + k step`` along dim replaced by src's (``put_region``;
    autograd records its backward as a ``slice_scatter`` of zeros into the
    gradient and a slice of it)."""
    shape = tuple(shapes[0])
    dim = int(args[2] if len(args) > 2 else kwargs.get("dim", 0)) % len(shape)
    bounds = [args[3] if len(args) > 3 else kwargs.get("start"),
              args[4] if len(args) > 4 else kwargs.get("end"),
              args[5] if len(args) > 5 else kwargs.get("step", 1)]
    start, stop, step = slice(bounds[0], bounds[1], int(bounds[2] or 1)).indices(shape[dim])
    count = len(range(start, stop, step))
    if isinstance(lw.env.get(args[1][1]), Empty) or count == 0:
        return lw.val(args[0])
    x, src = lw.val(args[0]), _zeros_or_val(lw, args[1])
    if lw.shapes[src][dim] != count or lw.shapes[x] != shape:
        raise LoweringError(f"{lw.name}: slice_scatter of {lw.shapes[src][dim]} values where "
                            f"its bounds give {count}")
    starts = [start if d == dim else 0 for d in range(len(shape))]
    steps = [step if d == dim else 1 for d in range(len(shape))]
    return put_region(lw, x, starts, steps, src)
