"""A materialized plan's columns as the narrow arrays the block check reads.

The block check (verdict/symmetry/blocks.py) and the representatives' cut
(verdict/symmetry/cut.py) read a plan through :class:`Arrays`: its
columns (verdict/columns.py) copied narrow (int8 or int16 where the values
fit), the inputs and outputs of every node as tuples of one pool, and
walked a chunk of nodes at a time (:func:`chunks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from verdict.columns import Columns, NodeColumns, drop_pages


@dataclass
class Arrays:
    """What the check reads of a plan's columns, with the inputs and outputs
    of every node as tuples of one CSR pool: a tuple is a range of the
    columns' pools, so nodes that share an inputs range (a replica group's
    members) share a tuple."""

    t_rank: np.ndarray
    t_mb: np.ndarray
    t_tid: np.ndarray
    t_version: np.ndarray
    t_lver: np.ndarray
    t_producer: np.ndarray  # node writing the tensor, -1 for inputs
    n_rank: np.ndarray
    n_mb: np.ndarray
    n_op: np.ndarray  # index into ops
    n_dir: np.ndarray
    n_kw: np.ndarray  # index into the columns' kwargs table
    n_ins: np.ndarray  # tuple id
    n_outs: np.ndarray
    ptr: np.ndarray  # tuple k holds flat[ptr[k]:ptr[k + 1]]
    flat: np.ndarray
    ops: tuple[str, ...]
    slice_off: np.ndarray  # tensor t's slices: rows slice_off[t]:slice_off[t + 1]


def index_array(values: np.ndarray) -> np.ndarray:
    """``values`` as int32 when they fit (checked), else int64: the check
    stores its arrays narrow and widens to int64 wherever it computes keys
    that could leave int32's range."""
    a = np.asarray(values)
    if a.dtype == np.int32:
        return a
    if not len(a) or (int(a.max()) <= I32.max and int(a.min()) >= I32.min):
        return a.astype(np.int32)
    return a.astype(np.int64)


def small_array(values: np.ndarray, *limits: int) -> np.ndarray:
    """A copy of ``values`` (never a view of a mapped column) as int8 or
    int16 when they and ``limits`` (constants the check compares them with)
    fit in -128..127 or -32768..32767 (checked), else :func:`index_array`'s
    type. For arrays that are only compared, used as indices or cast before
    arithmetic."""
    a = np.asarray(values)
    kind = fitting(*limits, *((int(a.min()), int(a.max())) if len(a) else ()))
    if kind.itemsize <= 2:
        return np.array(a, dtype=kind)
    out = index_array(a)
    return np.array(out) if out is a or out.base is not None else out


def fitting(*values: int) -> np.dtype:
    """The narrowest of int8, int16, int32 and int64 that holds ``values``."""
    low, high = min(values, default=0), max(values, default=0)
    for kind in (np.int8, np.int16, np.int32):
        if np.iinfo(kind).min <= low and high <= np.iinfo(kind).max:
            return np.dtype(kind)
    return np.dtype(np.int64)


I32 = np.iinfo(np.int32)
#: Nodes whose entries are compared at a time (bounds the per-entry temporaries).
NODE_CHUNK = 1 << 18


