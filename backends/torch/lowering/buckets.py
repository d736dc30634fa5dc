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
(``check_bucket_layouts``). A broadcast is lowered only when it sends
constants every member holds alike (``check_broadcasts``; item 20).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.torch.errors import LoweringError

#: elementwise ops a bucket may go through (a comm hook's ``div_``, the
#: reducer's ``mul.out`` by 1 / world size), applied piece by piece
PER_PIECE_OPS = frozenset({
    "aten.div_.Scalar", "aten.div_.Tensor", "aten.div.Scalar", "aten.div.Tensor",
    "aten.mul_.Scalar", "aten.mul_.Tensor", "aten.mul.Scalar", "aten.mul.Tensor", "aten.mul.out",
})


@dataclass(frozen=True)
class Bucket:
    """A flat buffer made of ``pieces`` (lowered values, each with its own
    shape) side by side, in memory order."""
    pieces: tuple[int, ...]

    def emit_into(self, lw: Any) -> int:
        """The bucket built, when an op reads it whole: the pieces
        flattened and concatenated."""
        flat = [lw.reshape(p, (_numel(lw, p),)) for p in self.pieces]
        return lw.emit("cat", flat, [(sum(_numel(lw, p) for p in self.pieces),)], {"dim": 0})[0]


def _numel(lw: Any, x: int) -> int:
    return math.prod(lw.shapes[x])


def mem_cat(lw: Any, args, kwargs, shapes, group) -> Bucket:
    """The regions a buffer was written as, side by side."""
    pieces: list[int] = []
    for a in args[0]:
        item = lw.env.get(a[1])
        pieces.extend(item.pieces if isinstance(item, Bucket) else [lw.val(a)])
    return Bucket(tuple(pieces))


def mem_slice(lw: Any, args, kwargs, shapes, group) -> Any:
    """A view of part of a region (a gradient's view of a reduced bucket)."""
    src = lw.env.get(args[0][1])
    if isinstance(src, Bucket):
        return bucket_view(lw, src, int(args[1]), tuple(args[2]))
    x = lw.val(args[0])
    if int(args[1]) != 0 or math.prod(args[2]) != _numel(lw, x):
        raise LoweringError(f"{lw.name}: a view of part of a buffer at offset {args[1]} is "
                            f"not lowered")
    return lw.reshape(x, tuple(args[2]))


def bucket_view(lw: Any, bucket: Bucket, offset: int, size: tuple[int, ...]) -> Any:
    """Elements [offset, offset + prod(size)) of a bucket: one piece seen
    with ``size``, or a run of whole pieces (a smaller bucket)."""
    end, at, run = offset + math.prod(size), 0, []
    for p in bucket.pieces:
        n = _numel(lw, p)
        if at >= offset and at + n <= end:
            run.append(p)
        at += n
    covered = sum(_numel(lw, p) for p in run)
    starts = np.cumsum([0] + [_numel(lw, p) for p in bucket.pieces])
    if run and covered == end - offset and offset in starts:
        return lw.reshape(run[0], size) if len(run) == 1 else Bucket(tuple(run))
    raise LoweringError(f"{lw.name}: a view of a gradient bucket at offset {offset} "
                        f"({math.prod(size)} elements) is not whole gradients")


def per_piece(lw: Any, handler, args, kwargs, group) -> Bucket:
    """An elementwise op whose first argument is a bucket, its other tensor
    arguments constants: the op on each piece."""
    key = args[0][1]
    bucket = lw.env[key]
    others = [a for a in [*args[1:], *(v for k, v in kwargs.items() if k != "out")]
              if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"]
    if any(lw.const(a) is None for a in others):
        return handler(lw, args, kwargs, [lw.shapes[lw.materialize(bucket)]], group)
    out = []
    try:
        for p in bucket.pieces:
            lw.env[key] = p
            out.append(lw.materialize(handler(lw, args, kwargs, [lw.shapes[p]], group)))
    finally:
        lw.env[key] = bucket
    return Bucket(tuple(out))


#: c10d reduce ops (``("redop", n)``) the bucket's all-reduce may use: SUM, AVG
_REDOPS = {0: "all_reduce", 1: "all_reduce_avg"}


def all_reduce_bucket(lw: Any, bucket: Bucket, op: Any, ranks: tuple[int, ...]) -> Bucket:
    """A bucket all-reduced in place: each piece all-reduced; the layout is
    kept for ``check_bucket_layouts``."""
    if op[1] not in _REDOPS:
        raise LoweringError(f"{lw.name}: a gradient bucket all-reduced with reduce op {op[1]} "
                            f"is not lowered (SUM and AVG are)")
    lw.buckets.append((tuple(ranks), tuple(_numel(lw, p) for p in bucket.pieces)))
    return Bucket(tuple(lw.emit(_REDOPS[op[1]], [p], [lw.shapes[p]], group=tuple(ranks))[0]
                        for p in bucket.pieces))


def broadcast(lw: Any, args, kwargs, shapes, group) -> list:
    """``broadcast_`` of constants (DDP's buffers, every forward): each
    member keeps the value it holds, the root's (``check_broadcasts``)."""
    tensors = args[0]
    constants = lw.trace.get("constants", set())
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
    exchange of shapes at its construction is not)."""
    from backends.torch.lowering.core import live_events
    sent: dict[tuple, list] = {}
    for t in traces:
        count: dict[tuple, int] = {}
        live = live_events(t)
        for i, (op, (args, _), *_) in enumerate(t["events"]):
            if op != "c10d.broadcast_.default" or i not in live:
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


BUCKET_HANDLERS: dict[str, Any] = {
    "mem.cat": mem_cat,
    "mem.slice": mem_slice,
    "c10d.broadcast_.default": broadcast,
}
