"""Flat packs of tensors moved whole by a collective: ``torch.cat`` of
flattened tensors (an ``ir.Bucket``) all-gathered or sent round a ring by
an all-to-all, then cut back into the tensors (a chunk per member, a slice
per tensor, a reshape). PyTorch's ring attention moves its keys and values
so (``cat([k.flatten(), v.flatten()])``, ``_AllGatherRotater``,
``_AllToAllRotater``) and its backward the keys' and values' gradients.

The collective is written as its definition with point-to-point
operators, piece by piece (docs/soundness.md, "Plans traced from
PyTorch", 53): an all-gather sends each of the rank's pieces to
every other member and receives each member's pieces (``Gathers``, whose
chunk per member is that member's ``Bucket``); an all-to-all whose input
splits send the whole pack to one member and whose output splits take a
whole pack from one member (``permute_tensor``) sends the pieces to the
one and receives the other's. A received piece is the sender's value
(the build claims it as the sender's piece), so what a rank computes with
a received key is proved against that rank's chunk of the single-device
keys, never assumed. Every member emits its sends and receives where the
collective was recorded, whether or not it reads the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import LNode
from backends.torch.lowering.ir import Bucket, numel
from backends.torch.lowering.registry import Handler, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class Gathers:
    """An all-gathered pack: each member's pieces, in group order (read by a
    chunk into one part per member)."""
    group: tuple[int, ...]
    packs: tuple[Bucket, ...]


def _bucket(lw: Lowerer, a) -> Bucket | None:
    x = lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" else None
    return x if isinstance(x, Bucket) else None


def _send(lw: Lowerer, v: int, dst: int) -> None:
    me = lw.trace["rank"]
    lw.nodes.append(LNode("send", "fw", [v], [], {}, lw.name, (me, dst), lw.mb))


def _receive(lw: Lowerer, like: Bucket, src: int) -> Bucket:
    """A pack of ``src``'s pieces, shaped as this rank's (the collective
    moves packs of one size)."""
    me = lw.trace["rank"]
    return Bucket(tuple(lw.emit("send_recv", [], [lw.shapes[p]], {"src": src, "dst": me},
                                group=(src, me))[0] for p in like.pieces))


def _exchange(lw: Lowerer, pack: Bucket, group: tuple[int, ...]) -> Gathers:
    me = lw.trace["rank"]
    for dst in group:
        if dst != me:
            for p in pack.pieces:
                _send(lw, p, dst)
    return Gathers(group, tuple(pack if src == me else _receive(lw, pack, src) for src in group))


def all_gather_pack(base: Handler) -> Handler:
    """An all-gather of a pack along dim 0: every member's pieces."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        pack = _bucket(lw, args[0])
        if pack is None:
            return base(lw, args, kwargs, shapes, group)
        if len(group) == 1:
            return pack
        return _exchange(lw, pack, tuple(group))
    return lower


refines("_c10d_functional.all_gather_into_tensor.default")(all_gather_pack)
refines("_c10d_functional_autograd.all_gather_into_tensor.default")(all_gather_pack)


def _whole_to_one(splits, total: int, group: tuple[int, ...], what: str) -> int | None:
    """The member a pack goes to (input splits) or comes from (output
    splits) whole; None when the splits cut it."""
    sizes = [int(s) for s in splits] if splits else []
    if len(sizes) != len(group) or sum(sizes) != total:
        raise LoweringError(f"an all-to-all of a pack of {total} elements with {what} split "
                            f"sizes {sizes} over {len(group)} members")
    whole = [i for i, s in enumerate(sizes) if s]
    return group[whole[0]] if len(whole) == 1 else None


def all_to_all_pack(base: Handler) -> Handler:
    """An all-to-all of a pack that sends it whole to one member and takes
    a whole pack from one member (``permute_tensor``: a ring's step)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        pack = _bucket(lw, args[0])
        if pack is None:
            return base(lw, args, kwargs, shapes, group)
        group = tuple(group)
        total = sum(numel(lw, p) for p in pack.pieces)
        dst = _whole_to_one(args[2], total, group, "input")
        src = _whole_to_one(args[1], math.prod(shapes[0]), group, "output")
        if dst is None or src is None or math.prod(shapes[0]) != total:
            raise LoweringError(f"{lw.name}: an all-to-all that cuts a pack of flattened tensors "
                                f"is not lowered (a whole pack to one member, from one member, is)")
        lw.all_to_alls[group] = lw.all_to_alls.get(group, 0) + 1
        me = lw.trace["rank"]
        if dst != me:
            for p in pack.pieces:
                _send(lw, p, dst)
        return pack if src == me else _receive(lw, pack, src)
    return lower


refines("_c10d_functional.all_to_all_single.default")(all_to_all_pack)
refines("_c10d_functional_autograd.all_to_all_single.default")(all_to_all_pack)


@refines("aten.chunk.default")
def chunk_gathers(base: Handler) -> Handler:
    """An all-gathered pack cut into one chunk per member: that member's pack."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        x = lw.env.get(args[0][1])
        if not isinstance(x, Gathers):
            return base(lw, args, kwargs, shapes, group)
        dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", 0))
        if dim != 0 or len(shapes) != len(x.packs):
            raise LoweringError(f"{lw.name}: an all-gathered pack cut into {len(shapes)} chunks "
                                f"along dim {dim}, not one per member along dim 0")
        return list(x.packs)
    return lower


def cast_pack(base: Handler) -> Handler:
    """A pack cast to another floating type: the same pieces (a cast is the
    identity in exact arithmetic)."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        pack = _bucket(lw, args[0])
        if pack is None:
            return base(lw, args, kwargs, shapes, group)
        dtype = str(args[1] if len(args) > 1 else kwargs.get("dtype", ""))
        if "float" not in dtype and "double" not in dtype:
            raise LoweringError(f"{lw.name}: a pack of tensors converted to {dtype}")
        return pack
    return lower


refines("aten.to.dtype")(cast_pack)
refines("aten._to_copy.default")(cast_pack)
