"""What a gradient bucket (``ir.Bucket``) goes through: a view of part of
it, an elementwise op applied piece by piece, an all-reduce in place.
Shared by the families that meet buckets (``buckets``, ``layout``,
``collectives``) and by ``Lowerer.lower_event``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.emit import narrow
from backends.torch.lowering.ir import Bucket, numel

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: elementwise ops a bucket may go through (a comm hook's ``div_``, the
#: reducer's ``mul.out`` by 1 / world size), applied piece by piece
PER_PIECE_OPS = frozenset({
    "aten.div_.Scalar", "aten.div_.Tensor", "aten.div.Scalar", "aten.div.Tensor",
    "aten.mul_.Scalar", "aten.mul_.Tensor", "aten.mul.Scalar", "aten.mul.Tensor", "aten.mul.out",
})


def bucket_view(lw: Lowerer, bucket: Bucket, offset: int, size: tuple[int, ...]) -> Any:
    """Elements [offset, offset + prod(size)) of a bucket: one piece seen
    with ``size``, or a run of whole pieces (a smaller bucket), or else
    those elements of the bucket built."""
    end, at, run = offset + math.prod(size), 0, []
    for p in bucket.pieces:
        n = numel(lw, p)
        if at >= offset and at + n <= end:
            run.append(p)
        at += n
    covered = sum(numel(lw, p) for p in run)
    starts = np.cumsum([0] + [numel(lw, p) for p in bucket.pieces])
    if run and covered == end - offset and offset in starts:
        return lw.reshape(run[0], size) if len(run) == 1 else Bucket(tuple(run))
    # elements across or inside pieces (the backward of a split: its pieces' gradients
    # concatenated, then read again at other bounds): the concatenation built, and the
    # elements read from it (exact: the bucket is that concatenation)
    flat = narrow(lw, lw.materialize(bucket), 0, offset, math.prod(size))
    return lw.reshape(flat, size)


def per_piece(lw: Lowerer, handler, args, kwargs, group) -> Bucket:
    """An elementwise op whose first argument is a bucket, its other tensor
    arguments constants: the op on each piece."""
    key = args[0][1]
    bucket = lw.env[key]
    others = [a for a in [*args[1:], *(v for k, v in kwargs.items() if k != "out")]
              if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"]
    if any(lw.const(a) is None for a in others):
        return handler(lw, args, kwargs, [lw.shapes[lw.materialize(bucket)]], group)
    out = []
    consts = [lw.const(a) for a in others]
    # zeros the step wrote into a bucket's padding (Megatron's distributed
    # optimizer) times or over a finite nonzero constant are those zeros
    keeps_zeros = all(math.isfinite(c) and c != 0 for c in consts)
    try:
        for p in bucket.pieces:
            if keeps_zeros and p in lw.zeros_made:
                out.append(p)
                continue
            lw.env[key] = p
            out.append(lw.materialize(handler(lw, args, kwargs, [lw.shapes[p]], group)))
    finally:
        lw.env[key] = bucket
    return Bucket(tuple(out))


#: c10d reduce ops (``("redop", n)``) the bucket's all-reduce may use: SUM, AVG
_REDOPS = {0: "all_reduce", 1: "all_reduce_avg"}


def all_reduce_bucket(lw: Lowerer, bucket: Bucket, op: Any, ranks: tuple[int, ...],
                      zeros: frozenset[int] = frozenset()) -> Bucket:
    """A bucket all-reduced in place: each piece all-reduced; the layout is
    kept for ``check_bucket_layouts``. ``zeros``: pieces that are zeros the
    step wrote (a bucket's padding), left as they are, since a sum or mean
    of zeros is zeros; the layout records their sizes negated, so every
    member must hold zeros there too."""
    if op[1] not in _REDOPS:
        raise LoweringError(f"{lw.name}: a gradient bucket all-reduced with reduce op {op[1]} "
                            f"is not lowered (SUM and AVG are)")
    lw.buckets.append((tuple(ranks), tuple(-numel(lw, p) if p in zeros else numel(lw, p)
                                           for p in bucket.pieces)))
    return Bucket(tuple(p if p in zeros else
                        lw.emit(_REDOPS[op[1]], [p], [lw.shapes[p]], group=tuple(ranks))[0]
                        for p in bucket.pieces))


def all_reduce_runs(lw: Lowerer, runs: tuple[tuple[int, int, int], ...], op: Any,
                    ranks: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Runs (value, lo, hi) side by side (a reduce-scattered range beside
    the local elements the rest of the buffer holds) all-reduced in place:
    each run's whole value all-reduced, the run kept at the same elements of
    the result; a run of zeros the step wrote left as it is. Exact when
    every member holds, at the same offsets, runs of values of the same
    shapes at the same elements, zeros where it holds zeros: its layout
    records them (``check_bucket_layouts``); docs/soundness.md, "Plans
    traced from PyTorch", 108 (b)."""
    if op[1] not in _REDOPS:
        raise LoweringError(f"{lw.name}: a flat range all-reduced with reduce op {op[1]} is not "
                            f"lowered (SUM and AVG are)")
    lw.buckets.append((tuple(ranks), tuple(("zeros" if v in lw.zeros_made else "run",
                                            tuple(lw.shapes[v]), lo, hi) for v, lo, hi in runs)))
    return tuple((v if v in lw.zeros_made else
                  lw.emit(_REDOPS[op[1]], [v], [lw.shapes[v]], group=tuple(ranks))[0], lo, hi)
                 for v, lo, hi in runs)
