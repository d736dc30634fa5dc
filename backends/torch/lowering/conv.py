"""Lowering of ``aten.convolution`` and ``aten.convolution_backward``
(``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d``: zero padding, stride,
dilation, groups) with the rule table's exact linear operators.

A convolution is linear in its input and in its weight. The input is cut
into *windows*: along each spatial dim of size S, padded with p zeros on
both sides, the window of kernel tap k is the slice starting at ``k *
dilation`` keeping every ``stride``-th value, O of them. Each spatial dim
becomes a pair (tap, output position), so the windows of an ``(N, C, S1,
S2)`` input have shape ``(N, C, K1, O1, K2, O2)``, and the convolution of
group j is one ``einsum`` of its channels' windows with its weight rows;
the bias is added along the output channels. The backward is the same
einsum's two gradients (weight: windows with the output gradient; windows:
the output gradient with the weight), the windows' gradient put back by
the adjoint of the windowing (each tap's gradient spread with zeros
between strided positions, padded with zeros to its place and summed over
taps, the padding cut off), and the bias gradient the sum over the batch
and the positions. Every step is a slice (``narrow``), a zero padding
(``narrow``'s backward), a concatenation (``cat``), a reshape, an ``einsum``, an ``add`` or a ``sum``:
exact rules, so the lowering equals the kernel in exact real arithmetic
(docs/soundness.md, "Plans traced from PyTorch", 17; checked against torch
autograd in float64 by the tests).
"""

from __future__ import annotations

import string
from typing import Any

from backends.torch.errors import LoweringError


