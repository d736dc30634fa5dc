"""Columnar plan files (``.npz``): write, open safely, validate with array checks.

The file is an uncompressed zip of ``.npy`` members (docs/plan-format.md,
"Columns"). Opening it never runs code: the members are parsed here from the
zip's own headers and numpy's ``.npy`` header (a literal), then mapped from
the file read-only; no pickle is ever read. Members must be stored, not
compressed, and lie inside the file, so a small file cannot expand into a
large allocation. Every check is an array operation over all tensors or all
nodes at once; every problem is one :class:`backends.plancheck.PlanError`
naming the first offending entry.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from backends.plancheck import (
    PlanError,
    check_fold_keys,
    check_logical,
    check_loss_and_grads,
    check_world,
    detail,
    show,
    write_atomic,
)
from verdict.columns import INT_TYPES, Columns, NodeColumns, TensorColumns, drop_pages, narrow
from verdict.ops import OPS
from verdict.plan import DIRECTIONS, Logical

FORMAT = "verdict-columns"
VERSION = 1
VERSIONS = (1,)
MAGIC = b"PK\x03\x04"
HEADER_FIELDS = ("format", "version", "world", "loss", "grads", "logical", "ops", "names",
                 "kwargs")
TENSOR_ARRAYS = ("rank", "mb", "tid", "version", "lver", "parts", "slices")
NODE_ARRAYS = ("rank", "mb", "op", "dir", "kwargs", "name", "in_start", "in_count", "inputs",
               "out_off", "outputs")
MEMBERS = ("header", *(f"t_{k}" for k in TENSOR_ARRAYS), *(f"n_{k}" for k in NODE_ARRAYS))
#: Members a file may leave out: ``t_scale`` (T, 2), each tensor's factor
#: [num, den] (docs/soundness.md, "Scaled claims"), written only when some
#: tensor is scaled; without it every factor is 1.
OPTIONAL_MEMBERS = ("t_scale",)
_INT_DTYPES = tuple(np.dtype(k).newbyteorder("<") for k in INT_TYPES)
#: Tensors checked at a time where a check makes per-slice temporaries.
_CHUNK = 1 << 18
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header (30 bytes)


def is_columnar(path: str | os.PathLike[str]) -> bool:
    """Whether a file is a columnar plan by its first bytes (a zip file)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


# ---------------------------------------------------------------- writing


def _members(cols: Columns, validated: bool = False) -> dict[str, np.ndarray]:
    """The .npz members of ``cols`` (validated first unless the caller has
    just validated these very columns: a file that would be refused on
    opening is never written)."""
    if not validated:
        validate_columns(cols)
    header = {
        "format": FORMAT, "version": VERSION, "world": cols.world, "loss": cols.loss,
        "grads": [[p, g] for p, g in cols.grads.items()],
        "logical": [[t.name, list(t.shape), t.kind] for t in cols.logical],
        "ops": list(cols.ops), "names": list(cols.names), "kwargs": list(cols.kwargs),
    }
    try:
        text = json.dumps(header, sort_keys=True, allow_nan=False).encode()
    except ValueError as e:
        raise PlanError(f"cannot save: {detail(e)}") from None
    arrays = {"header": np.frombuffer(text, dtype=np.uint8)}
    for k in TENSOR_ARRAYS:
        arrays[f"t_{k}"] = np.ascontiguousarray(getattr(cols.tensors, k))
    if cols.tensors.scale is not None:
        arrays["t_scale"] = np.ascontiguousarray(cols.tensors.scale)
    for k in NODE_ARRAYS:
        arrays[f"n_{k}"] = np.ascontiguousarray(getattr(cols.nodes, k))
    return arrays


def columns_bytes(cols: Columns) -> bytes:
    """The .npz bytes of ``cols`` (validated first)."""
    stream = io.BytesIO()
    np.savez(stream, allow_pickle=False, **_members(cols))
    return stream.getvalue()


