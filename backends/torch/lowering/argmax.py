"""Lowering of the maxima that come with an index: ``x.max(dim)`` and
``x.min(dim)`` (values and indices) and max pooling (``F.max_pool1d/2d/3d``,
``nn.MaxPool*d``: ``max_pool2d_with_indices`` and its backward).

Their backward sends the whole gradient to one element of each reduced row:
the *first* maximum (the smallest index along the dim, or the first in
row-major order over a pooling window). With ``m`` the row's maximum and
``step(y)`` the ``relu`` rule's backward factor (1 for y > 0, else 0), the
entry k of the row gets

    t_k - t_k step(m - x_k),   t_0 = g,   t_{k+1} = t_k step(m - x_k),

so ``t_k`` is g while every earlier entry is below the maximum, and entry
k keeps it exactly when it is the first one equal to m. This is the
kernel's function for every real input, ties included (docs/soundness.md,
"Plans traced from PyTorch", 21): no tie assumption is made. Every step is
a ``narrow``, a ``sub``, a ``relu`` backward node or a ``cat``.

A pooling window is cut out as a convolution's (``conv``): the
windows of an ``(N, C, S1, S2)`` input are ``(N, C, K1, O1, K2, O2)``, the
maximum is taken over K2 and then K1 (a maximum of maxima), and the
windows' gradient goes back through the adjoint of the windowing. With
padding (torch pads with -inf) or ``ceil_mode``, the windows are
``pool``'s: each padded tap a copy of a valid tap of its window.

The index itself is a pending value: it is read only by the backward
(``scatter`` into zeros, ``max_pool*_with_indices_backward``); any other
reader (an accuracy, a gather at the argmax) is refused in one line.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import cat, narrow, pad
from backends.torch.lowering.ir import NewZeros, Pending
from backends.torch.lowering.registry import Handler, lowers, not_lowered, refines
from backends.torch.lowering.shapes import (
    Dim,
    conv_windows,
    max_unwindow,
    max_windows,
    pool_dims,
    unwindow,
)

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class _Pool:
    """A max pooling's options, read from its recorded arguments, in the
    attribute names ``conv``'s windowing reads."""
    spatial: int
    size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    out: tuple[int, ...]
    padded: tuple[Dim, ...] = ()  # with padding or ceil_mode: pool's windows


@dataclass(frozen=True)
class MaxIndex(Pending):
    """The indices of ``x.max(dim)`` (``x.min(dim)`` when ``least``):
    ``top`` is the extreme value kept along ``dim`` (keepdim shape)."""
    x: int
    top: int
    dim: int
    keepdim: bool
    least: bool

    def materialize(self, lw: Lowerer) -> int:
        _refuse_index(lw)


@dataclass(frozen=True)
class PoolIndex(Pending):
    """The indices of a max pooling of ``x``: its windows, their maximum
    (shape ``(N, C, 1, O1, 1, O2, ...)``) and the pooling's options."""
    x: int
    windows: int
    top: int
    pool: _Pool

    def materialize(self, lw: Lowerer) -> int:
        _refuse_index(lw)


def _refuse_index(lw: Lowerer) -> None:
    raise LoweringError(f"{lw.name}: the index of a maximum (x.max(dim)'s indices, max "
                        f"pooling's return_indices) is read other than by its backward; only "
                        f"the values are lowered")


def _env(lw: Lowerer, a: Any) -> Any:
    return lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" \
        else None


def first_extreme_grad(lw: Lowerer, x: int, top: int, g: int, dims: list[int],
                       least: bool = False) -> int:
    """The gradient of x when g (the shape of ``top``, x with size 1 along
    ``dims``) goes to the first maximum (minimum when ``least``) of each
    row, in row-major order over ``dims``."""
    shape = lw.shapes[x]
    t = g
    parts: dict[tuple[int, ...], int] = {}
    for taps in itertools.product(*(range(shape[d]) for d in dims)):
        xk = x
        for d, k in zip(dims, taps):
            xk = narrow(lw, xk, d, k, 1)
        gap = [xk, top] if least else [top, xk]  # > 0 where entry k is not the extreme
        y = lw.emit("sub", gap, [lw.shapes[t]])[0]
        below = lw.emit("relu", [y, t], [lw.shapes[t]], direction="bw")[0]
        parts[taps] = lw.emit("sub", [t, below], [lw.shapes[t]])[0]
        t = below
    return _assemble(lw, parts, dims, ())


def _assemble(lw: Lowerer, parts: dict[tuple[int, ...], int], dims: list[int],
              prefix: tuple[int, ...]) -> int:
    """The pieces keyed by their taps, concatenated along ``dims`` (the
    last innermost)."""
    if len(prefix) == len(dims):
        return parts[prefix]
    d = dims[len(prefix)]
    count = 1 + max(k[len(prefix)] for k in parts)
    return cat(lw, [_assemble(lw, parts, dims, (*prefix, k)) for k in range(count)], d)


