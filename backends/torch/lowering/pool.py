"""Pooling windows with padding and ``ceil_mode`` (max pooling's, for
``argmax``) and average pooling (``F.avg_pool1d/2d/3d``,
``nn.AvgPool*d``: ``aten.avg_pool{2,3}d`` and their backward).

Along a spatial dim of size S, window o of a pooling covers the positions
``o * stride - padding + k * dilation`` for the taps k < K; positions
outside ``[0, S)`` are padding, and with ``ceil_mode`` the last window may
run past the padded end (torch keeps a window that starts inside the input
or its left padding).

*Max pooling* pads with -inf, which never wins a maximum. Here a padded tap
is a copy of the window's nearest valid tap instead (its first valid one
before, its last after): the window's maximum is unchanged, and its first
maximum in row-major tap order is a copy of torch's first valid maximum
(per dim the tap map is monotone, so the first tap whose source holds a
maximum has torch's source; docs/soundness.md, "Plans traced from
PyTorch", 26). Its backward sends the gradient through the adjoint of
those copies, to the very input position torch's index names.

*Average pooling* is linear and separable: along each dim, the input
padded with zeros is windowed as a convolution's (``conv``), the
taps are summed, and each output position is divided by its share of the
divisor (torch's divisor is the product over dims of the window's length
inside the padded input, or inside the input when ``count_include_pad`` is
false; ``divisor_override`` replaces it). The backward is the adjoint, dim
by dim. Every step is a ``narrow``, a zero padding, a ``cat``, a reshape,
a ``sum``, an ``add`` or a ``mul_scalar``: exact rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import cat, narrow, pad
from backends.torch.lowering.registry import Handler, lowers
from backends.torch.lowering.shapes import Dim, every, pool_dims, spread, with_axis

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

# -- average pooling ---------------------------------------------------------------

def _right(d: Dim) -> int:
    """Zeros after the input so that every window's taps exist."""
    return max(0, (d.out - 1) * d.stride + d.kernel - d.padding - d.size)


def _divisor(d: Dim, o: int, include_pad: bool) -> int:
    lo, hi = d.start(o), min(d.start(o) + d.kernel, d.size + d.padding)
    if not include_pad:
        lo, hi = max(lo, 0), min(hi, d.size)
    return hi - lo


def _scale(lw: Lowerer, x: int, dim: int, factors: list[float]) -> int:
    """x times ``factors[o]`` at position o along dim (runs of equal factors)."""
    parts, o = [], 0
    while o < len(factors):
        n = 1
        while o + n < len(factors) and factors[o + n] == factors[o]:
            n += 1
        piece = narrow(lw, x, dim, o, n)
        if factors[o] != 1.0:
            piece = lw.emit("mul_scalar", [piece], [lw.shapes[piece]], {"value": factors[o]})[0]
        parts.append(piece)
        o += n
    return cat(lw, parts, dim)


@dataclass(frozen=True)
class _Avg:
    dims: list[Dim]
    include_pad: bool
    divisor: int | None

    def factors(self, i: int) -> list[float]:
        if self.divisor is not None:
            return [1.0] * self.dims[i].out
        d = self.dims[i]
        return [1.0 / _divisor(d, o, self.include_pad) for o in range(d.out)]


def _avg_of(lw: Lowerer, x: int, args, kwargs, out_shape) -> _Avg:
    spatial = len(out_shape) - 2
    opts = [*args, *[None] * 7][:7]
    kernel, stride, padding, ceil_mode, include_pad, divisor = opts[1:7]
    kernel = _ints(kernel, spatial)
    stride = _ints(stride, spatial) if stride else kernel
    padding = _ints(padding if padding is not None else 0, spatial)
    dims = pool_dims(lw, lw.shapes[x][2:], kernel, stride, padding, (1,) * spatial,
                     bool(ceil_mode), out_shape[2:])
    if divisor is not None and int(divisor) <= 0:
        raise LoweringError(f"{lw.name}: average pooling with divisor_override {divisor}")
    return _Avg(dims, True if include_pad is None else bool(include_pad),
                None if divisor is None else int(divisor))


def _ints(value: Any, n: int) -> tuple[int, ...]:
    values = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return tuple(values * n if len(values) == 1 else values)


def _batched(lw: Lowerer, x: int, spatial: int) -> int:
    shape = lw.shapes[x]
    if len(shape) == spatial + 1:
        return lw.reshape(x, (1, *shape))
    if len(shape) != spatial + 2:
        raise LoweringError(f"{lw.name}: pooling of an input of shape {list(shape)}")
    return x