def save_columns(cols: Columns, path: str | os.PathLike[str], validated: bool = False) -> Path:
    """Write ``cols`` to ``path`` atomically (the world spec JSON is written
    by the caller, as for pickled plans). The members stream into a
    temporary file beside ``path`` (numpy writes each in bounded pieces), so
    writing holds no copy of the plan. ``validated``: the caller validated
    ``cols`` (:func:`validate_columns`) and has not changed them since."""
    path = Path(path)
    try:
        arrays = _members(cols, validated)
    except PlanError as e:
        raise PlanError(f"cannot save: {e.problem}", path) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: _write_members(f, arrays))
    return path


def _write_members(f: Any, arrays: dict[str, np.ndarray]) -> None:
    """The members as an uncompressed zip of .npy files, as ``np.savez``
    writes them, each array's mapped pages let go once it is written."""
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, a, allow_pickle=False)
            drop_pages(a)


# ---------------------------------------------------------------- reading


def _member(f: Any, size: int, info: zipfile.ZipInfo, path: Path) -> np.ndarray:
    """One stored .npy member, mapped read-only from the file."""
    name = info.filename
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise PlanError(f"member {show(name)} is compressed: columnar plans are stored "
                        "uncompressed")
    f.seek(info.header_offset)
    raw = f.read(_LOCAL_HEADER.size)
    if len(raw) != _LOCAL_HEADER.size or raw[:4] != MAGIC:
        raise PlanError(f"member {show(name)}: bad zip local header (truncated?)")
    fields = _LOCAL_HEADER.unpack(raw)
    start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    end = start + info.file_size
    if end > size:
        raise PlanError(f"member {show(name)} runs past the end of the file (truncated)")
    f.seek(start)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f".npy version {version}")
    except ValueError as e:
        raise PlanError(f"member {show(name)}: not a .npy array ({detail(e)})") from None
    if dtype.hasobject:
        raise PlanError(f"member {show(name)} holds Python objects: refused")
    if fortran and len(shape) > 1:
        raise PlanError(f"member {show(name)} is in Fortran order")
    offset = f.tell()
    count = math.prod(int(k) for k in shape)
    if offset + count * dtype.itemsize > end:
        raise PlanError(f"member {show(name)}: its data runs past the member (truncated)")
    if count == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))


def _read_members(path: Path) -> dict[str, np.ndarray]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            try:
                infos = zipfile.ZipFile(f).infolist()
            except (zipfile.BadZipFile, ValueError, EOFError, struct.error) as e:
                raise PlanError(f"not a valid .npz (zip) file, or truncated ({detail(e)})") \
                    from None
            names = [i.filename for i in infos]
            want = {f"{m}.npy" for m in (*MEMBERS, *OPTIONAL_MEMBERS)}
            for n in names:
                if n not in want:
                    raise PlanError(f"unknown member {show(n)} (members: "
                                    f"{', '.join((*MEMBERS, *OPTIONAL_MEMBERS))})")
            if len(set(names)) != len(names):
                raise PlanError("a member appears twice")
            for m in MEMBERS:
                if f"{m}.npy" not in names:
                    raise PlanError(f"missing member {m!r}")
            return {i.filename[:-4]: _member(f, size, i, path) for i in infos}
    except FileNotFoundError:
        raise PlanError("no such file") from None
    except IsADirectoryError:
        raise PlanError("is a directory, not a plan file") from None
    except PermissionError:
        raise PlanError("not readable (permission denied)") from None
    except (OSError, MemoryError) as e:
        raise PlanError(f"cannot read ({detail(e)})") from None


def _header(raw: np.ndarray) -> dict[str, Any]:
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise PlanError("member 'header' must be a 1-d uint8 array (JSON text)")
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:
        raise PlanError(f"header is not valid JSON ({detail(e)})") from None
    if not isinstance(header, dict):
        raise PlanError(f"header is a JSON {type(header).__name__}, not an object")
    if header.get("format") != FORMAT:
        raise PlanError(f"not a columnar verdict plan: format is {show(header.get('format'))}, "
                        f"expected {FORMAT!r}")
    if header.get("version") not in VERSIONS:
        raise PlanError(f"unsupported columnar plan version {show(header.get('version'))}: "
                        f"this verdict reads version {', '.join(map(str, VERSIONS))}")
    for key in HEADER_FIELDS:
        if key not in header:
            raise PlanError(f"header: missing field {key!r}")
    for key in header:
        if key not in HEADER_FIELDS:
            raise PlanError(f"header: unknown field {show(key)}")
    return header