def _extreme(lw: Lowerer, x: int, dim: int, least: bool) -> int:
    """The maximum (minimum: ``-max(-x)``) of x along dim, keeping dim."""
    shape = list(lw.shapes[x])
    shape[dim] = 1
    if least:
        x = lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": -1.0})[0]
    top = lw.emit("max", [x], [tuple(shape)], {"dim": dim, "keepdim": True})[0]
    if least:
        top = lw.emit("mul_scalar", [top], [tuple(shape)], {"value": -1.0})[0]
    return top


def max_dim(least: bool) -> Handler:
    """``x.max(dim, keepdim)`` (``x.min``): the values and a pending index."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.val(args[0])
        dim = int(args[1] if len(args) > 1 else kwargs["dim"]) % max(1, len(lw.shapes[x]))
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if not lw.shapes[x]:
            raise LoweringError(f"{lw.name}: max/min over a dim of a 0-d tensor is not lowered")
        top = _extreme(lw, x, dim, least)
        values = top if keepdim else lw.reshape(top, tuple(shapes[0]))
        return [values, MaxIndex(x, top, dim, keepdim, least)]
    return lower


@refines("aten.unsqueeze.default")
def unsqueeze(base: Handler) -> Handler:
    """The backward's ``indices.unsqueeze(dim)``: the index with its dim kept."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        idx = _env(lw, args[0])
        if not isinstance(idx, MaxIndex):
            return base(lw, args, kwargs, shapes, group)
        if idx.keepdim or int(args[1]) % len(shapes[0]) != idx.dim:
            _refuse_index(lw)
        return MaxIndex(idx.x, idx.top, idx.dim, True, idx.least)
    return lower


@refines("aten.scatter.src", absent=lambda op: not_lowered(op, " other than as the backward of x.max(dim)"))
def scatter(base: Handler) -> Handler:
    """``zeros.scatter(dim, indices, g)``: ``value_selecting_reduction_backward``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        zeros, idx = _env(lw, args[0]), _env(lw, args[2])
        if not isinstance(idx, MaxIndex):
            return base(lw, args, kwargs, shapes, group)
        dim = int(args[1]) % len(shapes[0])
        if not isinstance(zeros, NewZeros) or not idx.keepdim or dim != idx.dim \
                or tuple(zeros.shape) != tuple(lw.shapes[idx.x]):
            _refuse_index(lw)
        g = lw.val(args[3])
        if lw.shapes[g] != lw.shapes[idx.top]:
            _refuse_index(lw)
        return first_extreme_grad(lw, idx.x, idx.top, g, [dim], idx.least)
    return lower


def _ints(value: Any, n: int, default: tuple[int, ...] | None = None) -> tuple[int, ...]:
    values = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    if not values and default is not None:
        return default
    return tuple(values * n if len(values) == 1 else values)


def _pool(lw: Lowerer, shape: tuple[int, ...], spatial: int, kernel, stride, padding, dilation,
          ceil_mode, out_shape: tuple[int, ...]) -> _Pool:
    kernel = _ints(kernel, spatial)
    stride = _ints(stride, spatial, kernel)
    padding = _ints(padding, spatial)
    dilation = _ints(dilation, spatial)
    size = tuple(shape[2:])
    if any(padding) or ceil_mode:  # windows over the padding or past the end: pool's
        dims = pool_dims(lw, size, kernel, stride, padding, dilation, ceil_mode, out_shape[2:])
        return _Pool(spatial, size, kernel, stride, padding, dilation, tuple(out_shape[2:]),
                     tuple(dims))
    out = tuple((s - d * (k - 1) - 1) // st + 1
                for s, k, st, d in zip(size, kernel, stride, dilation))
    if len(kernel) != spatial or tuple(out_shape[2:]) != out or any(o <= 0 for o in out):
        raise LoweringError(f"{lw.name}: max pooling of {list(shape)} with kernel {list(kernel)},"
                            f" stride {list(stride)}{' and ceil_mode' if ceil_mode else ''} "
                            f"is not lowered")
    return _Pool(spatial, size, kernel, stride, padding, dilation, out)


def _batched(lw: Lowerer, x: int, spatial: int) -> int:
    """x with a batch dim of 1 when it has none (an unbatched ``(C, S...)``)."""
    shape = lw.shapes[x]
    if len(shape) == spatial + 1:
        return lw.reshape(x, (1, *shape))
    if len(shape) != spatial + 2:
        raise LoweringError(f"{lw.name}: max pooling of an input of shape {list(shape)}")
    return x


def max_pool(spatial: int) -> Handler:
    """``max_pool{n}d_with_indices``: the maximum over each window."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x0 = lw.val(args[0])
        x = _batched(lw, x0, spatial)
        opts = [*args[1:6], *[None] * (6 - len(args))][:5]
        kernel, stride, padding, dilation, ceil_mode = opts
        out_shape = tuple(shapes[0]) if len(shapes[0]) == spatial + 2 else (1, *shapes[0])
        pool = _pool(lw, lw.shapes[x], spatial, kernel, [] if stride is None else stride,
                     padding or 0, dilation or 1, bool(ceil_mode), out_shape)
        win = max_windows(lw, x, list(pool.padded)) if pool.padded else conv_windows(lw, x, pool)
        top = win
        for i in reversed(range(spatial)):
            top = _extreme(lw, top, 2 + 2 * i, least=False)
        return [lw.reshape(top, tuple(shapes[0])), PoolIndex(x0, win, top, pool)]
    return lower