def avg_pool(spatial: int) -> Handler:
    """``avg_pool{n}d``: each dim windowed over zeros, summed, scaled."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _batched(lw, lw.val(args[0]), spatial)
        out_shape = tuple(shapes[0]) if len(shapes[0]) == spatial + 2 else (1, *shapes[0])
        avg = _avg_of(lw, x, args, kwargs, out_shape)
        for i, d in enumerate(avg.dims):
            dim = 2 + i
            xp = pad(lw, x, dim, d.padding, _right(d))
            total = None
            for k in range(d.kernel):
                tap = every(lw, narrow(lw, xp, dim, k, (d.out - 1) * d.stride + 1), dim,
                             d.stride, d.out)
                total = tap if total is None else lw.emit("add", [total, tap],
                                                          [lw.shapes[tap]])[0]
            x = _scale(lw, total, dim, avg.factors(i))
        if avg.divisor is not None:
            x = lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": 1.0 / avg.divisor})[0]
        return lw.reshape(x, tuple(shapes[0]))
    return lower


def _backward_args(lw: Lowerer, args, spatial: int) -> tuple[Any, Any, Any]:
    """A pooling backward's ``(g, x, ...)``: x as given, x and g batched."""
    x0 = lw.val(args[1])
    g = lw.val(args[0])
    g = lw.reshape(g, (1, *lw.shapes[g]) if len(lw.shapes[g]) == spatial + 1 else lw.shapes[g])
    return x0, _batched(lw, x0, spatial), g


def avg_pool_backward(spatial: int) -> Handler:
    """``avg_pool{n}d_backward(g, x, ...)``: the adjoint, dim by dim."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x0, x, g = _backward_args(lw, args, spatial)
        avg = _avg_of(lw, x, args[1:], kwargs, lw.shapes[g])
        if avg.divisor is not None:
            g = lw.emit("mul_scalar", [g], [lw.shapes[g]], {"value": 1.0 / avg.divisor})[0]
        for i in reversed(range(spatial)):
            d, dim = avg.dims[i], 2 + i
            g = _scale(lw, g, dim, avg.factors(i))
            padded = d.size + d.padding + _right(d)
            total = None
            for k in range(d.kernel):
                tap = spread(lw, g, dim, d.stride, d.out)
                tap = pad(lw, tap, dim, k, padded - k - lw.shapes[tap][dim])
                total = tap if total is None else lw.emit("add", [total, tap],
                                                          [lw.shapes[tap]])[0]
            g = narrow(lw, total, dim, d.padding, d.size)
        return lw.reshape(g, lw.shapes[x0])
    return lower




# -- adaptive average pooling -------------------------------------------------------

def _adaptive_windows(size: int, out: int) -> list[tuple[int, int]]:
    """torch's window ``[floor(o S / O), ceil((o + 1) S / O))`` of each output o."""
    return [(o * size // out, -(-(o + 1) * size // out)) for o in range(out)]


def adaptive_avg_pool(spatial: int) -> Handler:
    """``_adaptive_avg_pool{n}d``: each output the mean of its window, dim by
    dim (torch divides the window's sum by the product of its lengths)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = _batched(lw, lw.val(args[0]), spatial)
        out = tuple(shapes[0])[-spatial:]
        for i, o_size in enumerate(out):
            dim = 2 + i
            pieces = []
            for lo, hi in _adaptive_windows(lw.shapes[x][dim], o_size):
                piece = narrow(lw, x, dim, lo, hi - lo)
                shape = with_axis(tuple(s for k, s in enumerate(lw.shapes[piece]) if k != dim), dim)
                piece = lw.emit("sum", [piece], [shape], {"dim": [dim], "keepdim": True})[0]
                if hi - lo != 1:
                    piece = lw.emit("mul_scalar", [piece], [shape], {"value": 1.0 / (hi - lo)})[0]
                pieces.append(piece)
            x = cat(lw, pieces, dim)
        return lw.reshape(x, tuple(shapes[0]))
    return lower


def adaptive_avg_pool_backward(spatial: int) -> Handler:
    """``_adaptive_avg_pool{n}d_backward(g, x)``: the adjoint, dim by dim."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x0, x, g = _backward_args(lw, args, spatial)
        for i in reversed(range(spatial)):
            dim, size = 2 + i, lw.shapes[x][2 + i]
            total = None
            for o, (lo, hi) in enumerate(_adaptive_windows(size, lw.shapes[g][dim])):
                piece = narrow(lw, g, dim, o, 1)
                if hi - lo != 1:
                    piece = lw.emit("mul_scalar", [piece], [lw.shapes[piece]],
                                    {"value": 1.0 / (hi - lo)})[0]
                    shape = list(lw.shapes[piece])
                    shape[dim] = hi - lo
                    piece = lw.emit("expand", [piece], [tuple(shape)], {"shape": shape})[0]
                piece = pad(lw, piece, dim, lo, size - hi)
                total = piece if total is None else lw.emit("add", [total, piece],
                                                            [lw.shapes[piece]])[0]
            g = total
        return lw.reshape(g, lw.shapes[x0])
    return lower



lowers("aten.avg_pool2d.default")(avg_pool(2))
lowers("aten.avg_pool3d.default")(avg_pool(3))
lowers("aten.avg_pool2d_backward.default")(avg_pool_backward(2))
lowers("aten.avg_pool3d_backward.default")(avg_pool_backward(3))
lowers("aten._adaptive_avg_pool2d.default")(adaptive_avg_pool(2))
lowers("aten._adaptive_avg_pool3d.default")(adaptive_avg_pool(3))
lowers("aten._adaptive_avg_pool2d_backward.default")(adaptive_avg_pool_backward(2))
lowers("aten._adaptive_avg_pool3d_backward.default")(adaptive_avg_pool_backward(3))
