"""Shape helpers shared by the families: reshapes between shapes
(``view_to``), slices, zero padding and concatenation along a dim
(``narrow``, ``pad``, ``cat``), and the windows of convolutions and
poolings (``conv_windows``, ``max_windows`` and their adjoints)."""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import cat, narrow, pad, put, take
from backends.torch.lowering.ir import Flat

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


class Conv:
    """A convolution's options, read from its recorded arguments."""

    def __init__(self, lw: Lowerer, x: int, w: int, stride, padding, dilation, transposed,
                 output_padding, groups, size: tuple[int, ...] = ()) -> None:
        """``x`` is the convolution's input; of a transposed convolution, its
        input is the output of the convolution it is the adjoint of, whose
        input has the spatial ``size`` (the transposed one's output)."""
        self.spatial = len(lw.shapes[w]) - 2
        self.transposed = bool(transposed)
        if not self.transposed and any(int(p) for p in output_padding):
            raise LoweringError(f"{lw.name}: a convolution with output_padding is not lowered")
        self.stride = _per_dim(lw, stride, self.spatial, "stride")
        self.padding = _per_dim(lw, padding, self.spatial, "padding")
        self.dilation = _per_dim(lw, dilation, self.spatial, "dilation")
        self.groups = int(groups)
        self.kernel = tuple(lw.shapes[w][2:])
        self.size = tuple(size) if self.transposed else tuple(lw.shapes[x][2:])
        self.out = tuple((s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in
                         zip(self.size, self.padding, self.dilation, self.kernel, self.stride))
        if len(lw.shapes[x]) != self.spatial + 2 or any(o <= 0 for o in self.out) \
                or (self.transposed and self.out != tuple(lw.shapes[x][2:])):
            raise LoweringError(f"{lw.name}: a convolution of an input of shape "
                                f"{list(lw.shapes[x])} (unbatched or empty output) is not lowered")

    def equations(self) -> tuple[str, str, str]:
        """The forward einsum (windows, weight -> output) and the two
        gradients' (windows, output -> weight; output, weight -> windows)."""
        letters = iter(string.ascii_letters[3:])
        taps = [next(letters) for _ in range(self.spatial)]
        outs = [next(letters) for _ in range(self.spatial)]
        win = "nc" + "".join(k + o for k, o in zip(taps, outs))
        weight = "ac" + "".join(taps)
        out = "na" + "".join(outs)
        return f"{win},{weight}->{out}", f"{win},{out}->{weight}", f"{out},{weight}->{win}"


def _per_dim(lw: Lowerer, value: Any, n: int, what: str) -> tuple[int, ...]:
    values = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    if len(values) == 1:
        values *= n
    if len(values) != n or any(v < 0 for v in values):
        raise LoweringError(f"{lw.name}: a convolution's {what} {value!r} is not lowered")
    return tuple(values)



def with_axis(shape: tuple[int, ...], dim: int, size: int = 1) -> tuple[int, ...]:
    return (*shape[:dim], size, *shape[dim:])


def every(lw: Lowerer, x: int, dim: int, step: int, count: int) -> int:
    """Positions 0, step, ..., (count - 1) step of x along dim (x holds
    ``(count - 1) step + 1`` of them): padded to ``count * step``, split
    into (count, step) and the first of each kept."""
    if step == 1:
        return x
    x = pad(lw, x, dim, 0, step - 1)
    shape = lw.shapes[x]
    split = (*shape[:dim], count, step, *shape[dim + 1:])
    x = lw.reshape(x, split)
    return lw.reshape(narrow(lw, x, dim + 1, 0, 1), (*shape[:dim], count, *shape[dim + 1:]))


def spread(lw: Lowerer, g: int, dim: int, step: int, count: int) -> int:
    """The adjoint of ``every``: g's values at 0, step, ..., zeros between."""
    if step == 1:
        return g
    shape = lw.shapes[g]
    g = pad(lw, lw.reshape(g, with_axis(shape, dim + 1)), dim + 1, 0, step - 1)
    g = lw.reshape(g, (*shape[:dim], count * step, *shape[dim + 1:]))
    return narrow(lw, g, dim, 0, (count - 1) * step + 1)


def conv_windows(lw: Lowerer, x: int, conv: Conv) -> int:
    """x's windows, shape ``(N, C, K1, O1, ..., Kd, Od)``."""
    for i in range(conv.spatial):
        dim = 2 + 2 * i  # the spatial dim i, after the (tap, position) pairs before it
        x = pad(lw, x, dim, conv.padding[i], conv.padding[i])
        taps = []
        for k in range(conv.kernel[i]):
            length = (conv.out[i] - 1) * conv.stride[i] + 1
            tap = every(lw, narrow(lw, x, dim, k * conv.dilation[i], length), dim,
                         conv.stride[i], conv.out[i])
            taps.append(lw.reshape(tap, with_axis(lw.shapes[tap], dim)))
        x = cat(lw, taps, dim)
    return x


def unwindow(lw: Lowerer, g: int, conv: Conv) -> int:
    """The adjoint of ``conv_windows``: the input's gradient from the windows'."""
    for i in reversed(range(conv.spatial)):
        dim = 2 + 2 * i
        padded = conv.size[i] + 2 * conv.padding[i]
        total = None
        for k in range(conv.kernel[i]):
            tap = narrow(lw, g, dim, k, 1)
            shape = lw.shapes[tap]
            tap = lw.reshape(tap, (*shape[:dim], *shape[dim + 1:]))
            tap = spread(lw, tap, dim, conv.stride[i], conv.out[i])
            start = k * conv.dilation[i]
            tap = pad(lw, tap, dim, start, padded - start - lw.shapes[tap][dim])
            total = tap if total is None else lw.emit("add", [total, tap], [lw.shapes[tap]])[0]
        g = narrow(lw, total, dim, conv.padding[i], conv.size[i])
    return g


@dataclass(frozen=True)
class Dim:
    """One spatial dim of a pooling: input size, kernel, stride, padding,
    dilation and the recorded output size."""
    size: int
    kernel: int
    stride: int
    padding: int
    dilation: int
    out: int

    def start(self, o: int) -> int:
        return o * self.stride - self.padding

    def taps(self, o: int) -> list[int]:
        """The taps of window o that fall inside the input."""
        return [k for k in range(self.kernel)
                if 0 <= self.start(o) + k * self.dilation < self.size]

    def sources(self, k: int) -> list[int]:
        """The input position each window's tap k reads, a padded tap
        replaced by the window's nearest valid tap (max pooling)."""
        out = []
        for o in range(self.out):
            valid = self.taps(o)
            out.append(self.start(o) + min(max(k, valid[0]), valid[-1]) * self.dilation)
        return out


def pool_dims(lw: Lowerer, size, kernel, stride, padding, dilation, ceil_mode: bool,
              out) -> list[Dim]:
    """The pooling's dims, checked against torch's output size rule."""
    dims = [Dim(*v) for v in zip(size, kernel, stride, padding, dilation, out)]
    for d in dims:
        span = d.size + 2 * d.padding - d.dilation * (d.kernel - 1) - 1
        expect = -(-span // d.stride) + 1 if ceil_mode else span // d.stride + 1
        if ceil_mode and (expect - 1) * d.stride >= d.size + d.padding:
            expect -= 1
        if d.out != expect or d.out <= 0 or 2 * d.padding > d.dilation * (d.kernel - 1) + 1 \
                or any(not d.taps(o) for o in range(d.out)):
            raise LoweringError(f"{lw.name}: pooling of spatial size {list(size)} with kernel "
                                f"{list(kernel)}, stride {list(stride)}, padding {list(padding)}"
                                f"{' and ceil_mode' if ceil_mode else ''} is not lowered")
    return dims


def max_windows(lw: Lowerer, x: int, dims: list[Dim]) -> int:
    """x's windows ``(N, C, K1, O1, ..., Kd, Od)``, padded taps copied."""
    for i, d in enumerate(dims):
        dim = 2 + 2 * i
        taps = []
        for k in range(d.kernel):
            tap = take(lw, x, dim, d.sources(k))
            taps.append(lw.reshape(tap, with_axis(lw.shapes[tap], dim)))
        x = cat(lw, taps, dim)
    return x


def max_unwindow(lw: Lowerer, g: int, dims: list[Dim]) -> int:
    """The adjoint of ``max_windows``."""
    for i in reversed(range(len(dims))):
        d, dim = dims[i], 2 + 2 * i
        total = None
        for k in range(d.kernel):
            tap = narrow(lw, g, dim, k, 1)
            shape = lw.shapes[tap]
            tap = put(lw, lw.reshape(tap, (*shape[:dim], *shape[dim + 1:])), dim,
                       d.sources(k), d.size)
            total = tap if total is None else lw.emit("add", [total, tap], [lw.shapes[tap]])[0]
        g = total
    return g


def dim_set(dims: Any, ndim: int) -> list[int]:
    """The reduced dims, sorted; none (``None`` or ``[]``) is every dim."""
    dims = [] if dims is None else dims if isinstance(dims, (list, tuple)) else [dims]
    return sorted(int(d) % max(1, ndim) for d in dims) if dims else list(range(ndim))


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i == len(src) or j == len(dst):
            return []
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj or (i < len(src) and src[i] == 1 and j == len(dst)) \
                or (j < len(dst) and dst[j] == 1 and i == len(src)):
            if pi <= pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                return []
        groups.append((gi, gj))
    return groups


def _one_value(lw: Lowerer, x: int, dst: tuple[int, ...]) -> int:
    """A one-value tensor seen with another number of size-one dims, when one
    side has none (soundness.md, "Plans traced from PyTorch", 39a): a 0-d tensor gains its
    dims by an expand (new leading dims), a (1, ..., 1) tensor loses them by
    the sum of its one element."""
    if not lw.shapes[x]:
        return lw.emit("expand", [x], [dst], {"shape": list(dst)})[0]
    x = lw.emit("sum", [x], [()], {"dim": None, "keepdim": False})[0]
    return x if not dst else lw.emit("expand", [x], [dst], {"shape": list(dst)})[0]


def view_to(lw: Lowerer, x: int, dst: tuple[int, ...]) -> int | Flat:
    src = lw.shapes[x]
    if src == dst:
        return x
    if x in lw.flat_of and lw.shapes[lw.flat_of[x]] == dst:
        return lw.flat_of[x]  # a flattened value seen with its own shape again
    if (not src or not dst) and math.prod(src) == math.prod(dst) == 1:
        return _one_value(lw, x, dst)
    groups = _reshape_groups(src, dst)
    if groups and len(groups[0][0]) > 1 and len(groups[0][1]) == 1 and len(src) > 3 and len(dst) > 1 \
            and all(len(gi) == 1 and len(gj) == 1 for gi, gj in groups[1:]):
        return Flat(x, len(groups[0][0]))
    if not groups:
        raise LoweringError(f"{lw.name}: reshape {list(src)} -> {list(dst)} is not lowered")
    if len(dst) == 1 and len(src) > 1:
        out = lw.emit("flatten", [x], [dst], {"start": 0, "end": len(src) - 1})[0]
        lw.flat_of[out] = x
        return out
    pos = 0
    cur = x
    for gi, gj in groups:
        shape = list(lw.shapes[cur])
        if len(gi) > 1:
            merged = shape[:pos] + [math.prod(shape[pos:pos + len(gi)])] + shape[pos + len(gi):]
            cur = lw.emit("flatten", [cur], [merged], {"start": pos, "end": pos + len(gi) - 1})[0]
            shape = merged
        if len(gj) > 1:
            sizes = [dst[j] for j in gj]
            split = shape[:pos] + sizes + shape[pos + 1:]
            cur = lw.emit("unflatten", [cur], [split], {"dim": pos, "sizes": sizes})[0]
        pos += len(gj)
    return cur