def arrays(cols: Columns) -> Arrays:
    """The check's arrays, by array operations over the columns, whose
    mapped pages are let go once copied (verdict/columns.py, drop_pages).

    The input tuples are the distinct input ranges of the pool, in pool
    order, then one empty tuple (nodes without inputs); the output tuples
    follow, one per node. Ranges are told apart by their first entry: the
    ranges of a plan are the same or disjoint (backends/columnar.py checks
    it of a file; Columns.from_plan makes them so), which is checked here
    again (ValueError: an internal error)."""
    t, n = cols.tensors, cols.nodes
    nn, nt = len(n), len(t)
    w = cols.world
    # the divisors and products of BlockCheck.split stay within the type of ranks
    ranks = int(np.prod([int(w.get(k, 1)) for k in ("pp", "dp", "cp", "tp")]))
    nm = int(w.get("nm", 1))
    index = np.int32 if max(2 * nn + 2, nt, len(n.inputs) + len(n.outputs)) < I32.max \
        else np.int64
    n_ins, r_count, inputs = _input_tuples(n, index)
    drop_pages(n.in_start, n.in_count)
    k, in_total = len(r_count), len(inputs)
    ptr = np.empty(k + 2 + nn, dtype=index)
    ptr[0] = 0
    np.cumsum(r_count, out=ptr[1:k + 1])
    ptr[k + 1] = in_total  # the empty tuple
    np.add(n.out_off[1:], in_total, out=ptr[k + 2:], dtype=index, casting="unsafe")
    flat = np.empty(in_total + len(n.outputs), dtype=index)
    flat[:in_total] = inputs
    del inputs, r_count
    drop_pages(n.inputs)
    flat[in_total:] = n.outputs
    t_producer = _producers(n, nt, index)
    drop_pages(n.outputs, n.out_off)

    def copied(a: np.ndarray, copy: Callable[..., np.ndarray], *limits: int) -> np.ndarray:
        """``copy(a, *limits)``, the mapped column's pages let go after: the
        columns are read one at a time, so at most one is resident."""
        out = np.array(copy(a, *limits), copy=True) if copy is index_array else copy(a, *limits)
        drop_pages(a)
        return out

    out = Arrays(
        t_rank=copied(t.rank, small_array, ranks), t_mb=copied(t.mb, small_array, -3),
        t_tid=copied(t.tid, small_array), t_version=copied(t.version, small_array),
        t_lver=copied(t.lver, small_array), t_producer=t_producer,
        n_rank=copied(n.rank, small_array, ranks), n_mb=copied(n.mb, small_array, -1, nm),
        n_op=copied(n.op, small_array), n_dir=copied(n.dir, small_array),
        n_kw=copied(n.kwargs, small_array),
        n_ins=n_ins, n_outs=(k + 1 + np.arange(nn, dtype=index)),
        ptr=ptr, flat=flat, ops=tuple(cols.ops), slice_off=index_array(t.slice_offsets(
            cols.logical)))
    cols.drop_pages()  # the tensors' tids, read again for the slice offsets
    return out


def _input_tuples(n: NodeColumns, index: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each node's input tuple (the empty tuple, numbered last, for nodes
    without inputs), each tuple's length and the pool entries of the
    tuples one after the other (the pool itself when every entry is in a
    range). Raises ValueError for ranges that share a first entry or overlap."""
    size = len(n.inputs)
    nodes = np.flatnonzero(n.in_count > 0).astype(index)
    start = n.in_start[nodes].astype(index)
    count = np.zeros(size + 1, dtype=index)
    count[start] = n.in_count[nodes]
    if not np.array_equal(count[start], n.in_count[nodes]):
        raise ValueError("two input ranges start at one pool entry")
    r_start = np.flatnonzero(count[:size] > 0).astype(index)
    r_count = count[r_start]
    del count
    ends = r_start.astype(np.int64) + r_count
    if (r_start[1:] < ends[:-1]).any():
        raise ValueError("two input ranges overlap")
    k = len(r_start)
    tuple_at = np.full(size + 1, k, dtype=index)
    tuple_at[r_start] = np.arange(k, dtype=index)
    n_ins = np.full(len(n), k, dtype=index)
    n_ins[nodes] = tuple_at[start]
    del tuple_at, start, nodes
    if int(r_count.sum(dtype=np.int64)) == size:
        return n_ins, r_count, n.inputs
    marks = np.zeros(size + 1, dtype=np.int8)  # +1 where a range starts, -1 past its end
    marks[r_start] = 1
    marks[ends] -= 1
    return n_ins, r_count, n.inputs[np.cumsum(marks[:size], dtype=np.int8).astype(bool)]


def _producers(n: NodeColumns, nt: int, index: type) -> np.ndarray:
    """The node writing each tensor, -1 for none, a chunk of nodes at a time."""
    producer = np.full(nt, -1, dtype=index)
    off = n.out_off
    for lo in range(0, len(n), NODE_CHUNK):
        hi = min(lo + NODE_CHUNK, len(n))
        owner = np.repeat(np.arange(lo, hi, dtype=index), np.diff(off[lo: hi + 1]))
        written = n.outputs[int(off[lo]): int(off[hi])]
        keep = written >= 0
        producer[written[keep]] = owner[keep]
    return producer


def chunks(n: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges of at most NODE_CHUNK of n items, in order."""
    for lo in range(0, n, NODE_CHUNK):
        yield lo, min(lo + NODE_CHUNK, n)


def member_mask(nodes: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Which of lo..hi-1 are in ``nodes`` (sorted indices)."""
    mask = np.zeros(hi - lo, dtype=bool)
    a, b = np.searchsorted(nodes, (lo, hi))
    mask[nodes[a:b] - lo] = True
    return mask


def spans(ptr: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Flat positions of the tuples ``groups``, one after the other."""
    lengths = ptr[groups + 1] - ptr[groups]
    starts = np.repeat(ptr[groups] - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return starts + np.arange(int(lengths.sum()))
