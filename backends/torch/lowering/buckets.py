"""Lowering of flat gradient buckets (``DistributedDataParallel``'s
reducer, its comm hooks) and of the buffer broadcasts DDP runs.

A bucket is read from memory the reducer wrote gradient by gradient
(``backends/torch/hidden_memory.py``: a ``mem.cat`` of the values written
into it). It stays a ``Bucket``, the list of its pieces, and is never
built: an elementwise op on it (the hook's division by the world size) is
applied to each piece, its all-reduce is one all-reduce per piece, and a
view of it at a piece's offset (the copy back into the gradient) is that
piece. docs/soundness.md, "Plans traced from PyTorch", 19, says why this
is the same computation: an all-reduce is elementwise across the group,
and the members' buckets are cut at the same offsets
(``check_bucket_layouts``). A bucket reduce-scattered into equal ranges
(Megatron's distributed optimizer) is every piece all-reduced, of which the
member keeps its range (``flat_ranges``; items 56 and 57). A broadcast is
lowered only when it sends constants every member holds alike
(``check_broadcasts``; item 20).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.bucket_pieces import all_reduce_bucket, bucket_view
from backends.torch.lowering.context import live_events, pg
from backends.torch.lowering.flat_ranges import (
    Block,
    FlatRange,
    parts_of,
    pick,
    read_flat,
    whole_pieces,
)
from backends.torch.lowering.ir import Bucket, numel
from backends.torch.lowering.registry import lowers

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@lowers("mem.cat")
def mem_cat(lw: Lowerer, args, kwargs, shapes, group) -> Bucket:
    """The regions a buffer was written as, side by side."""
    pieces: list[int] = []
    for a in args[0]:
        item = lw.env.get(a[1])
        pieces.extend(item.pieces if isinstance(item, Bucket) else [lw.val(a)])
    return Bucket(tuple(pieces))


@lowers("mem.slice")
def mem_slice(lw: Lowerer, args, kwargs, shapes, group) -> Any:
    """A view of part of a region (a gradient's view of a reduced bucket)."""
    src = lw.env.get(args[0][1])
    if isinstance(src, Bucket) and whole_pieces(lw, src, int(args[1]), tuple(args[2])):
        return bucket_view(lw, src, int(args[1]), tuple(args[2]))
    if isinstance(src, (Bucket, FlatRange, Block)):
        # a view of a reduce-scattered range, or of a bucket across or inside
        # its pieces (built as bucket_view builds it when another op reads it)
        return read_flat(lw, src, int(args[1]), tuple(args[2]))
    x = lw.val(args[0])
    if int(args[1]) != 0 or math.prod(args[2]) != numel(lw, x) \
            or x in lw.params and len(args[2]) == 1 < len(lw.shapes[x]):
        # what a write into part of a region leaves of its value: its elements
        # there; a parameter's region seen flat, a range of it (item 90)
        return read_flat(lw, x, int(args[1]), tuple(args[2]))
    if len(args[2]) == 1 < len(lw.shapes[x]):
        # any other whole value seen flat (a bucket of one gradient): its
        # elements kept a range, not flattened, so that a scaling and a
        # reduce-scatter of it are the value's (item 108 (a))
        return FlatRange(((x, 0, numel(lw, x)),))
    return lw.reshape(x, tuple(args[2]))


@lowers("c10d.reduce_scatter_tensor_coalesced_.default")
def reduce_scatter_buckets(lw: Lowerer, args, kwargs, shapes, group) -> list:
    """Each input a gradient bucket reduce-scattered over the group with SUM
    or AVG into its output (Megatron's distributed optimizer): every piece
    all-reduced but the padding's zeros, which a sum leaves zeros
    (``all_reduce_bucket``), the member keeping the elements of its range,
    the i-th of the group's equal ranges for its position i in the group
    (``flat_ranges``; docs/soundness.md, "Plans traced from PyTorch", 56)."""
    ins, ranks, op = args[1], pg(lw, args[2]), args[3]
    if lw.trace["rank"] not in ranks:
        raise LoweringError(f"{lw.name}: a reduce-scatter over a group without this rank")
    i = ranks.index(lw.trace["rank"])
    result = []
    for a, shape in zip(ins, shapes):
        bucket = _flat_source(lw, a)
        total, size = sum(numel(lw, p) for p in bucket.pieces), math.prod(shape)
        if size * len(ranks) != total:
            raise LoweringError(f"{lw.name}: a reduce-scatter of {total} elements into ranges of "
                                f"{size} over {len(ranks)} ranks")
        zeros = frozenset(p for p in bucket.pieces if p in lw.zeros_made)
        reduced = all_reduce_bucket(lw, bucket, op, ranks, zeros)
        result.append(FlatRange(tuple(pick(parts_of(lw, reduced), i * size, size)), None,
                                tuple(ranks)))
    return result


def _flat_source(lw: Lowerer, a: Any) -> Bucket:
    """The reduce-scatter's input as the pieces it holds side by side: a
    bucket's, or one value whole (a bucket of one gradient and no padding,
    as Megatron's own bucket of the shared embedding at pipeline size > 1;
    a flattened value as the value it flattens, the same elements in the
    same order): docs/soundness.md, "Plans traced from PyTorch", 108 (a)."""
    item = lw.env.get(a[1])
    if isinstance(item, Bucket):
        return item
    if isinstance(item, FlatRange) and item.source is None \
            and all((lo, hi) == (0, numel(lw, v)) for v, lo, hi in item.parts):
        return Bucket(tuple(v for v, _, _ in item.parts))
    if isinstance(item, int):
        v = lw.val(a)
        return Bucket((lw.flat_of.get(v, v),))
    raise LoweringError(f"{lw.name}: a coalesced reduce-scatter of a tensor that is neither a "
                        f"gradient bucket nor one value whole is not lowered")


@lowers("c10d.broadcast_.default")
def broadcast(lw: Lowerer, args, kwargs, shapes, group) -> list:
    """``broadcast_`` of constants (DDP's buffers, every forward): each
    member keeps the value it holds, the root's (``check_broadcasts``)."""
    tensors = args[0]
    constants = lw.trace.get("constants", set())
    if any(v in lw.trace.get("answers", {}) for v in lw.trace["events"][lw.event][2]):
        raise LoweringError(f"{lw.name}: a broadcast of a number computed in the step (not a "
                            f"count of kept labels) is not lowered")
    if not all(t[1] in constants for t in tensors):
        raise LoweringError(f"{lw.name}: a broadcast of values computed in the step (not "
                            f"constants) is not lowered")
    return [lw.val(t) for t in tensors]


def check_bucket_layouts(lows: list) -> None:
    """Every member of a bucket's all-reduce cuts its k-th bucket on that
    group at the same offsets (docs/soundness.md, "Plans traced from
    PyTorch", 19)."""
    seen: dict[tuple[tuple[int, ...], int], tuple[int, tuple[int, ...]]] = {}
    for low in lows:
        count: dict[tuple[int, ...], int] = {}
        for ranks, layout in low.buckets:
            k = count[ranks] = count.get(ranks, -1) + 1
            first = seen.setdefault((ranks, k), (low.rank, layout))
            if first[1] != layout:
                raise LoweringError(f"rank {low.rank}'s gradient bucket {k} on ranks {ranks} "
                                    f"holds gradients of sizes {layout}, rank {first[0]}'s "
                                    f"{first[1]}: an all-reduce would add unrelated elements")


def check_broadcasts(traces: list[dict]) -> None:
    """Every member of a broadcast of constants holds, in its k-th
    broadcast on that group, the root's values (docs/soundness.md, "Plans
    traced from PyTorch", 20): the broadcast then changes nothing. Only
    broadcasts the loss or the gradients depend on are checked (DDP's
    exchange of shapes at its construction is not). A broadcast of one
    number that the trace answered (``exchange.Exchanges.broadcast``: every
    member then holds the root's number) is not: its members' numbers
    before it differ, and it is lowered as the root's."""
    sent: dict[tuple, list] = {}
    for t in traces:
        count: dict[tuple, int] = {}
        live = live_events(t)
        for i, (op, (args, _), outs, *_) in enumerate(t["events"]):
            if op != "c10d.broadcast_.default" or i not in live \
                    or any(v in t.get("answers", {}) for v in outs):
                continue
            ranks = tuple(args[1][1])
            k = count[ranks] = count.get(ranks, -1) + 1
            values = [t.get("constvals", {}).get(a[1]) for a in args[0]]
            sent.setdefault((ranks, k), []).append((t["rank"], values))
    for (ranks, k), members in sent.items():
        ref_rank, ref = members[0]
        for rank, values in members[1:]:
            same = len(values) == len(ref) and all(
                a is not None and b is not None and a.shape == b.shape and np.array_equal(a, b)
                for a, b in zip(values, ref))
            if not same:
                raise LoweringError(f"broadcast {k} on ranks {ranks}: rank {rank} holds other "
                                    f"values than rank {ref_rank} (or values not kept): not "
                                    f"lowered")


