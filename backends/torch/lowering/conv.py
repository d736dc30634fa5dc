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

from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import cat, einsum, narrow, pad
from backends.torch.lowering.registry import lowers
from backends.torch.lowering.shapes import Conv, conv_windows, unwindow

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _group(lw: Lowerer, x: int, dim: int, j: int, groups: int) -> int:
    size = lw.shapes[x][dim] // groups
    return narrow(lw, x, dim, j * size, size)


def _grouped(lw: Lowerer, eq: str, a: int, b: int, groups: int, cat_dim: int, b_dim: int = 0) -> int:
    """``einsum(eq)`` of each group's channels (dim 1 of a, ``b_dim`` of b:
    a weight's rows or an activation's channels), concatenated along
    ``cat_dim``."""
    return cat(lw, [einsum(lw, eq, _group(lw, a, 1, j, groups), _group(lw, b, b_dim, j, groups))
                     for j in range(groups)], cat_dim)


def _add_bias(lw: Lowerer, y: int, b: int, spatial: int) -> int:
    b = lw.reshape(b, (lw.shapes[b][0],) + (1,) * spatial)
    b = lw.emit("expand", [b], [lw.shapes[y]], {"shape": list(lw.shapes[y])})[0]
    return lw.emit("add", [y, b], [lw.shapes[y]])[0]


@lowers("aten.convolution.default")
def convolution(lw: Lowerer, args, kwargs, shapes, group):
    """The windows of each group's channels times its weight rows, plus the
    bias. A transposed convolution is the adjoint of the convolution with
    the same weight: its input plays that convolution's output gradient."""
    x, w = lw.val(args[0]), lw.val(args[1])
    conv = Conv(lw, x, w, *args[3:9], size=tuple(shapes[0][2:]))
    forward, _, window_eq = conv.equations()
    if conv.transposed:
        y = unwindow(lw, _grouped(lw, window_eq, x, w, conv.groups, 1), conv)
    else:
        y = _grouped(lw, forward, conv_windows(lw, x, conv), w, conv.groups, 1)
    if args[2] is not None:
        y = _add_bias(lw, y, lw.val(args[2]), conv.spatial)
    return y


@lowers("aten.convolution_backward.default")
def convolution_backward(lw: Lowerer, args, kwargs, shapes, group):
    """(input, weight, bias) gradients, as ``output_mask`` asks."""
    g, x, w = lw.val(args[0]), lw.val(args[1]), lw.val(args[2])
    conv = Conv(lw, x, w, *args[4:10], size=tuple(lw.shapes[g][2:]))
    mask = list(args[10])
    forward, weight_eq, window_eq = conv.equations()
    outs: list[Any] = [None, None, None]
    if conv.transposed:  # the adjoint's gradients: the convolution of g, and its weight's
        win = conv_windows(lw, g, conv) if mask[0] or mask[1] else None
        if mask[0]:
            outs[0] = _grouped(lw, forward, win, w, conv.groups, 1)
        if mask[1]:
            outs[1] = _grouped(lw, weight_eq, win, x, conv.groups, 0, b_dim=1)
    else:
        if mask[0]:
            outs[0] = unwindow(lw, _grouped(lw, window_eq, g, w, conv.groups, 1), conv)
        if mask[1]:
            outs[1] = _grouped(lw, weight_eq, conv_windows(lw, x, conv), g, conv.groups, 0, b_dim=1)
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


def _pad_dims(lw: Lowerer, x: int, pad: Any) -> list[tuple[int, int, int]]:
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
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.val(args[0])
        for dim, before, after in _pad_dims(lw, x, args[1]):
            length = lw.shapes[x][dim]
            if mode == "reflect" and max(before, after) >= length:
                raise LoweringError(f"{lw.name}: reflect padding of {max(before, after)} on a "
                                    f"dim of {length} is not lowered")
            pieces = [narrow(lw, x, dim, _source(mode, j, before, length), 1)
                      for j in range(before)]
            pieces.append(x)
            pieces += [narrow(lw, x, dim, _source(mode, before + length + j, before, length), 1)
                       for j in range(after)]
            x = cat(lw, pieces, dim)
        return x
    return lower


def padded_backward(mode: str):
    """The adjoint: the middle of the gradient plus every padded position's
    gradient added at the position it copies."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        g, x = lw.val(args[0]), lw.val(args[1])
        for dim, before, after in _pad_dims(lw, x, args[2]):
            length = lw.shapes[x][dim]
            total = narrow(lw, g, dim, before, length)
            for j in [*range(before), *range(before + length, before + length + after)]:
                i = _source(mode, j, before, length)
                piece = pad(lw, narrow(lw, g, dim, j, 1), dim, i, length - 1 - i)
                total = lw.emit("add", [total, piece], [lw.shapes[total]])[0]
            g = total
        return g
    return lower


for _kind, _mode in (("reflection", "reflect"), ("replication", "replicate")):
    lowers(*(f"aten.{_kind}_pad{n}d.default" for n in (1, 2, 3)))(padded(_mode))
    lowers(*(f"aten.{_kind}_pad{n}d_backward.default" for n in (1, 2, 3)))(padded_backward(_mode))