def _table(header: dict, key: str) -> tuple[str, ...]:
    values = header[key]
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise PlanError(f"header {key!r} must be a list of str")
    return tuple(values)


def _columns_of(header: dict, arrays: dict[str, np.ndarray]) -> Columns:
    """Columns from a parsed header and arrays; the header's own fields are
    checked here (the arrays by :func:`validate_columns`)."""
    check_world(header["world"])
    logical_rows = header["logical"]
    if not isinstance(logical_rows, list):
        raise PlanError("header 'logical' must be a list")
    shapes = check_logical(logical_rows)
    grads = header["grads"]
    if not isinstance(grads, list):
        raise PlanError("header 'grads' must be a list")
    loss = header["loss"]
    if not isinstance(loss, int) or isinstance(loss, bool):
        raise PlanError(f"header 'loss' must be an int, got {show(loss)}")
    check_loss_and_grads(loss, grads, len(shapes))
    logical = tuple(Logical(r[0], s, r[2]) for r, s in zip(logical_rows, shapes))
    return Columns(
        world=header["world"], logical=logical, loss=loss, grads={p: g for p, g in grads},
        tensors=TensorColumns(**{k: arrays[f"t_{k}"] for k in TENSOR_ARRAYS},
                              scale=arrays.get("t_scale")),
        nodes=NodeColumns(**{k: arrays[f"n_{k}"] for k in NODE_ARRAYS}),
        ops=_table(header, "ops"), names=_table(header, "names"),
        kwargs=_table(header, "kwargs"),
    )


def load_columns_file(path: str | os.PathLike[str]) -> Columns:
    """Open and validate a columnar plan file; every problem is a one-line PlanError."""
    path = Path(path)
    try:
        arrays = _read_members(path)
        cols = _columns_of(_header(arrays["header"]), arrays)
        validate_columns(cols)
    except PlanError as e:
        raise e.at(path) from None
    except Exception as e:  # a safety net: the checks above should catch it all
        raise PlanError(f"invalid columnar plan ({detail(e)})", path) from None
    return cols


# ---------------------------------------------------------------- validation


def validate_columns(cols: Columns) -> None:
    """Format-level integrity of columns, as :func:`backends.planfile.validate`
    checks rows: types, ranges, references, slices inside the logical shapes,
    unique tensor keys, single assignment, reads after writes. Raises
    PlanError (without a path) naming the first offending entry."""
    check_fold_keys(cols.world)
    _check_tables(cols)
    _check_dtypes(cols)
    try:
        _check_tensor_columns(cols)
        cols.drop_pages()
        _check_node_columns(cols)
    finally:
        cols.drop_pages()


def _check_tables(cols: Columns) -> None:
    for i, op in enumerate(cols.ops):
        if op not in OPS:
            raise PlanError(f"op table entry {i}: unknown operator {show(op)}")
    for i, text in enumerate(cols.kwargs):
        try:
            kw = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise PlanError(f"kwargs table entry {i}: not valid JSON ({detail(e)})") from None
        if not isinstance(kw, dict):
            raise PlanError(f"kwargs table entry {i}: a JSON {type(kw).__name__}, not an object")


