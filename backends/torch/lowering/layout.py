"""Views, splits, cats and the layout moves around collectives.

The layout moves DTensor wraps around a collective (an all-gather along dim
0 followed by split and cat along dim d; split along d and cat along 0
before a reduce-scatter) are folded into one collective along d, so that
every value stays a slice of some single-device value; FSDP's flat copy-in
and chunk-cat buffers are followed piece by piece and never built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.arranged import Arranged, joined
from backends.torch.lowering.bucket_pieces import bucket_view
from backends.torch.lowering.context import pg
from backends.torch.lowering.emit import cat, region_dims, take_region
from backends.torch.lowering.ir import (
    As,
    Bucket,
    ChunkCat,
    Complex,
    Flat,
    Gathered,
    GatheredAlong,
    IdRows,
    Ids,
    Packed,
    Padding,
    Pending,
    Piece,
    Stacked,
    Unpadded,
)
from backends.torch.lowering.onehot import slice_ids
from backends.torch.lowering.reduce_ops import premul_factor
from backends.torch.lowering.registry import lowers
from backends.torch.lowering.shapes import view_to
from backends.torch.lowering.uneven_shards import (
    drops_padding,
    padded_gather,
    padded_reduce,
    sliced_next,
    uneven_gather,
)

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@lowers("fsdp.all_gather_copy_in.default")
def _copy_in(lw: Lowerer, args, kwargs, shapes, group):
    parts = [lw.env.get(a[1]) if isinstance(lw.env.get(a[1]), Padding) else lw.val(a)
             for a in args[0]]
    parts = [lw.flat_of.get(p, p) if isinstance(p, int) else p for p in parts]
    if any(isinstance(p, int) and lw.shapes[p][0] * len(lw.shapes[p]) == 0 for p in parts):
        raise LoweringError(f"{lw.name}: FSDP copy-in of a shard that is not flat")
    packed = Packed(parts)
    return [packed, packed]


@lowers("c10d._allgather_base_.default")
def _allgather_base(lw: Lowerer, args, kwargs, shapes, group):
    packed = lw.env.get(args[1][1])
    if not isinstance(packed, Packed) and not isinstance(packed, (ChunkCat, str)):
        return lw.reserve(Gathered(lw.val(args[1]), pg(lw, args[2])))  # dist.all_gather_into_tensor
    if not isinstance(packed, Packed):
        raise LoweringError(f"{lw.name}: all-gather of a buffer FSDP's copy-in did not fill")
    return Packed(packed.parts, pg(lw, args[2]))


def _plain_reduce_scatter(lw: Lowerer, x: Any, op: Any, ranks: tuple[int, ...], shapes):
    """``dist.reduce_scatter_tensor(out, x)`` of a tensor (not FSDP's
    buffer): a reduce-scatter along dim 0, SUM, AVG or PREMUL_SUM(f) (the
    sum of ``f * x``)."""
    factor = premul_factor(op)
    if factor is not None:
        x = lw.val(x)
        scaled = lw.emit("mul_scalar", [x], [lw.shapes[x]], {"value": factor})[0]
        return lw.emit("reduce_scatter", [scaled], shapes[:1], {"dim": 0}, group=ranks)[0]
    if len(op) != 2 or op[1] not in (0, 1):
        raise LoweringError(f"{lw.name}: reduce-scatter with reduce op {op} is not lowered")
    return lw.emit("reduce_scatter" + ("_avg" if op[1] == 1 else ""), [lw.val(x)], shapes[:1],
                   {"dim": 0}, group=ranks)[0]


@lowers("fsdp.split_with_sizes_copy.default")
def _split_copy(lw: Lowerer, args, kwargs, shapes, group):
    packed = lw.env.get(args[0][1])
    if not isinstance(packed, Packed) or packed.group is None:
        raise LoweringError(f"{lw.name}: FSDP copy-out of a buffer that was not all-gathered")
    n = len(packed.group)
    outs = []
    for p, shape in zip(packed.parts, shapes):
        param = p.param if isinstance(p, Padding) else p
        name = lw.params.get(param)
        if name is not None and lw.trace["params"][name][1][0] % n:
            if any(a not in ("dp", "dps", "dpr") for a in lw.trace["params"][name][2][0]):
                raise LoweringError(f"{lw.name}: FSDP2 over a tensor-parallel shard of {name} "
                                    f"(dim 0 of {lw.trace['params'][name][1][0]} rows, which the "
                                    f"mesh does not divide) is not lowered")
            outs.append(Unpadded(padded_gather(lw, name, param, packed.group)))
            continue
        if isinstance(p, Padding):
            raise LoweringError(f"{lw.name}: FSDP pads a shard of a dim its group divides")
        full = (lw.shapes[p][0] * n, *lw.shapes[p][1:])
        x = lw.emit("all_gather", [p], [full], {"dim": 0}, group=packed.group)[0]
        outs.append(As(x, tuple(shape)))
    return outs


@lowers("fsdp.chunk_cat.default")
def _chunk_cat(lw: Lowerer, args, kwargs, shapes, group):
    grads = [lw.val(a) for a in args[0]]
    if int(args[1]) != 0:
        raise LoweringError(f"{lw.name}: chunk_cat along dim {args[1]} is not lowered")
    return ChunkCat(grads, int(args[2]))


@lowers("c10d._reduce_scatter_base_.default")
def _reduce_scatter_base(lw: Lowerer, args, kwargs, shapes, group):
    buf = lw.env.get(args[1][1])
    op = args[3]
    if not isinstance(buf, (ChunkCat, Packed, Gathered, str)):
        return _plain_reduce_scatter(lw, args[1], op, pg(lw, args[2]), shapes)
    if not isinstance(buf, ChunkCat):
        raise LoweringError(f"{lw.name}: reduce-scatter of a buffer chunk_cat did not fill")
    factor = premul_factor(op)
    if factor is None and op not in (["redop", 0], ("redop", 0), ["redop", 1], ("redop", 1)):
        raise LoweringError(f"{lw.name}: reduce-scatter with reduce op {op} is not lowered")
    g = pg(lw, args[2])
    if len(g) != buf.chunks:
        raise LoweringError(f"{lw.name}: reduce-scatter of {buf.chunks} chunks over {len(g)} ranks")
    if factor is not None:  # the sum of f * x: the sum divided by 1 / f
        if factor == 0.0:
            raise LoweringError(f"{lw.name}: reduce-scatter with PREMUL_SUM(0) is not lowered")
        return ChunkCat(buf.grads, buf.chunks, g, buf.divide / factor)
    return ChunkCat(buf.grads, buf.chunks, g, buf.divide * (float(buf.chunks) if op[1] == 1 else 1.0))


@lowers("aten.as_strided.default")
def _as_strided(lw: Lowerer, args, kwargs, shapes, group):
    src = lw.env.get(args[0][1])
    size, stride = list(args[1]), list(args[2])
    offset = int(args[3]) if len(args) > 3 and args[3] is not None else 0
    contiguous = [math.prod(size[k + 1:]) for k in range(len(size))]
    block = kwargs.get("block")
    x = lw.env.get(args[0][1])
    if block is not None and isinstance(x, As) \
            and (offset != 0 or math.prod(size) != math.prod(x.shape)
                 or any(s != c for s, c, n in zip(stride, contiguous, size) if n > 1)):
        # a region of a value seen with another shape: the value, reshaped
        # (what ``As`` stands for), then the region (soundness 134 (e))
        x = lw.materialize(x)
    if block is not None and isinstance(x, int) \
            and (offset != 0 or math.prod(size) != math.prod(lw.shapes[x])
                 or any(s != c for s, c, n in zip(stride, contiguous, size) if n > 1)):
        # a region of a contiguous input, as the recorder found it: the
        # input seen with the region's base shape, narrowed (every step-th
        # entry along a strided dim), seen with the view's shape
        # (soundness.md, "Plans traced from PyTorch", 39d and 50)
        sizes, region = block[0], region_dims(block[1])
        x = lw.reshape(x, tuple(sizes))
        x = take_region(lw, x, [start for start, _, _, _ in region],
                        [length for _, length, _, _ in region], [step for _, _, _, step in region])
        # the view's dims of size > 1, in the base's order, then in the view's
        mapped = [(at, length) for _, length, at, _ in region if at >= 0]
        x = lw.materialize(view_to(lw, x, tuple(length for _, length in mapped)))
        # x's dim k is the view's dim order[k]: the view is x permuted by
        # the inverse order
        order = [at for at, _ in mapped]
        current = list(range(len(order)))
        for k in range(len(order)):
            j = current.index(order.index(k))
            if j != k:
                shape = list(lw.shapes[x])
                shape[j], shape[k] = shape[k], shape[j]
                x = lw.emit("transpose", [x], [tuple(shape)], {"dim0": k, "dim1": j})[0]
                current[j], current[k] = current[k], current[j]
        return view_to(lw, x, tuple(size))
    if any(s != c for s, c, n in zip(stride, contiguous, size) if n > 1):
        raise LoweringError(f"{lw.name}: as_strided with strides {stride} is not lowered")
    if isinstance(src, Bucket):
        return bucket_view(lw, src, offset, tuple(size))
    if isinstance(src, As) and offset == 0 and tuple(size) == lw.shapes[src.x]:
        return src.x
    if isinstance(src, Unpadded):
        if offset != 0 or tuple(size) != lw.shapes[src.x]:
            raise LoweringError(f"{lw.name}: a view of FSDP's all-gather output of a padded "
                                f"parameter at offset {offset} is not lowered")
        return src.x
    if isinstance(src, ChunkCat) and (src.group is not None or src.chunks == 1):
        # reduce-scattered, or (a shard group of one rank) never communicated
        at = 0
        for g in src.grads:
            rows, *rest = lw.shapes[g]
            if rows % src.chunks:  # each rank's chunk padded with zero rows
                if at == offset:
                    return padded_reduce(lw, src, g, size)
                at += -(-rows // src.chunks) * math.prod(rest)
                continue
            numel = math.prod(lw.shapes[g]) // src.chunks
            if at == offset and numel == math.prod(size):
                shape = list(lw.shapes[g])
                shape[0] //= src.chunks
                x = g
                if src.group is not None:
                    x = lw.emit("reduce_scatter", [g], [shape], {"dim": 0}, group=src.group)[0]
                if src.replicas is not None:
                    x = lw.emit("all_reduce", [x], [shape], group=src.replicas)[0]
                if src.divide != 1.0:
                    x = lw.emit("div", [x], [shape], {"value": src.divide})[0]
                return view_to(lw, x, tuple(size))
            at += numel
        raise LoweringError(f"{lw.name}: a view of FSDP's reduce-scatter output at offset "
                            f"{offset} is not one gradient's shard")
    x = lw.val(args[0])
    if offset != 0 or math.prod(size) != math.prod(lw.shapes[x]):
        raise LoweringError(f"{lw.name}: as_strided at offset {offset} is not lowered")
    if x in lw.flat_of and lw.shapes[lw.flat_of[x]] == tuple(size):
        return lw.flat_of[x]  # a flattened value seen whole again (FSDP of one rank)
    return view_to(lw, x, tuple(size))


@lowers("aten.t.default")
def _t(lw: Lowerer, args, kwargs, shapes, group):
    f = lw.env.get(args[0][1])
    if isinstance(f, Arranged) and f.pos.ndim == 2:
        return f.permuted([1, 0])
    x = lw.val(args[0])
    if len(lw.shapes[x]) < 2:
        return x
    return lw.emit("transpose", [x], shapes, {"dim0": 0, "dim1": 1})[0]


@lowers("aten.transpose.int")
def _transpose(lw: Lowerer, args, kwargs, shapes, group):
    f = lw.env.get(args[0][1])
    if isinstance(f, Arranged):
        order = list(range(f.pos.ndim))
        d0, d1 = int(args[1]) % len(order), int(args[2]) % len(order)
        order[d0], order[d1] = order[d1], order[d0]
        return f.permuted(order)
    if isinstance(f, Flat) and int(args[1]) % 3 and int(args[2]) % 3 and len(shapes[0]) == 3:
        d0, d1 = int(args[1]) % 3 + f.k - 1, int(args[2]) % 3 + f.k - 1
        shape = list(lw.shapes[f.x])
        shape[d0], shape[d1] = shape[d1], shape[d0]
        return Flat(lw.emit("transpose", [f.x], [shape], {"dim0": d0, "dim1": d1})[0], f.k)
    x = lw.val(args[0])
    nd = len(lw.shapes[x])
    d0, d1 = int(args[1]) % nd, int(args[2]) % nd
    if d0 == d1:
        return x
    return lw.emit("transpose", [x], shapes, {"dim0": d0, "dim1": d1})[0]


def _gathered_dim(src: tuple[int, ...], dst: tuple[int, ...], n: int) -> int | None:
    """The dim k along which an all-gather (along dim 0) of ``src`` pieces,
    seen with shape ``dst``, is an all-gather along k: ``dst`` is ``src``
    with dim k n times longer and every dim before k of size 1 (the ranks'
    pieces then lie one after another along k; DTensor's gather of a
    one-row batch along the sequence is such a view)."""
    if len(src) != len(dst):
        return None
    grown = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(grown) != 1:
        return None
    k = grown[0]
    return k if dst[k] == n * src[k] and all(a == 1 for a in src[:k]) else None


@lowers(
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",)
def _view(lw: Lowerer, args, kwargs, shapes, group):
    f = lw.env.get(args[0][1])
    dst = tuple(shapes[0])
    if isinstance(f, Ids):
        return Ids(f.source, f.index, f.parts, dst)
    if isinstance(f, Arranged):
        return f.viewed(dst)
    if isinstance(f, Narrowed) and _narrowed_shape(lw, f) == dst:
        return f  # a view of a piece as it is (an autograd identity's output)
    if isinstance(f, Gathered) and not f.padded:
        k = _gathered_dim(lw.shapes[f.x], dst, len(f.group))
        if k is not None:
            return f.gather(lw, k, dst)
    if isinstance(f, IdRows):
        return IdRows(lw.reshape(f.x, (*dst, lw.vocab)), f.ids.reshape(dst))
    if isinstance(f, (Flat, As)) and lw.shapes[f.x] == dst:
        return f.x
    if isinstance(f, As):
        return As(f.x, dst)
    if isinstance(f, (Packed, ChunkCat, Unpadded)) or f == "empty":
        return f
    if isinstance(f, Complex):
        return Complex(lw.reshape(f.re, dst), lw.reshape(f.im, dst))
    return view_to(lw, lw.val(args[0]), dst)


@lowers("aten.expand.default")
def _expand(lw: Lowerer, args, kwargs, shapes, group):
    x = lw.val(args[0])
    if lw.shapes[x] == tuple(shapes[0]):
        return x
    return lw.emit("expand", [x], shapes, {"shape": list(shapes[0])})[0]


@lowers("aten.split.Tensor", "aten.split_with_sizes.default")
def _split(lw: Lowerer, args, kwargs, shapes, group):
    """Equal pieces (``split``, ``chunk``) stay pieces until read (DTensor's
    and FSDP's layouts fold them away); unequal ones are ``narrow`` nodes."""
    src = lw.env.get(args[0][1])
    dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", 0))
    n = len(shapes)
    if len({tuple(s) for s in shapes}) != 1:
        if isinstance(src, Ids):
            raise LoweringError(f"{lw.name}: integer ids split into unequal pieces")
        x = lw.val(args[0])
        dim %= len(lw.shapes[x])
        outs, at = [], 0
        for shape in shapes:
            size = shape[dim]
            outs.append(Narrowed(x, dim, at, size))
            at += size
        return outs
    if isinstance(src, Ids) and dim == 0 and src.shape is None:
        return [src.cut(i, n) for i in range(n)]
    if n == 1:
        return lw.val(args[0])
    if isinstance(src, Gathered) and dim == 0 and n == len(src.group):
        return [Piece(src, 0, i, n) for i in range(n)]
    x = lw.val(args[0])
    return [Piece(x, dim % len(lw.shapes[x]), i, n) for i in range(n)]


@lowers("aten.slice.Tensor")
def _slice(lw: Lowerer, args, kwargs, shapes, group):
    """A slice that is one of equal pieces (a schedule's microbatch); of
    an all-gather, its first rows (DTensor's gather of an uneven shard)."""
    src = lw.env.get(args[0][1])
    dim, start = (int(args[1]) if len(args) > 1 else 0), (args[2] if len(args) > 2 else 0) or 0
    if isinstance(src, GatheredAlong) and dim % len(shapes[0]) == src.dim and start == 0 \
            and drops_padding(lw, src, shapes[0][src.dim],
                               lw.trace["shapes"][args[0][1]][src.dim]):
        return uneven_gather(lw, src, shapes[0][src.dim])
    step = args[4] if len(args) > 4 else 1
    if isinstance(src, Ids) and (dim != 0 or src.shape is not None) or isinstance(src, IdRows):
        return slice_ids(lw, args, shapes)
    if isinstance(src, Bucket) and step == 1 and dim == 0:
        return bucket_view(lw, src, int(start), tuple(shapes[0]))
    if isinstance(src, Ids):
        total = lw.trace["data"][1][0] // src.parts
    else:
        x = lw.val(args[0])
        dim %= len(lw.shapes[x])
        total = lw.shapes[x][dim]
    size = shapes[0][dim]
    start = start + total if start < 0 else start
    part = None if isinstance(src, Ids) or step != 1 or not size \
        else _cat_part(lw, Narrowed(x, dim, start, size))
    if part is not None:
        return part
    if step == 1 and size and not isinstance(src, Ids) and (total % size or start % size):
        return Narrowed(x, dim, start, size).materialize(lw)
    if step != 1 or size == 0 or total % size or start % size:
        raise LoweringError(f"{lw.name}: a slice of dim {dim} at {start} that is not one of "
                            f"equal pieces")
    index, parts = start // size, total // size
    if isinstance(src, Ids):
        return src.cut(index, parts)
    return x if parts == 1 else Piece(x, dim, index, parts)


@dataclass(frozen=True)
class Narrowed(Pending):
    """A piece of an unequal split (``x.split([a, b], dim)``): the ``narrow``
    of ``length`` at ``start``, emitted once when read (every reader of the
    piece reads one node, as for ``Piece``); a ``cat`` of all the pieces in
    order reads none of them (``_rejoined``)."""
    x: int
    dim: int
    start: int
    length: int

    def materialize(self, lw: Lowerer) -> int:
        key = (self.x, self.dim, self.start, self.length)
        part = _cat_part(lw, self)
        if part is not None:
            return part
        if key not in lw.narrows:
            lw.narrows[key] = lw.emit("narrow", [self.x], [_narrowed_shape(lw, self)],
                                      {"dim": self.dim, "start": self.start,
                                       "length": self.length})[0]
        return lw.narrows[key]


def _cat_part(lw: Lowerer, f: Narrowed) -> int | None:
    """The parts of a ``cat`` along the piece's dim that the piece is exactly
    (``cat([a, b])[len(a):]`` is b; autograd's backward of a ``cat`` slices
    the gradient at the parts' bounds), joined when several; else None."""
    dim, parts = lw.cats.get(f.x, (None, ()))
    if dim != f.dim:
        return None
    at, chosen = 0, []
    for p in parts:
        if at >= f.start and at + lw.shapes[p][dim] <= f.start + f.length:
            chosen.append(p)
        elif at < f.start + f.length and at + lw.shapes[p][dim] > f.start:
            return None  # the piece cuts this part
        at += lw.shapes[p][dim]
    if not chosen or sum(lw.shapes[p][dim] for p in chosen) != f.length:
        return None
    return chosen[0] if len(chosen) == 1 else cat(lw, chosen, dim)


def _narrowed_shape(lw: Lowerer, f: Narrowed) -> tuple[int, ...]:
    shape = list(lw.shapes[f.x])
    shape[f.dim] = f.length
    return tuple(shape)


def _rejoined(lw: Lowerer, items: list, dim: int) -> int | None:
    """The source of the pieces when ``items`` are an unequal split's pieces
    of one value along ``dim``, all of them in order: ``cat(x.split([a, b]))``
    is x (transformers' MLA projection splits its output, passes one part
    through an identity, and joins them); else None."""
    if len(items) < 2 or not all(isinstance(p, Narrowed) for p in items):
        return None
    at = 0
    for p in items:
        if p.x != items[0].x or p.dim != dim or p.start != at:
            return None
        at += p.length
    return items[0].x if at == lw.shapes[items[0].x][dim] else None


@lowers("aten.cat.default")
def _cat(lw: Lowerer, args, kwargs, shapes, group):
    items = [lw.env.get(a[1]) for a in args[0]]
    dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
    first = items[0]
    if all(isinstance(p, Arranged) for p in items) and first.joins(items[1:]):
        return joined(items, dim % first.pos.ndim)  # one all-to-all's outputs, joined
    if all(isinstance(p, Piece) for p in items) and [p.index for p in items] == list(range(len(items))) \
            and all(p.of is first.of for p in items) and len(items) == first.parts:
        if isinstance(first.of, Gathered):
            along = GatheredAlong(first.of, dim % len(shapes[0]))
            return along if sliced_next(lw, along.dim) else lw.materialize(along)
        if dim == 0:
            return Stacked(first.of, first.dim, first.parts)
        if dim % len(shapes[0]) == first.dim:
            return first.of
    if any(isinstance(p, (Gathered, Packed, ChunkCat)) for p in items):
        raise LoweringError(f"{lw.name}: cat of a collective's buffer is not lowered")
    whole = _rejoined(lw, items, dim % len(shapes[0]))
    if whole is not None:
        return whole
    parts = [lw.val(a) for a in args[0]]
    if len(parts) > 1 and all(len(s) == 1 for s in shapes) and all(p in lw.flat_of for p in parts):
        # flattened tensors side by side (a flat gradient bucket by hand)
        return Bucket(tuple(lw.flat_of[p] for p in parts))
    if len(parts) == 1:
        return parts[0]
    out = lw.emit("cat", parts, shapes, {"dim": dim % len(shapes[0])})[0]
    lw.cats[out] = (dim % len(shapes[0]), tuple(parts))
    return out


@lowers("aten.permute.default")
def _permute(lw: Lowerer, args, kwargs, shapes, group):
    """A permutation as the transposes that sort it."""
    f = lw.env.get(args[0][1])
    if isinstance(f, Arranged):
        return f.permuted([int(d) % f.pos.ndim for d in args[1]])
    x = lw.val(args[0])
    order = [int(d) % len(lw.shapes[x]) for d in args[1]]
    current = list(range(len(order)))
    for pos, want in enumerate(order):
        at = current.index(want)
        if at != pos:
            shape = list(lw.shapes[x])
            shape[pos], shape[at] = shape[at], shape[pos]
            x = lw.emit("transpose", [x], [shape], {"dim0": pos, "dim1": at})[0]
            current[pos], current[at] = current[at], current[pos]
    return x


@lowers("unknown")
def unknown(lw: Lowerer, args, kwargs, shapes, group):
    """An op the recorder could not name: its outputs are never read as values."""
    return None


@lowers("aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default")
def empty(lw: Lowerer, args, kwargs, shapes, group):
    """An uninitialized buffer, written before it is read (FSDP's)."""
    return "empty"


@lowers("fsdp.padded_shard")
def padded_shard(lw: Lowerer, args, kwargs, shapes, group):
    return Padding(args[0][1])