@lowers("aten.max_pool2d_with_indices_backward.default", "aten.max_pool3d_with_indices_backward.default")
def max_pool_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``max_pool{n}d_with_indices_backward(g, x, ..., indices)``."""
    idx = _env(lw, args[7] if len(args) > 7 else kwargs.get("indices"))
    x = lw.val(args[1])
    if not isinstance(idx, PoolIndex) or idx.x != x:
        raise LoweringError(f"{lw.name}: the backward of a max pooling whose indices are not "
                            f"that pooling's is not lowered")
    g = lw.reshape(lw.val(args[0]), lw.shapes[idx.top])
    dims = [2 + 2 * i for i in range(idx.pool.spatial)]
    win_grad = first_extreme_grad(lw, idx.windows, idx.top, g, dims)
    pool = idx.pool
    grad = max_unwindow(lw, win_grad, list(pool.padded)) if pool.padded \
        else unwindow(lw, win_grad, pool)
    return lw.reshape(grad, lw.shapes[x])


@dataclass(frozen=True)
class AdaptiveIndex(Pending):
    """The indices of an adaptive max pooling of ``x`` along ``dim`` (every
    other spatial dim kept whole): each output's window ``[lo, hi)``, the
    window's values and its maximum."""
    x: int
    dim: int
    windows: tuple[tuple[int, int, int, int], ...]  # (lo, hi, window, top)

    def materialize(self, lw: Lowerer) -> int:
        _refuse_index(lw)


def adaptive_max_pool(spatial: int) -> Handler:
    """``adaptive_max_pool{n}d(x, out)`` with one pooled dim (the others of
    the output size they have, as ``nn.AdaptiveMaxPool1d`` records): each
    output the maximum of torch's window ``[floor(o S / O), ceil((o + 1) S
    / O))``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x0 = lw.val(args[0])
        x = _batched(lw, x0, spatial)
        size, out = lw.shapes[x][2:], tuple(shapes[0])[-spatial:]
        pooled = [i for i in range(spatial) if size[i] != out[i]]
        if len(pooled) > 1:
            raise LoweringError(f"{lw.name}: adaptive max pooling of {list(size)} to "
                                f"{list(out)} (more than one pooled dim) is not lowered")
        dim = 2 + (pooled[0] if pooled else spatial - 1)
        windows = []
        for o in range(lw.shapes[x][dim] if not pooled else out[dim - 2]):
            n = lw.shapes[x][dim]
            lo, hi = (o, o + 1) if not pooled else (o * n // out[dim - 2],
                                                    -(-(o + 1) * n // out[dim - 2]))
            window = narrow(lw, x, dim, lo, hi - lo)
            windows.append((lo, hi, window, _extreme(lw, window, dim, least=False)))
        top = cat(lw, [w[3] for w in windows], dim)
        return [lw.reshape(top, tuple(shapes[0])), AdaptiveIndex(x0, dim, tuple(windows))]
    return lower


@lowers("aten.adaptive_max_pool2d_backward.default", "aten.adaptive_max_pool3d_backward.default")
def adaptive_max_pool_backward(lw: Lowerer, args, kwargs, shapes, group):
    """``adaptive_max_pool{n}d_backward(g, x, indices)``: each window's
    gradient to its first maximum, put back in place and summed."""
    idx = _env(lw, args[2] if len(args) > 2 else kwargs.get("indices"))
    x = lw.val(args[1])
    if not isinstance(idx, AdaptiveIndex) or idx.x != x:
        raise LoweringError(f"{lw.name}: the backward of an adaptive max pooling whose indices "
                            f"are not that pooling's is not lowered")
    first = idx.windows[0][3]
    shape = list(lw.shapes[first])
    shape[idx.dim] = len(idx.windows)
    g = lw.reshape(lw.val(args[0]), tuple(shape))
    size = lw.shapes[idx.windows[0][2]][:idx.dim] + (idx.windows[-1][1],) \
        + lw.shapes[idx.windows[0][2]][idx.dim + 1:]
    total = None
    for o, (lo, hi, window, top) in enumerate(idx.windows):
        grad = first_extreme_grad(lw, window, top, narrow(lw, g, idx.dim, o, 1), [idx.dim])
        grad = pad(lw, grad, idx.dim, lo, size[idx.dim] - hi)
        total = grad if total is None else lw.emit("add", [total, grad], [lw.shapes[grad]])[0]
    return lw.reshape(total, lw.shapes[x])




lowers("aten.max.dim")(max_dim(least=False))
lowers("aten.min.dim")(max_dim(least=True))
lowers("aten.max_pool2d_with_indices.default")(max_pool(2))
lowers("aten.max_pool3d_with_indices.default")(max_pool(3))
lowers("aten.adaptive_max_pool2d.default")(adaptive_max_pool(2))
lowers("aten.adaptive_max_pool3d.default")(adaptive_max_pool(3))