def _check_dtypes(cols: Columns) -> None:
    t, n = len(cols.tensors.rank), len(cols.nodes.rank)
    shapes = {
        **{f"t_{k}": (t,) for k in ("rank", "mb", "tid", "version", "lver")},
        "t_parts": (t, 3),
        "t_scale": (t, 2),
        **{f"n_{k}": (n,) for k in ("rank", "mb", "op", "dir", "kwargs", "name", "in_start",
                                     "in_count")},
        "n_out_off": (n + 1,),
    }
    arrays = {**{f"t_{k}": getattr(cols.tensors, k) for k in TENSOR_ARRAYS},
              **{f"n_{k}": getattr(cols.nodes, k) for k in NODE_ARRAYS}}
    if cols.tensors.scale is not None:
        arrays["t_scale"] = cols.tensors.scale
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.dtype.newbyteorder("<") not in _INT_DTYPES:
            got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
            raise PlanError(f"{name}: must be an array of int8, int16, int32 or int64, got {got}")
        want = shapes.get(name)
        if name == "t_slices":
            ok = a.ndim == 2 and a.shape[1] == 2
            want_text = "(S, 2)"
        elif want is None:
            ok = a.ndim == 1
            want_text = "1-d"
        else:
            ok = a.shape == want
            want_text = str(want)
        if not ok:
            raise PlanError(f"{name}: shape {a.shape}, expected {want_text}")


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _check_tensor_columns(cols: Columns) -> None:
    t = cols.tensors
    nt = len(t.rank)
    for name, arr, low in (("rank", t.rank, 0), ("mb", t.mb, -1), ("tid", t.tid, 0),
                           ("version", t.version, 0), ("lver", t.lver, 0)):
        bad = arr < low
        if bad.any():
            i = _first(bad)
            raise PlanError(f"tensor {i}: {name} must be >= {low}, got {int(arr[i])}")
    nl = len(cols.logical)
    bad = t.tid >= nl
    if bad.any():
        i = _first(bad)
        raise PlanError(f"tensor {i}: tid {int(t.tid[i])} is not a logical id (plan has {nl})")
    ndim = narrow([len(x.shape) for x in cols.logical])
    per = ndim[t.tid]
    total = int(per.sum(dtype=np.int64))
    if total != len(t.slices):
        raise PlanError(f"t_slices has {len(t.slices)} rows; the tensors' logical dims need "
                        f"{total}")
    for at in range(0, nt, _CHUNK):
        lo, hi, n = (t.parts[at: at + _CHUNK, k].astype(np.int64) for k in range(3))
        bad = ~((lo >= 0) & (lo < hi) & (hi <= np.abs(n)))
        if bad.any():
            i = at + _first(bad)
            raise PlanError(f"tensor {i}: parts {t.parts[i].tolist()} must satisfy "
                            "0 <= lo < hi <= |n|")
        if t.scale is not None:
            num, den = (t.scale[at: at + _CHUNK, k].astype(np.int64) for k in range(2))
            bad = (num == 0) | (den <= 0)
            if bad.any():
                i = at + _first(bad)
                raise PlanError(f"tensor {i}: scale {t.scale[i].tolist()} must be [num, den] "
                                f"with num != 0 and den > 0")
    if total:
        _check_slices(cols, per, total)
    if nt:
        _check_unique_keys(t)


def _check_slices(cols: Columns, per: np.ndarray, total: int) -> None:
    """Every slice inside its logical dim, in chunks of tensors (the
    temporaries stay a few MiB whatever the plan's size)."""
    t = cols.tensors
    flat = np.array([n for x in cols.logical for n in x.shape], dtype=np.int64)
    first_dim = np.zeros(len(cols.logical), dtype=np.int64)
    np.cumsum([len(x.shape) for x in cols.logical][:-1], out=first_dim[1:])
    off = np.zeros(len(t.rank) + 1, dtype=np.int64)
    np.cumsum(per, out=off[1:])
    for lo in range(0, len(t.rank), _CHUNK):
        hi = min(lo + _CHUNK, len(t.rank))
        owner = np.repeat(np.arange(lo, hi), per[lo:hi])
        rows = slice(int(off[lo]), int(off[hi]))
        dim = np.arange(rows.start, rows.stop) - off[owner]
        size = flat[first_dim[t.tid[owner]] + dim]
        start, end = t.slices[rows, 0].astype(np.int64), t.slices[rows, 1].astype(np.int64)
        bad = ~((start >= 0) & (start <= end) & (end <= size) & ((start < end) | (size == 0)))
        if bad.any():
            r = _first(bad)
            i, d = int(owner[r]), int(dim[r])
            full = list(cols.logical[int(t.tid[i])].shape)
            raise PlanError(f"tensor {i}: slice {[int(start[r]), int(end[r])]} of dim {d} is "
                            f"outside the logical shape {full}")


