"""Lowering of a 2-d matmul of a 3-d value with its two leading dims merged
(``x.view(a * b, c) @ w``, the linear layers of a model whose activations
are sequence first, ``[s, b, h]``: Megatron-Core's layout);
docs/soundness.md, "Plans traced from PyTorch", 35 (g).

The merged view is kept 3-d (``ir.Merged``) while only ``mm`` (directly or
through ``t``), a bias gradient's ``sum(0)`` or a pick reads it:
``[ab, c] @ [c, n]`` is ``einsum("abc,cn->abn")``, ``[n, ab] @ [ab, c]`` is
``einsum("abn,abc->nc")``, ``sum(0)`` a sum over both leading dims. Each is
an identity for every value; a cut of the batch dim, the inner of the two
merged, then stays a piece. Any other reader gets the flattened value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.torch.lowering.context import tensor_args
from backends.torch.lowering.ir import Bucket, Merged, PatternOnly
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def _readers(lw: Lowerer, value: int) -> list[tuple]:
    """The events after the current one that read ``value``."""
    return [e for e in lw.trace["events"][lw.event + 1:] if value in tensor_args(e[1])]


def _only_mm_reads(lw: Lowerer, value: int) -> bool:
    readers = _readers(lw, value)
    for e in readers:
        if e[0] == "aten.t.default":
            if not all(r[0] == "aten.mm.default" for r in _readers(lw, e[2][0])):
                return False
        elif e[0] == "aten.sum.dim_IntList":
            dims = e[1][0][1] if len(e[1][0]) > 1 else None
            keep = e[1][0][2] if len(e[1][0]) > 2 else False
            if list(dims or []) != [0] or keep:
                return False
        elif e[0] not in ("aten.mm.default", "aten.index.Tensor", "aten.index_put_.default"):
            return False
    return bool(readers)


def view_merged(base: Handler) -> Handler:
    """``x.view(a * b, c)`` of a 3-d ``x`` read only by ``mm`` (``Merged``), in
    the step of a model whose activations are sequence first (the trace's
    ``sequence_first``), where the batch dim is the inner one of the two
    merged; the 3-d product seen again as ``[a, b, n]``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x, dst = lw.env.get(args[0][1]), tuple(shapes[0])
        if isinstance(x, Merged) and not x.transposed and len(dst) == 3 \
                and tuple(lw.shapes[x.x]) == dst:
            return x.x
        recorded = args[0][1] < len(lw.trace["shapes"])  # not a row-wise rule's stand-in
        if x is not None and not isinstance(x, (PatternOnly, Merged, Bucket)) and recorded \
                and lw.trace.get("sequence_first") and len(dst) == 2:
            outs = lw.trace["events"][lw.event][2]
            shape = tuple(lw.trace["shapes"][args[0][1]])
            if len(shape) == 3 and dst == (shape[0] * shape[1], shape[2]) \
                    and _only_mm_reads(lw, outs[0]):
                return Merged(lw.val(args[0]))  # a pending gather is emitted here
        return base(lw, args, kwargs, shapes, group)
    return lower


refines("aten.view.default", "aten._unsafe_view.default")(view_merged)


@refines("aten.t.default")
def t_merged(base: Handler) -> Handler:
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.env.get(args[0][1])
        if isinstance(x, Merged) and not x.transposed:
            return Merged(x.x, True)
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.mm.default")
def mm_merged(base: Handler) -> Handler:
    """``mm`` of merged values as one ``einsum`` over the 3-d values:
    ``[ab, c] @ [c, n]`` is ``abc,cn->abn`` (seen as ``[a, b, n]``, a
    ``Merged`` value), ``[n, ab] @ [ab, c]`` is ``abn,abc->nc``."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x, y = lw.env.get(args[0][1]), lw.env.get(args[1][1])
        if isinstance(x, Merged) and not x.transposed and isinstance(y, int):
            a, b, c = lw.shapes[x.x]
            n = lw.shapes[lw.val(args[1])][1]
            out = lw.emit("einsum", [x.x, lw.val(args[1])], [(a, b, n)], {"eq": "abc,cn->abn"})[0]
            return Merged(out)
        if isinstance(x, Merged) and x.transposed and isinstance(y, Merged) \
                and not y.transposed and lw.shapes[x.x][:2] == lw.shapes[y.x][:2]:
            n, c = lw.shapes[x.x][2], lw.shapes[y.x][2]
            return lw.emit("einsum", [x.x, y.x], [(n, c)], {"eq": "abn,abc->nc"})[0]
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.sum.dim_IntList")
def sum_merged(base: Handler) -> Handler:
    """``sum(x.view(a * b, c), 0)`` (a bias's gradient): the sum over both
    leading dims of x."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        if isinstance(x, Merged) and not x.transposed:
            return lw.emit("sum", [x.x], shapes, {"dim": [0, 1], "keepdim": False})[0]
        return base(lw, args, kwargs, shapes, group)
    return lower
