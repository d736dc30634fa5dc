"""Plans as columns: one numpy array per field, so a plan of millions of nodes
costs tens of bytes per node and is checked by array operations.

:class:`Columns` holds the same SSA DAG as :class:`verdict.plan.Plan`, field
by field (docs/plan-format.md, "Columns"):

* tensors: ``rank``, ``mb``, ``tid``, ``version``, ``lver`` (one entry per
  tensor), ``parts`` (T, 3), ``scale`` (T, 2; None when no tensor is
  scaled: every factor 1/1), and ``slices`` (S, 2): the [start, end) pairs of
  every tensor, one per dim of its *logical* shape, tensor after tensor
  (:meth:`TensorColumns.slice_offsets` finds tensor i's rows). A tensor's
  shape is not stored: it is its slices' extents.
* nodes: ``rank``, ``mb``, ``op`` (code into ``ops``), ``dir`` (code into
  :data:`verdict.plan.DIRECTIONS`), ``kwargs`` (code into ``kwargs``, the
  distinct keyword arguments as canonical JSON), ``name`` (code into
  ``names``); inputs as ``in_start``/``in_count`` ranges of the flat
  ``inputs`` pool (nodes may share one range: the members of a replica
  group all read the same buffers), outputs as CSR (``out_off``, N + 1
  offsets into ``outputs``).

The verifier's pipeline works on :class:`Plan` objects; :meth:`Columns.to_plan`
materializes all of a plan, or only some of its nodes.
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from verdict.plan import (
    DIRECTIONS,
    SHARED_MIN,
    UNIT,
    Logical,
    Node,
    Plan,
    Tensor,
    load_factor_message,
    lowest,
)

Array = np.ndarray


def canonical_kwargs(kwargs: dict[str, Any]) -> str:
    """The canonical JSON text of a node's kwargs (sorted keys, no spaces).
    A tuple is written, and read back, as a list."""
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"))


#: The integer types of columns, narrowest first.
INT_TYPES = (np.int8, np.int16, np.int32, np.int64)


def narrow(values: Any) -> Array:
    """The values in the narrowest signed integer type that holds them all
    (columns are read, compared and used as indices; cast to int64 before
    arithmetic that could leave the type's range)."""
    a = values if isinstance(values, np.ndarray) and values.dtype.kind == "i" else \
        np.asarray(values, dtype=np.int64)
    if a.size == 0:
        return a.astype(np.int8)
    low, high = a.min(), a.max()
    for kind in INT_TYPES:
        if np.iinfo(kind).min <= low and high <= np.iinfo(kind).max:
            return a.astype(kind, copy=False)
    return a


def row_ids(matrix: np.ndarray) -> np.ndarray:
    """An id per row of an int matrix, equal for equal rows: columns packed
    into one int64 key while their ranges fit, then numbered by one sort."""
    ids = np.zeros(len(matrix), dtype=np.int64)
    span = 1
    for k in range(matrix.shape[1] if matrix.ndim == 2 and len(matrix) else 0):
        col = matrix[:, k].astype(np.int64)
        lo = int(col.min())
        width = int(col.max()) - lo + 1
        if span * width >= 2 ** 62:
            ids = np.unique(ids, return_inverse=True)[1].reshape(-1)
            span = int(ids.max(initial=0)) + 1
        ids = ids * width + (col - lo)
        span *= width
    return np.unique(ids, return_inverse=True)[1].reshape(-1)


def drop_pages(*arrays: Any) -> None:
    """Let go of the pages of every array here that is a view of a memory
    map (a column mapped from a plan file): they leave this process's
    resident set and are read again from the file (or the page cache) on
    the next access. Arrays not mapped, and None, are left alone."""
    for a in arrays:
        base = a
        while isinstance(base, np.ndarray):
            base = base.base
        if isinstance(base, mmap.mmap) and not base.closed:
            base.madvise(mmap.MADV_DONTNEED)


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's
    ``malloc_trim``; False where the C library has none). Arrays freed by
    the block check stay resident otherwise: glibc raises its mmap
    threshold after the first large free, so the chunk temporaries that
    follow come from the heap, which keeps their pages once they are freed,
    and forked workers then start from (and copy on write) a parent whose
    resident set still holds the check's high-water mark."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


@dataclass(frozen=True, eq=False)
class TensorColumns:
    rank: Array
    mb: Array
    tid: Array
    version: Array
    lver: Array
    parts: Array  # (T, 3): lo, hi, n
    slices: Array  # (S, 2): start, end; S = sum of the logical ndims of the tensors' tids
    scale: Array | None = None  # (T, 2): num, den of each tensor's factor; None: all 1/1

    def __len__(self) -> int:
        return len(self.rank)

    def ndims(self, logical: Sequence[Logical]) -> Array:
        """Each tensor's number of dims (that of its logical tensor)."""
        return narrow([len(t.shape) for t in logical])[self.tid]

    def slice_offsets(self, logical: Sequence[Logical]) -> Array:
        """T + 1 offsets: tensor i's slices are rows off[i]:off[i + 1] of ``slices``."""
        off = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.ndims(logical), out=off[1:])
        return off