def _check_unique_keys(t: TensorColumns) -> None:
    order = np.lexsort((t.version, t.tid, t.mb, t.rank))
    keys = [a[order] for a in (t.rank, t.mb, t.tid, t.version)]
    same = np.ones(len(order) - 1, dtype=bool)
    for k in keys:
        same &= k[1:] == k[:-1]
    if same.any():
        j = _first(same)
        a, b = sorted((int(order[j]), int(order[j + 1])))
        key = tuple(int(k[j]) for k in keys)
        raise PlanError(f"tensor {b}: same (rank, mb, tid, version) {key} as tensor {a}")


def _label(cols: Columns, i: int) -> str:
    n = cols.nodes
    return f"node {i} ({cols.ops[int(n.op[i])]} on rank {int(n.rank[i])} mb {int(n.mb[i])})"


def _check_node_columns(cols: Columns) -> None:
    n = cols.nodes
    nt = len(cols.tensors.rank)
    for name, arr, low, high in (("rank", n.rank, 0, None), ("mb", n.mb, -1, None),
                                 ("op", n.op, 0, len(cols.ops)),
                                 ("dir", n.dir, 0, len(DIRECTIONS)),
                                 ("kwargs", n.kwargs, 0, len(cols.kwargs)),
                                 ("name", n.name, 0, len(cols.names)),
                                 ("in_start", n.in_start, 0, None),
                                 ("in_count", n.in_count, 0, None)):
        bad = arr < low if high is None else (arr < low) | (arr >= high)
        if bad.any():
            i = _first(bad)
            what = f">= {low}" if high is None else f"in [{low}, {high})"
            raise PlanError(f"node {i}: {name} code {int(arr[i])} must be {what}")
    bad = _past_end(n.in_start, n.in_count, len(n.inputs))
    if bad >= 0:
        raise PlanError(f"{_label(cols, bad)}: inputs range past the end of the pool")
    off = n.out_off
    if (int(off[0]) != 0 or int(off[-1]) != len(n.outputs) or (np.diff(off) < 0).any()):
        raise PlanError("n_out_off must rise from 0 to the number of outputs")
    for what, arr in (("input", n.inputs), ("output", n.outputs)):
        bad = (arr < -1) | (arr >= nt)
        if bad.any():
            v = int(arr[_first(bad)])
            raise PlanError(f"{what} {v} is not a tensor index (plan has {nt} tensors)")
        del bad
        drop_pages(arr)
    is_bw = n.dir == DIRECTIONS.index("bw")
    producer = _check_outputs(cols, off, is_bw, nt)
    drop_pages(n.outputs, n.out_off)
    _check_inputs(cols, is_bw, producer)


def _past_end(start: np.ndarray, count: np.ndarray, size: int) -> int:
    """The first node whose inputs range ends past ``size`` entries, or -1
    (int64 sums, a chunk of nodes at a time)."""
    for lo in range(0, len(start), _CHUNK):
        bad = start[lo: lo + _CHUNK].astype(np.int64) + count[lo: lo + _CHUNK] > size
        if bad.any():
            return lo + _first(bad)
    return -1


def _index_type(n: int) -> type:
    """The integer type for indices below ``n`` (int32 halves the temporaries)."""
    return np.int32 if n < np.iinfo(np.int32).max else np.int64