class _Conv:
    """A convolution's options, read from its recorded arguments."""

    def __init__(self, lw: Any, x: int, w: int, stride, padding, dilation, transposed,
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


def _per_dim(lw: Any, value: Any, n: int, what: str) -> tuple[int, ...]:
    values = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    if len(values) == 1:
        values *= n
    if len(values) != n or any(v < 0 for v in values):
        raise LoweringError(f"{lw.name}: a convolution's {what} {value!r} is not lowered")
    return tuple(values)


def _narrow(lw: Any, x: int, dim: int, start: int, length: int) -> int:
    shape = list(lw.shapes[x])
    if start == 0 and length == shape[dim]:
        return x
    shape[dim] = length
    return lw.emit("narrow", [x], [tuple(shape)], {"dim": dim, "start": start, "length": length})[0]


def _pad(lw: Any, x: int, dim: int, before: int, after: int) -> int:
    """x with ``before`` and ``after`` zeros along dim: the ``narrow`` rule's
    backward (its input's gradient, zero outside the slice), so that the
    zeros are laid out and scaled as x is on every rank."""
    if not before and not after:
        return x
    shape = list(lw.shapes[x])
    length = shape[dim]
    shape[dim] += before + after
    return lw.emit("narrow", [-1, x], [tuple(shape)],
                   {"dim": dim, "start": before, "length": length}, direction="bw")[0]


def _cat(lw: Any, parts: list[int], dim: int) -> int:
    if len(parts) == 1:
        return parts[0]
    shape = list(lw.shapes[parts[0]])
    shape[dim] = sum(lw.shapes[p][dim] for p in parts)
    return lw.emit("cat", parts, [tuple(shape)], {"dim": dim})[0]


def _with_axis(shape: tuple[int, ...], dim: int, size: int = 1) -> tuple[int, ...]:
    return (*shape[:dim], size, *shape[dim:])


def _every(lw: Any, x: int, dim: int, step: int, count: int) -> int:
    """Positions 0, step, ..., (count - 1) step of x along dim (x holds
    ``(count - 1) step + 1`` of them): padded to ``count * step``, split
    into (count, step) and the first of each kept."""
    if step == 1:
        return x
    x = _pad(lw, x, dim, 0, step - 1)
    shape = lw.shapes[x]
    split = (*shape[:dim], count, step, *shape[dim + 1:])
    x = lw.reshape(x, split)
    return lw.reshape(_narrow(lw, x, dim + 1, 0, 1), (*shape[:dim], count, *shape[dim + 1:]))


def _spread(lw: Any, g: int, dim: int, step: int, count: int) -> int:
    """The adjoint of ``_every``: g's values at 0, step, ..., zeros between."""
    if step == 1:
        return g
    shape = lw.shapes[g]
    g = _pad(lw, lw.reshape(g, _with_axis(shape, dim + 1)), dim + 1, 0, step - 1)
    g = lw.reshape(g, (*shape[:dim], count * step, *shape[dim + 1:]))
    return _narrow(lw, g, dim, 0, (count - 1) * step + 1)


def _windows(lw: Any, x: int, conv: _Conv) -> int:
    """x's windows, shape ``(N, C, K1, O1, ..., Kd, Od)``."""
    for i in range(conv.spatial):
        dim = 2 + 2 * i  # the spatial dim i, after the (tap, position) pairs before it
        x = _pad(lw, x, dim, conv.padding[i], conv.padding[i])
        taps = []
        for k in range(conv.kernel[i]):
            length = (conv.out[i] - 1) * conv.stride[i] + 1
            tap = _every(lw, _narrow(lw, x, dim, k * conv.dilation[i], length), dim,
                         conv.stride[i], conv.out[i])
            taps.append(lw.reshape(tap, _with_axis(lw.shapes[tap], dim)))
        x = _cat(lw, taps, dim)
    return x


def _unwindow(lw: Any, g: int, conv: _Conv) -> int:
    """The adjoint of ``_windows``: the input's gradient from the windows'."""
    for i in reversed(range(conv.spatial)):
        dim = 2 + 2 * i
        padded = conv.size[i] + 2 * conv.padding[i]
        total = None
        for k in range(conv.kernel[i]):
            tap = _narrow(lw, g, dim, k, 1)
            shape = lw.shapes[tap]
            tap = lw.reshape(tap, (*shape[:dim], *shape[dim + 1:]))
            tap = _spread(lw, tap, dim, conv.stride[i], conv.out[i])
            start = k * conv.dilation[i]
            tap = _pad(lw, tap, dim, start, padded - start - lw.shapes[tap][dim])
            total = tap if total is None else lw.emit("add", [total, tap], [lw.shapes[tap]])[0]
        g = _narrow(lw, total, dim, conv.padding[i], conv.size[i])
    return g


def _einsum(lw: Any, eq: str, a: int, b: int) -> int:
    ins, out = eq.split("->")
    sizes: dict[str, int] = {}
    for sub, v in zip(ins.split(","), (a, b)):
        sizes.update(zip(sub, lw.shapes[v]))
    return lw.emit("einsum", [a, b], [tuple(sizes[c] for c in out)], {"eq": eq})[0]


def _group(lw: Any, x: int, dim: int, j: int, groups: int) -> int:
    size = lw.shapes[x][dim] // groups
    return _narrow(lw, x, dim, j * size, size)


def _grouped(lw: Any, eq: str, a: int, b: int, groups: int, cat_dim: int, b_dim: int = 0) -> int:
    """``einsum(eq)`` of each group's channels (dim 1 of a, ``b_dim`` of b:
    a weight's rows or an activation's channels), concatenated along
    ``cat_dim``."""
    return _cat(lw, [_einsum(lw, eq, _group(lw, a, 1, j, groups), _group(lw, b, b_dim, j, groups))
                     for j in range(groups)], cat_dim)


def _add_bias(lw: Any, y: int, b: int, spatial: int) -> int:
    b = lw.reshape(b, (lw.shapes[b][0],) + (1,) * spatial)
    b = lw.emit("expand", [b], [lw.shapes[y]], {"shape": list(lw.shapes[y])})[0]
    return lw.emit("add", [y, b], [lw.shapes[y]])[0]


def convolution(lw: Any, args, kwargs, shapes, group):
    """The windows of each group's channels times its weight rows, plus the
    bias. A transposed convolution is the adjoint of the convolution with
    the same weight: its input plays that convolution's output gradient."""
    x, w = lw.val(args[0]), lw.val(args[1])
    conv = _Conv(lw, x, w, *args[3:9], size=tuple(shapes[0][2:]))
    forward, _, window_eq = conv.equations()
    if conv.transposed:
        y = _unwindow(lw, _grouped(lw, window_eq, x, w, conv.groups, 1), conv)
    else:
        y = _grouped(lw, forward, _windows(lw, x, conv), w, conv.groups, 1)
    if args[2] is not None:
        y = _add_bias(lw, y, lw.val(args[2]), conv.spatial)
    return y


def convolution_backward(lw: Any, args, kwargs, shapes, group):
    """(input, weight, bias) gradients, as ``output_mask`` asks."""
    g, x, w = lw.val(args[0]), lw.val(args[1]), lw.val(args[2])
    conv = _Conv(lw, x, w, *args[4:10], size=tuple(lw.shapes[g][2:]))
    mask = list(args[10])
    forward, weight_eq, window_eq = conv.equations()
    outs: list[Any] = [None, None, None]
    if conv.transposed:  # the adjoint's gradients: the convolution of g, and its weight's
        win = _windows(lw, g, conv) if mask[0] or mask[1] else None
        if mask[0]:
            outs[0] = _grouped(lw, forward, win, w, conv.groups, 1)
        if mask[1]:
            outs[1] = _grouped(lw, weight_eq, win, x, conv.groups, 0, b_dim=1)
    else:
        if mask[0]:
            outs[0] = _unwindow(lw, _grouped(lw, window_eq, g, w, conv.groups, 1), conv)
        if mask[1]:
            outs[1] = _grouped(lw, weight_eq, _windows(lw, x, conv), g, conv.groups, 0, b_dim=1)
    if mask[2]:
        dims = [0, *range(2, 2 + conv.spatial)]
        outs[2] = lw.emit("sum", [g], [(lw.shapes[g][1],)], {"dim": dims, "keepdim": False})[0]
    return outs


def _source(mode: str, j: int, before: int, length: int) -> int:
    """The input position padded position j (of ``before + length +
    after``) copies: reflected about the edge, or the edge replicated."""
    i = j - before
    if 0 <= i < length:
        return i
    if mode == "reflect":
        return -i if i < 0 else 2 * (length - 1) - i
    return 0 if i < 0 else length - 1


def _pad_dims(lw: Any, x: int, pad: Any) -> list[tuple[int, int, int]]:
    """(dim, before, after) of ``F.pad``'s list (last dim first)."""
    pad = [int(p) for p in pad]
    n = len(lw.shapes[x])
    dims = [(n - 1 - i, pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]
    if any(b < 0 or a < 0 for _, b, a in dims):
        raise LoweringError(f"{lw.name}: a negative padding {pad} is not lowered")
    return dims


def padded(mode: str):
    """``reflection_pad*d`` / ``replication_pad*d`` (``padding_mode`` of a
    convolution, ``F.pad(mode=...)``): each padded position a copy of one
    input position, written as a ``cat`` of one-wide slices around x."""
    def lower(lw: Any, args, kwargs, shapes, group):
        x = lw.val(args[0])
        for dim, before, after in _pad_dims(lw, x, args[1]):
            length = lw.shapes[x][dim]
            if mode == "reflect" and max(before, after) >= length:
                raise LoweringError(f"{lw.name}: reflect padding of {max(before, after)} on a "
                                    f"dim of {length} is not lowered")
            pieces = [_narrow(lw, x, dim, _source(mode, j, before, length), 1)
                      for j in range(before)]
            pieces.append(x)
            pieces += [_narrow(lw, x, dim, _source(mode, before + length + j, before, length), 1)
                       for j in range(after)]
            x = _cat(lw, pieces, dim)
        return x
    return lower


def padded_backward(mode: str):
    """The adjoint: the middle of the gradient plus every padded position's
    gradient added at the position it copies."""
    def lower(lw: Any, args, kwargs, shapes, group):
        g, x = lw.val(args[0]), lw.val(args[1])
        for dim, before, after in _pad_dims(lw, x, args[2]):
            length = lw.shapes[x][dim]
            total = _narrow(lw, g, dim, before, length)
            for j in [*range(before), *range(before + length, before + length + after)]:
                i = _source(mode, j, before, length)
                piece = _pad(lw, _narrow(lw, g, dim, j, 1), dim, i, length - 1 - i)
                total = lw.emit("add", [total, piece], [lw.shapes[total]])[0]
            g = total
        return g
    return lower


CONV_HANDLERS: dict[str, Any] = {
    "aten.convolution.default": convolution,
    "aten.convolution_backward.default": convolution_backward,
    **{f"aten.{kind}_pad{n}d.default": padded(mode)
       for kind, mode in (("reflection", "reflect"), ("replication", "replicate")) for n in (1, 2, 3)},
    **{f"aten.{kind}_pad{n}d_backward.default": padded_backward(mode)
       for kind, mode in (("reflection", "reflect"), ("replication", "replicate")) for n in (1, 2, 3)},
}
