"""Lowering of a computed tensor indexed along one dim by a constant tensor of
integers (``x[:, :, idx]`` with ``idx`` built from constants, as Falcon
splits its fused query-key-value projection), and of the ``index_put`` that
is its backward.

``x[..., idx, ...]`` along dim d takes, for each entry ``v`` of ``idx``, the
slice ``v`` of x along d: the ``narrow`` of that slice, concatenated along d
in ``idx``'s order and seen with ``idx``'s shape at d. ``t.index_put(...,
idx, ..., g, accumulate)`` adds each slice of g to the slice ``v`` of t (the
``narrow`` rule's backward puts it there among zeros); without accumulation
the slices written are first cleared (a constant 0/1 factor), and repeated
indices are refused (which write lands is not defined). Each is the op's
definition for the recorded constant indices, exact for every x
(docs/soundness.md, "Plans traced from PyTorch", 39f).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.emit import einsum, narrow, pad, take
from backends.torch.lowering.ir import Const, NewZeros, Zeros
from backends.torch.lowering.registry import Handler, lowers, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

INDEX_PUTS = ("aten.index_put_.default", "aten.index_put.default")


def _one_index(lw: Lowerer, indices: Any) -> tuple[int, np.ndarray, int] | None:
    """(dim, values, k) when the indices are one constant tensor, the other
    dims taken whole: integers index dim, k = 1; a boolean mask of k dims
    indexes dims ``dim .. dim + k - 1`` taken as one (row-major), at its
    true positions in order (``x[mask]`` is x at ``mask.nonzero()``). Else
    None."""
    if not isinstance(indices, (list, tuple)):
        return None
    given = [(d, a) for d, a in enumerate(indices) if a is not None]
    if len(given) != 1 or not isinstance(lw.env.get(given[0][1][1]), Const):
        return None
    value = constant_value(lw, given[0][1])
    if value is None:
        return None
    if value.dtype.kind == "b" and value.ndim >= 1:
        return given[0][0], np.flatnonzero(value), value.ndim
    if value.dtype.kind not in "iu":
        return None
    return given[0][0], np.asarray(value), 1


def _merged(lw: Lowerer, shape: tuple[int, ...], dim: int, k: int,
            mask_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """``shape`` with dims ``dim .. dim + k - 1`` taken as one (a boolean
    mask's dims, which must be the mask's shape)."""
    if k == 1 and mask_shape is None:
        return shape
    if mask_shape is not None and tuple(shape[dim:dim + k]) != tuple(mask_shape):
        raise LoweringError(f"{lw.name}: a boolean mask of shape {list(mask_shape)} indexes dims "
                            f"of sizes {list(shape[dim:dim + k])}")
    size = int(np.prod(shape[dim:dim + k], dtype=np.int64))
    return (*shape[:dim], size, *shape[dim + k:])


def _mask_shape(lw: Lowerer, indices: Any) -> tuple[int, ...] | None:
    """The shape of the one boolean mask among the indices, else None."""
    for a in indices:
        if a is not None:
            value = constant_value(lw, a)
            return tuple(value.shape) if value is not None and value.dtype.kind == "b" else None
    return None


def _checked(lw: Lowerer, values: np.ndarray, size: int) -> np.ndarray:
    if np.any((values < -size) | (values >= size)):
        raise LoweringError(f"{lw.name}: an index outside a dim of size {size}")
    return values % size


def _take(lw: Lowerer, x: int, dim: int, values: np.ndarray, shape: tuple[int, ...]) -> int:
    """The slices ``values`` of x along ``dim``, in their order, seen as ``shape``."""
    flat = _checked(lw, values.reshape(-1), lw.shapes[x][dim])
    return lw.reshape(take(lw, x, dim, [int(v) for v in flat]), shape)


@refines("aten.index.Tensor")
def index(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        found = _one_index(lw, args[1])
        if found is None or not isinstance(lw.env.get(args[0][1]), int):
            return base(lw, args, kwargs, shapes, group)
        dim, values, k = found
        x = lw.val(args[0])
        if not len(values):
            raise LoweringError(f"{lw.name}: indexing at an empty index is not lowered")
        x = lw.reshape(x, _merged(lw, tuple(lw.shapes[x]), dim, k, _mask_shape(lw, args[1])))
        return _take(lw, x, dim, values, tuple(shapes[0]))
    return lower


def _constant_integers(lw: Lowerer, a: Any) -> np.ndarray | None:
    """The values of a constant integer tensor argument, else None."""
    if not (isinstance(a, (list, tuple)) and len(a) == 2 and isinstance(lw.env.get(a[1]), Const)):
        return None
    value = constant_value(lw, a)
    if value is None or value.dtype.kind not in "iu":
        return None
    return np.asarray(value)


@lowers("aten.index_select.default")
def index_select(lw: Lowerer, args, kwargs, shapes, group):
    """``torch.index_select(x, dim, idx)`` at a constant ``idx``: x's slices
    ``idx`` along dim (XLNet's relative shift keeps ``arange(klen)``)."""
    values = _constant_integers(lw, args[2])
    if values is None:
        raise LoweringError(f"{lw.name}: index_select at an index computed from the parameters, "
                            f"the batch or a collective is not lowered (only at a constant index)")
    x = lw.val(args[0])
    dim = int(args[1]) % max(len(lw.shapes[x]), 1)
    return _take(lw, x, dim, values, tuple(shapes[0]))


def index_put(plain: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        found = _one_index(lw, args[1])
        target = lw.env.get(args[0][1])
        if found is None or not isinstance(target, (int, NewZeros, Zeros)):
            return plain(lw, args, kwargs, shapes, group)
        dim, values, k = found
        accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
        t = lw.val(args[0])
        whole = tuple(lw.shapes[t])
        if not len(values):
            raise LoweringError(f"{lw.name}: index_put at an empty index is not lowered")
        shape = _merged(lw, whole, dim, k, _mask_shape(lw, args[1]))
        t = lw.reshape(t, shape)
        flat = _checked(lw, values.reshape(-1), shape[dim])
        if not accumulate and len(set(flat.tolist())) != len(flat):
            raise LoweringError(f"{lw.name}: index_put without accumulation at repeated "
                                f"indices is not lowered (which write lands is not defined)")
        piece = list(shape)
        piece[dim] = len(flat)
        g = lw.val(args[2])
        if lw.shapes[g] != tuple(piece):
            expanded = (*shape[:dim], *values.shape, *shape[dim + 1:])
            g = lw.reshape(lw.emit("expand", [g], [expanded], {"shape": list(expanded)})[0]
                           if lw.shapes[g] != expanded else g, tuple(piece))
        if not accumulate:
            keep = np.ones(shape)
            np.moveaxis(keep, dim, 0)[flat] = 0.0
            t = lw.emit("mul", [t, constant_input(lw, keep)], [shape])[0]
        for i, v in enumerate(flat):
            part = pad(lw, narrow(lw, g, dim, i, 1), dim, int(v), shape[dim] - int(v) - 1)
            t = lw.emit("add", [t, part], [shape])[0]
        return lw.reshape(t, whole)
    return lower


def _refused(lw: Lowerer, args, kwargs, shapes, group):
    raise LoweringError(f"{lw.name}: index_put other than at one constant index tensor is not "
                        f"lowered")


refines(*INDEX_PUTS, absent=lambda op: _refused)(index_put)


def _zeros_target(lw: Lowerer, a: Any) -> bool:
    """Recorded tensor ``a`` is zeros (``new_zeros``, ``zeros_like``, or a
    constant of zeros)."""
    held = lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 else None
    if isinstance(held, (NewZeros, Zeros)):
        return True
    value = constant_value(lw, a) if isinstance(held, Const) else None
    return value is not None and not np.any(value)


@refines("aten.scatter_add.default")
def scatter_add(base: Handler) -> Handler:
    """``zeros.scatter_add(d, idx, g)`` at a constant index (the backward of
    ``x.gather(d, idx)``, ProphetNet's relative position buckets, indices
    repeating along d): out[p with p_d = idx[p]] += g[p], the einsum of g
    with idx's constant one-hot rows summed over idx's dim d, then zeros
    past idx's extent in the other dims (docs/soundness.md, "Plans traced
    from PyTorch", 78)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        idx = _constant_integers(lw, args[2]) if len(args) > 3 else None
        if idx is None or not _zeros_target(lw, args[0]):
            return base(lw, args, kwargs, shapes, group)
        sizes = tuple(shapes[0])
        nd = len(sizes)
        dim = int(args[1]) % nd
        src = lw.val(args[3])
        if idx.ndim != nd or nd > 7 or len(lw.shapes[src]) != nd \
                or any(idx.shape[k] > lw.shapes[src][k] for k in range(nd)) \
                or any(idx.shape[k] > sizes[k] for k in range(nd) if k != dim):
            raise LoweringError(f"{lw.name}: scatter_add at a constant index of shape "
                                f"{list(idx.shape)} into {list(sizes)} from "
                                f"{list(lw.shapes[src])} is not lowered")
        values = _checked(lw, idx.reshape(-1), sizes[dim]).reshape(idx.shape)
        for k in range(nd):
            src = narrow(lw, src, k, 0, int(idx.shape[k]))
        rows = constant_input(lw, np.eye(sizes[dim])[values])
        letters = "abcdefg"[:nd]
        at = lambda c: letters[:dim] + c + letters[dim + 1:]  # noqa: E731
        out = einsum(lw, f"{at('y')},{at('y')}z->{at('z')}", src, rows)
        for k in range(nd):
            if k != dim and idx.shape[k] < sizes[k]:
                out = pad(lw, out, k, 0, sizes[k] - int(idx.shape[k]))
        return out
    return lower


@refines("aten.gather.default")
def gather(base: Handler) -> Handler:
    """``x.gather(d, idx)`` at a constant index: out[p] = x[p with p_d =
    idx[p]], the einsum of x (cut to idx's extent in the other dims) with
    idx's constant one-hot rows, summed over x's dim d (docs/soundness.md,
    "Plans traced from PyTorch", 78)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        idx = _constant_integers(lw, args[2]) if len(args) > 2 else None
        if idx is None or not isinstance(lw.env.get(args[0][1]), int):
            return base(lw, args, kwargs, shapes, group)
        x = lw.val(args[0])
        size = tuple(lw.shapes[x])
        nd = len(size)
        dim = int(args[1]) % nd
        if idx.ndim != nd or nd > 7 or any(idx.shape[k] > size[k] for k in range(nd) if k != dim):
            raise LoweringError(f"{lw.name}: gather at a constant index of shape "
                                f"{list(idx.shape)} from {list(size)} is not lowered")
        values = _checked(lw, idx.reshape(-1), size[dim]).reshape(idx.shape)
        for k in range(nd):
            if k != dim:
                x = narrow(lw, x, k, 0, int(idx.shape[k]))
        rows = constant_input(lw, np.eye(size[dim])[values])
        letters = "abcdefg"[:nd]
        at = lambda c: letters[:dim] + c + letters[dim + 1:]  # noqa: E731
        return einsum(lw, f"{at('z')},{at('y')}z->{at('y')}", x, rows)
    return lower