@dataclass(frozen=True, eq=False)
class NodeColumns:
    rank: Array
    mb: Array
    op: Array  # code into Columns.ops
    dir: Array  # code into DIRECTIONS
    kwargs: Array  # code into Columns.kwargs
    name: Array  # code into Columns.names
    in_start: Array  # inputs of node i: inputs[in_start[i]:in_start[i] + in_count[i]]
    in_count: Array
    inputs: Array  # tensor indices, -1 for an absent slot
    out_off: Array  # N + 1 offsets: outputs of node i: outputs[out_off[i]:out_off[i + 1]]
    outputs: Array

    def __len__(self) -> int:
        return len(self.rank)


@dataclass(frozen=True, eq=False)
class Columns:
    """A plan in columns (see the module docstring)."""

    world: dict[str, Any]
    logical: tuple[Logical, ...]
    loss: int
    grads: dict[int, int]
    tensors: TensorColumns
    nodes: NodeColumns
    ops: tuple[str, ...]
    names: tuple[str, ...]
    kwargs: tuple[str, ...]  # canonical JSON (canonical_kwargs)

    # ------------------------------------------------------------ access
    def kwargs_of(self, code: int) -> dict[str, Any]:
        """The kwargs dict of a kwargs code (a fresh dict each call)."""
        return json.loads(self.kwargs[code])

    def inputs_of(self, i: int) -> Array:
        s = int(self.nodes.in_start[i])
        return self.nodes.inputs[s: s + int(self.nodes.in_count[i])]

    def outputs_of(self, i: int) -> Array:
        return self.nodes.outputs[int(self.nodes.out_off[i]): int(self.nodes.out_off[i + 1])]

    def nbytes(self) -> int:
        """Bytes held by the arrays (the tables are small and not counted)."""
        total = 0
        for group in (self.tensors, self.nodes):
            total += sum(a.nbytes for a in vars(group).values() if isinstance(a, np.ndarray))
        return total

    def drop_pages(self) -> None:
        """Let go of the resident pages of the mapped columns (:func:`drop_pages`)."""
        for group in (self.tensors, self.nodes):
            drop_pages(*vars(group).values())

    def is_folded(self) -> bool:
        return Plan(world=self.world).is_folded()

    def written(self) -> Array:
        """A mask of the tensors some node writes (the others are loads)."""
        written = np.zeros(len(self.tensors), dtype=bool)
        out = self.nodes.outputs
        written[out[out >= 0]] = True
        return written

    def scaled_load(self) -> str | None:
        """:meth:`verdict.plan.Plan.scaled_load` on the columns, by arrays."""
        scale = self.tensors.scale
        if scale is None:
            return None
        written = self.written()
        bad = np.flatnonzero((scale[:, 0] != scale[:, 1]) & ~written)
        if not len(bad):
            return None
        i = int(bad[0])
        t = self.tensors
        row = Tensor(int(t.rank[i]), int(t.mb[i]), int(t.tid[i]), int(t.version[i]), (),
                     int(t.lver[i]), (), tuple(int(x) for x in t.parts[i]),
                     lowest(int(scale[i, 0]), int(scale[i, 1])))
        return load_factor_message(self, i, row)

    # ------------------------------------------------------------ conversions
    @classmethod
    def from_plan(cls, plan: Plan) -> Columns:
        """The columns of ``plan``. Nodes that share one inputs tuple of
        SHARED_MIN or more entries (one object) share one range of the pool.
        Raises ValueError for a tensor whose shape is not its slices' extents
        (columns store no shape) or whose slices do not match its logical ndim."""
        ts = plan.tensors
        ndim = [len(t.shape) for t in plan.logical]
        slices: list[tuple[int, int]] = []
        for i, t in enumerate(ts):
            if len(t.slices) != ndim[t.tid]:
                raise ValueError(f"tensor {i}: {len(t.slices)} slices for a logical tensor of "
                                 f"{ndim[t.tid]} dims")
            if tuple(b - a for a, b in t.slices) != tuple(t.shape):
                raise ValueError(f"tensor {i}: shape {list(t.shape)} is not its slices' extents")
            slices.extend(t.slices)
        tensors = TensorColumns(
            rank=narrow([t.rank for t in ts]), mb=narrow([t.mb for t in ts]),
            tid=narrow([t.tid for t in ts]), version=narrow([t.version for t in ts]),
            lver=narrow([t.lver for t in ts]),
            parts=narrow([t.parts for t in ts]).reshape(len(ts), 3),
            slices=narrow(slices).reshape(len(slices), 2),
            scale=(narrow([t.scale for t in ts]).reshape(len(ts), 2)
                   if any(t.scale != UNIT for t in ts) else None),
        )
        return cls(world=dict(plan.world), logical=tuple(plan.logical), loss=plan.loss,
                   grads=dict(plan.grads), tensors=tensors, **_node_columns(plan.nodes))

    def to_plan(self, nodes: Sequence[int] | Array | None = None) -> Plan:
        """The plan, or with ``nodes`` (indices, in the order given) a plan
        of those nodes and the tensors they read or write only, numbered
        in their order in this plan; the world, logical table, loss and grads are
        the whole plan's."""
        with _no_gc():
            return self._to_plan(nodes)

    def _to_plan(self, nodes: Sequence[int] | Array | None) -> Plan:
        n = self.nodes
        picked = np.arange(len(n)) if nodes is None else np.asarray(nodes, dtype=np.int64)
        if nodes is None:
            keep = np.arange(len(self.tensors))
        else:
            used = [self.inputs_of(i) for i in picked] + [self.outputs_of(i) for i in picked]
            flat = np.concatenate(used) if used else np.zeros(0, dtype=np.int64)
            keep = np.unique(flat[flat >= 0])
        renum = np.full(len(self.tensors) + 1, -1, dtype=np.int64)  # renum[-1] stays -1
        renum[keep] = np.arange(len(keep))
        tensors = self._tensor_rows(keep)
        kwargs = [json.loads(k) for k in self.kwargs]
        ops, dirs, names = self.ops, DIRECTIONS, self.names
        ins_pool, outs_pool = renum[n.inputs].tolist(), renum[n.outputs].tolist()
        starts, counts, off = n.in_start.tolist(), n.in_count.tolist(), n.out_off.tolist()
        rank, mb, op, dr = (n.rank.tolist(), n.mb.tolist(), n.op.tolist(), n.dir.tolist())
        kw, nm = n.kwargs.tolist(), n.name.tolist()
        shared: dict[tuple[int, int], tuple[int, ...]] = {}
        out_nodes = []
        for i in picked.tolist():
            s, c = starts[i], counts[i]
            if c < SHARED_MIN:
                ins = tuple(ins_pool[s: s + c])
            elif (s, c) in shared:
                ins = shared[(s, c)]
            else:
                ins = shared[(s, c)] = tuple(ins_pool[s: s + c])
            out_nodes.append(Node(rank[i], mb[i], ops[op[i]], dirs[dr[i]], ins,
                                  tuple(outs_pool[off[i]: off[i + 1]]), dict(kwargs[kw[i]]),
                                  names[nm[i]]))
        return Plan(world=dict(self.world), logical=list(self.logical), tensors=tensors,
                    nodes=out_nodes, loss=self.loss, grads=dict(self.grads))

    def _tensor_rows(self, keep: Array) -> list[Tensor]:
        t = self.tensors
        off = t.slice_offsets(self.logical).tolist()
        rank, mb, tid, ver, lver = (a[keep].tolist() for a in (t.rank, t.mb, t.tid, t.version,
                                                                t.lver))
        parts = t.parts[keep].tolist()
        scale = t.scale[keep].tolist() if t.scale is not None else None
        slices = t.slices.tolist()
        rows = []
        for k, i in enumerate(keep.tolist()):
            sl = tuple(tuple(p) for p in slices[off[i]: off[i + 1]])
            rows.append(Tensor(rank[k], mb[k], tid[k], ver[k], tuple(b - a for a, b in sl),
                               lver[k], sl, tuple(parts[k]),
                               lowest(*scale[k]) if scale is not None else UNIT))
        return rows


@contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused while millions of tuples are made
    (none of them cyclic): it would otherwise rescan them again and again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _node_columns(nodes: Sequence[Node]) -> dict[str, Any]:
    """The node columns and tables of a list of Node rows."""
    ops: dict[str, int] = {}
    names: dict[str, int] = {}
    kwargs: dict[str, int] = {}
    directions = {d: i for i, d in enumerate(DIRECTIONS)}
    pool: list[int] = []
    shared: dict[int, int] = {}
    in_start, in_count, outputs, out_off = [], [], [], [0]
    cols: dict[str, list[int]] = {k: [] for k in ("rank", "mb", "op", "dir", "kwargs", "name")}
    for node in nodes:
        cols["rank"].append(node.rank)
        cols["mb"].append(node.mb)
        cols["op"].append(ops.setdefault(node.op, len(ops)))
        if node.dir not in directions:
            raise ValueError(f"node {len(in_count)}: dir {node.dir!r} is not one of {DIRECTIONS}")
        cols["dir"].append(directions[node.dir])
        cols["kwargs"].append(kwargs.setdefault(canonical_kwargs(node.kwargs), len(kwargs)))
        cols["name"].append(names.setdefault(node.name, len(names)))
        ins = node.inputs
        if len(ins) >= SHARED_MIN and id(ins) in shared:
            in_start.append(shared[id(ins)])
        else:
            if len(ins) >= SHARED_MIN:
                shared[id(ins)] = len(pool)
            in_start.append(len(pool))
            pool.extend(ins)
        in_count.append(len(ins))
        outputs.extend(node.outputs)
        out_off.append(len(outputs))
    node_cols = NodeColumns(
        **{k: narrow(v) for k, v in cols.items()},
        in_start=narrow(in_start), in_count=narrow(in_count), inputs=narrow(pool),
        out_off=narrow(out_off), outputs=narrow(outputs),
    )
    return {"nodes": node_cols, "ops": tuple(ops), "names": tuple(names),
            "kwargs": tuple(kwargs)}