def _check_outputs(cols: Columns, off: np.ndarray, is_bw: np.ndarray, nt: int) -> np.ndarray:
    """Single assignment; -1 only in bw nodes. Returns each tensor's producer (-1: none)."""
    n = cols.nodes
    index = _index_type(max(len(n.rank), nt) + 1)
    writer = np.repeat(np.arange(len(n.rank), dtype=index), np.diff(off))
    absent = n.outputs == -1
    bad = absent & ~is_bw[writer]
    if bad.any():
        i = int(writer[_first(bad)])
        raise PlanError(f"{_label(cols, i)}: output -1 (absent slot) is allowed only in bw nodes")
    present, who = n.outputs[~absent], writer[~absent]
    del writer, absent
    producer = np.full(nt, -1, dtype=index)
    producer[present] = who
    if np.count_nonzero(producer >= 0) != len(present):  # some tensor written twice
        twice = np.bincount(present, minlength=nt) > 1
        tensor = _first(twice)
        first, second = who[np.flatnonzero(present == tensor)[:2]].tolist()
        raise PlanError(f"{_label(cols, second)}: tensor {tensor} is already written "
                        f"by node {first} (each tensor is written once)")
    return producer


def _check_inputs(cols: Columns, is_bw: np.ndarray, producer: np.ndarray) -> None:
    """Reads after writes and -1 only in bw nodes, once per distinct input
    range (nodes share ranges): every tensor of a range is written before
    the first node that reads the range. A node that writes what it reads
    fails too (its producer is not before it). Ranges are told apart by
    their first entry: two nodes whose ranges start at one entry must have
    the same range, and distinct ranges must not overlap."""
    n = cols.nodes
    nn, size = len(n.rank), len(n.inputs)
    index = _index_type(max(nn, size) + 2)
    nodes = np.flatnonzero(n.in_count > 0).astype(index)
    if not len(nodes):
        return
    start = n.in_start[nodes].astype(index)
    # per pool entry that starts a range: its first reader, its count, whether
    # a node other than bw reads it
    first_user = np.full(size + 1, nn, dtype=index)
    np.minimum.at(first_user, start, nodes)
    count = np.zeros(size + 1, dtype=index)
    count[start] = n.in_count[nodes]
    other = np.flatnonzero(count[start] != n.in_count[nodes])
    if len(other):
        raise PlanError(f"{_label(cols, int(nodes[other[0]]))}: its inputs range overlaps "
                        "another node's without being the same range")
    not_bw = np.zeros(size + 1, dtype=bool)
    not_bw[start[~is_bw[nodes]]] = True
    del start
    r_start = np.flatnonzero(first_user < nn)  # the distinct ranges, by first entry
    ends = r_start + count[r_start]
    del count
    if (r_start[1:] < ends[:-1]).any():
        k = _first(r_start[1:] < ends[:-1]) + 1
        raise PlanError(f"{_label(cols, int(first_user[r_start[k]]))}: its inputs range "
                        "overlaps another node's without being the same range")
    # each pool entry's range's first entry (+1; 0: in no range), painted by a
    # cumulative sum over the disjoint ranges
    where = np.zeros(size + 1, dtype=index)
    where[r_start] += (r_start + 1).astype(index)
    where[ends] -= (r_start + 1).astype(index)
    del ends, r_start
    np.cumsum(where, out=where)
    for lo in range(0, size, _CHUNK):
        entries = n.inputs[lo: lo + _CHUNK]
        first = where[lo: lo + len(entries)].astype(np.int64) - 1
        bad = (entries == -1) & (first >= 0) & not_bw[np.maximum(first, 0)]
        if bad.any():
            head = int(first[_first(bad)])
            users = nodes[(n.in_start[nodes] == head) & ~is_bw[nodes]]
            raise PlanError(f"{_label(cols, int(users[0]))}: input -1 (absent slot) is allowed "
                            "only in bw nodes")
    for lo in range(0, size, _CHUNK):
        entries = n.inputs[lo: lo + _CHUNK]
        first = where[lo: lo + len(entries)].astype(np.int64) - 1
        reader = first_user[np.maximum(first, 0)]
        prod = producer[np.maximum(entries, 0)]
        bad = (first >= 0) & (entries != -1) & (prod >= reader)
        if bad.any():
            e = _first(bad)
            tensor, writer, reader = int(entries[e]), int(prod[e]), int(reader[e])
            if writer == reader:
                raise PlanError(f"{_label(cols, reader)}: tensor {tensor} is both an input "
                                "and an output")
            raise PlanError(f"{_label(cols, reader)}: reads tensor {tensor} before node "
                            f"{writer} writes it")
