"""Plan files on disk: save, load safely, validate.

A plan file is a pickle of :meth:`verdict.plan.Plan.to_data` (plain data only)
with a JSON world spec of the same stem beside it. Loading uses an unpickler
that refuses every global, so opening a plan never runs code, and then checks
the format-level integrity of the data (types, index ranges, SSA order).
Operator shape rules are not checked here: a plan whose operator produces a
wrong shape still loads, and the verifier reports it as a finding.

Every problem becomes one :class:`PlanError` whose message is one line:
``<path>: <problem>``. docs/plan-format.md describes the format.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backends import columnar
from backends.plancheck import (
    PlanError,
    Shape,
    as_int,
    as_ints,
    as_row,
    as_seq,
    as_str,
    check_fold_keys,
    check_logical,
    check_loss_and_grads,
    check_world,
    check_world_matches,
    clip,
    detail,
    is_int,
    is_seq,
    one_line,
    show,
    type_name,
    world_path,
    write_atomic,
)
from verdict.ops import OPS
from verdict.plan import DIRECTIONS, FORMAT, SHARED_MIN, VERSIONS, Plan
from verdict.progress import progress

#: Top-level fields of a plan, in the order to_data() writes them.
FIELDS = ("format", "version", "world", "logical", "tensors", "nodes", "loss", "grads")
TENSOR_COLUMNS = ("rank", "mb", "tid", "version", "shape", "lver", "slices", "parts")
NODE_COLUMNS = ("rank", "mb", "op", "dir", "inputs", "outputs", "kwargs", "name")


# ---------------------------------------------------------------- writing


def _write_atomic(path: Path, blob: bytes) -> None:
    """Write ``blob`` to ``path`` so that a crash leaves the old file or the new one."""
    write_atomic(path, lambda f: f.write(blob))


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``plan`` to ``path`` (pickle; columnar when ``path`` ends in .npz)
    and its world spec beside it (JSON).

    The data is validated first and pickled by a pickler that refuses any
    object but plain data of exact built-in types (:class:`_PlainPickler`),
    so the bytes hold no global and a file that :func:`load_plan` would
    refuse is never written. Returns both paths.
    """
    path = Path(path)
    spec_path = world_path(path)
    if spec_path == path:
        raise PlanError("a plan file may not end in .json (its world spec goes there)", path)
    if path.suffix == ".npz":
        from verdict.columns import Columns

        try:
            cols = Columns.from_plan(plan)
        except ValueError as e:
            raise PlanError(f"cannot save: {e}", path) from None
        return save_columns_plan(cols, path)
    data = plan.to_data()
    try:
        validate(data)
        blob = _plain_dumps(data)
        spec = json.dumps(plan.world, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except PlanError as e:
        raise PlanError(f"cannot save: {e.problem}", path) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, blob)
    _write_atomic(spec_path, spec.encode())
    return path, spec_path


def save_columns_plan(cols: Any, path: str | os.PathLike[str],
                      validated: bool = False) -> tuple[Path, Path]:
    """Write columns (:class:`verdict.columns.Columns`) as a columnar plan file
    (.npz) and its world spec beside it. Returns both paths. ``validated``:
    as for :func:`backends.columnar.save_columns`."""
    path = Path(path)
    try:
        spec = json.dumps(cols.world, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as e:
        raise PlanError(f"cannot save: world spec: {detail(e)}", path) from None
    columnar.save_columns(cols, path, validated)
    _write_atomic(world_path(path), spec.encode())
    return path, world_path(path)


_PLAIN_TYPES = frozenset({dict, list, tuple, str, int, float, bool, type(None)})


class _PlainPickler(pickle.Pickler):
    """Pickles exact dicts, lists, tuples, strs, ints, floats, bools and None
    only. Those are written with opcodes of their own and never as a global,
    so :class:`_PlainUnpickler` reads back whatever this writes; anything
    else (a subclass, a numpy scalar, an enum) is refused here, at save time."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _PLAIN_TYPES:
            return NotImplemented
        raise PlanError(f"holds a {type_name(obj)} {show(obj)}, which is not plain data")


def _plain_dumps(data: Any) -> bytes:
    stream = io.BytesIO()
    _PlainPickler(stream, protocol=pickle.HIGHEST_PROTOCOL).dump(data)
    return stream.getvalue()


# ---------------------------------------------------------------- reading


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: every global (class or function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise PlanError(
            f"refused global {clip(one_line(f'{module}.{name}'))}: a plan file holds plain "
            "data only, never code or class instances"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise PlanError(f"refused persistent id {show(pid)}: a plan file holds plain data only")


def _read_bytes(path: Path) -> bytes:
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise PlanError("no such file", path) from None
    except IsADirectoryError:
        raise PlanError("is a directory, not a plan file", path) from None
    except PermissionError:
        raise PlanError("not readable (permission denied)", path) from None
    except (OSError, MemoryError) as e:
        raise PlanError(f"cannot read ({detail(e)})", path) from None
    if not blob:
        raise PlanError("empty file (0 bytes)", path)
    return blob


def _unpickle(blob: bytes) -> Any:
    """Plain data from pickle bytes; PlanError (without a path) for anything else."""
    stream = io.BytesIO(blob)
    try:
        data = _PlainUnpickler(stream).load()
    except PlanError:
        raise
    except (pickle.UnpicklingError, EOFError) as e:
        raise PlanError(f"truncated or not a pickle ({detail(e)})") from None
    except MemoryError:
        raise PlanError("not a valid pickle: it declares an object too large for memory") from None
    except Exception as e:  # any input bytes must give a PlanError
        raise PlanError(f"not a valid pickle, or truncated ({detail(e)})") from None
    extra = len(blob) - stream.tell()
    if extra:
        raise PlanError(f"{extra} trailing bytes after the pickle: not a single plan")
    return data


def load_world(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON world spec beside plan ``path`` (same stem, suffix .json)."""
    spec_path = world_path(path)
    blob = _read_bytes(spec_path)
    try:
        spec = json.loads(blob)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise PlanError(f"not valid JSON ({detail(e)})", spec_path) from None
    if not isinstance(spec, dict):
        raise PlanError(f"world spec is a JSON {type_name(spec)}, not an object", spec_path)
    return spec


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Load and validate a plan file, pickled or columnar (told apart by its
    first bytes, not its suffix); every problem is a one-line :class:`PlanError`."""
    path = Path(path)
    if columnar.is_columnar(path):
        plan = columnar.load_columns_file(path).to_plan()
        if world_path(path).exists():
            check_world_matches(plan.world, load_world(path), path)
        return plan
    try:
        data = _unpickle(_read_bytes(path))
        validate(data)
        plan = Plan.from_data(data)
    except PlanError as e:
        raise e.at(path) from None
    except Exception as e:  # a safety net: validate() should catch it all
        raise PlanError(f"invalid plan data ({detail(e)})", path) from None
    if world_path(path).exists():
        check_world_matches(plan.world, load_world(path), path)
    return plan


def load_plan_or_columns(path: str | os.PathLike[str]):
    """A columnar file as its validated columns (no Node objects made:
    ``verdict.engine.verify`` takes columns), any other plan file as a Plan."""
    path = Path(path)
    if not columnar.is_columnar(path):
        return load_plan(path)
    cols = columnar.load_columns_file(path)
    if world_path(path).exists():
        check_world_matches(cols.world, load_world(path), path)
    return cols


# ---------------------------------------------------------------- validation


def validate(data: Any) -> None:
    """Check the format-level integrity of plan data (not operator shape rules).

    Raises :class:`PlanError` (without a path) naming the offending entry.
    """
    _check_header(data)
    check_world(data["world"])
    check_fold_keys(data["world"], data["version"])
    shapes = check_logical(data["logical"])
    n_tensors = _check_tensors(data["tensors"], shapes, data["version"])
    _check_nodes(data["nodes"], n_tensors)
    check_loss_and_grads(data["loss"], data["grads"], len(shapes))


def _check_header(data: Any) -> None:
    if not isinstance(data, dict):
        raise PlanError(f"plan data is a {type_name(data)}, not a dict")
    if "format" not in data:
        raise PlanError("missing field 'format': not a verdict plan")
    if data["format"] != FORMAT:
        got = show(data["format"])
        raise PlanError(f"not a verdict plan: format is {got}, expected {FORMAT!r}")
    if "version" not in data:
        raise PlanError("missing field 'version'")
    version = data["version"]
    if not is_int(version):
        raise PlanError(f"plan version must be an int, got {type_name(version)} {show(version)}")
    if version not in VERSIONS:
        raise PlanError(
            f"unsupported plan version {show(version)}: this verdict reads versions "
            f"{', '.join(map(str, VERSIONS[:-1]))} and {VERSIONS[-1]}"
        )
    for key in FIELDS:
        if key not in data:
            raise PlanError(f"missing field {key!r}")
    for key in data:
        if key not in FIELDS:
            raise PlanError(f"unknown field {show(key)} (fields: {', '.join(FIELDS)})")
    for key in ("logical", "tensors", "nodes", "grads"):
        as_seq(data[key], "plan", f"field {key!r}")
    as_int(data["loss"], "plan", "field 'loss'")


def _check_tensors(rows: Sequence[Any], shapes: list[Shape], file_version: int) -> int:
    seen: dict[tuple[int, int, int, int], int] = {}
    for i, row in enumerate(progress(rows, "checking tensors")):
        where = f"tensor {i}"
        if is_seq(row) and len(row) == len(TENSOR_COLUMNS) + 1:
            if file_version < 3:
                raise PlanError(f"{where}: a scale (9th entry) needs plan version 3, this file "
                                f"is version {file_version}")
            _check_scale(row[-1], where)
            row = row[:-1]
        rank, mb, tid, version, shape, lver, slices, parts = as_row(row, where, TENSOR_COLUMNS)
        as_int(rank, where, "rank", low=0)
        as_int(mb, where, "mb", low=-1)
        as_int(tid, where, "tid", low=0)
        if tid >= len(shapes):
            raise PlanError(f"{where}: tid {tid} is not a logical id (plan has {len(shapes)})")
        as_int(version, where, "version", low=0)
        shape = as_ints(shape, where, "shape", low=0)
        as_int(lver, where, "lver", low=0)
        extents = _check_slices(slices, shapes[tid], where)
        if shape != extents:
            raise PlanError(
                f"{where}: shape {list(shape)} does not match its slices {show(slices)} "
                f"(extents {list(extents)})"
            )
        _check_parts(parts, where)
        key = (rank, mb, tid, version)
        if key in seen:
            raise PlanError(
                f"{where}: same (rank, mb, tid, version) {key} as tensor {seen[key]}"
            )
        seen[key] = i
    return len(rows)


def _check_slices(slices: Any, full: Shape, where: str) -> Shape:
    """Extents of the slices: one [start, end) per dim of the logical shape."""
    as_seq(slices, where, "slices", length=len(full))
    extents = []
    for dim, (pair, size) in enumerate(zip(slices, full, strict=True)):
        start, end = as_ints(as_seq(pair, where, f"slices[{dim}]", length=2), where, f"slices[{dim}]")
        if not (0 <= start <= end <= size and (start < end or size == 0)):
            need = f"0 <= start < end <= {size}" if size else "[0, 0] for a dim of size 0"
            raise PlanError(
                f"{where}: slice {[start, end]} of dim {dim} is outside the logical shape "
                f"{list(full)} (need {need})"
            )
        extents.append(end - start)
    return tuple(extents)


def _check_scale(scale: Any, where: str) -> None:
    """A tensor's factor: [num, den], a nonzero rational (Plan.from_data
    brings it to lowest terms)."""
    as_seq(scale, where, "scale", length=2)
    num, den = as_ints(scale, where, "scale")
    if num == 0 or den <= 0:
        raise PlanError(f"{where}: scale {[num, den]} must be [num, den] with num != 0 and "
                        f"den > 0")


def _check_parts(parts: Any, where: str) -> None:
    as_seq(parts, where, "parts", length=3)
    lo, hi, n = as_ints(parts, where, "parts")
    if not 0 <= lo < hi <= abs(n):
        raise PlanError(f"{where}: parts {[lo, hi, n]} must satisfy 0 <= lo < hi <= |n|")


def _node_label(i: int, row: Sequence[Any]) -> str:
    rank, mb, op = row[0], row[1], row[2]
    return f"node {i} ({op} on rank {rank} mb {mb})"


def _check_node_row(i: int, row: Any, typed: set[int]) -> str:
    """Check one node's columns; returns its label for later messages.
    ``typed``: ids of long inputs lists already checked (shared by nodes)."""
    where = f"node {i}"
    rank, mb, op, direction, inputs, outputs, kwargs, name = as_row(row, where, NODE_COLUMNS)
    as_int(rank, where, "rank", low=0)
    as_int(mb, where, "mb", low=-1)
    as_str(op, where, "op")
    if op not in OPS:
        raise PlanError(f"{where}: unknown operator {show(op)}")
    where = _node_label(i, row)
    if direction not in DIRECTIONS:
        raise PlanError(f"{where}: dir {show(direction)} is not one of {DIRECTIONS}")
    if id(inputs) not in typed:
        as_ints(inputs, where, "inputs")
        if len(inputs) >= SHARED_MIN:
            typed.add(id(inputs))
    as_ints(outputs, where, "outputs")
    if not isinstance(kwargs, dict):
        raise PlanError(f"{where}: kwargs must be a dict, got {type_name(kwargs)}")
    for key in kwargs:
        as_str(key, where, "kwargs key")
    as_str(name, where, "name")
    return where


def _check_indices(where: str, direction: str, what: str, indices: Sequence[int], n: int) -> None:
    for t in indices:
        if t == -1 and direction != "bw":
            raise PlanError(f"{where}: {what} -1 (absent slot) is allowed only in bw nodes")
        if t != -1 and not 0 <= t < n:
            raise PlanError(f"{where}: {what} {t} is not a tensor index (plan has {n} tensors)")


def _check_nodes(rows: Sequence[Any], n_tensors: int) -> None:
    """Columns, index ranges, single assignment, and reads after writes.

    A long inputs list that several nodes share (one object: the members of
    a replica group all read the same gradient buffers) is checked once per
    direction, and its tensors' last writer is computed once: the same
    object holds the same indices, so each node's result is the same.
    Checking it again per node made loading quadratic in the replicas."""
    producer = [-1] * n_tensors
    labels = []
    shared: dict[int, tuple[str, frozenset[int]]] = {}
    typed: set[int] = set()
    for i, row in enumerate(progress(rows, "checking nodes")):
        where = _check_node_row(i, row, typed)
        labels.append(where)
        direction, inputs, outputs = row[3], row[4], row[5]
        members: Any = inputs
        if len(inputs) >= SHARED_MIN:
            seen = shared.get(id(inputs))
            if seen is None or seen[0] != direction:
                _check_indices(where, direction, "input", inputs, n_tensors)
                seen = shared[id(inputs)] = (direction, frozenset(inputs))
            members = seen[1]
        else:
            _check_indices(where, direction, "input", inputs, n_tensors)
        _check_indices(where, direction, "output", outputs, n_tensors)
        for t in outputs:
            if t == -1:
                continue
            if t in members:
                raise PlanError(f"{where}: tensor {t} is both an input and an output")
            if producer[t] >= 0:
                raise PlanError(
                    f"{where}: tensor {t} is already written by node {producer[t]} "
                    "(each tensor is written once)"
                )
            producer[t] = i
    last_writer: dict[int, int] = {}
    for i, row in enumerate(rows):
        inputs = row[4]
        if len(inputs) >= SHARED_MIN:
            last = last_writer.get(id(inputs))
            if last is None:
                last = last_writer[id(inputs)] = max(producer[t] if t >= 0 else -1 for t in inputs)
            if last <= i:
                continue
        for t in inputs:
            if t >= 0 and producer[t] > i:
                raise PlanError(
                    f"{labels[i]}: reads tensor {t} before node {producer[t]} writes it"
                )


def load_plan_data_unchecked(path: str | os.PathLike[str]) -> Plan:
    """Read a plan file that was validated before (a cache entry keyed by its
    bytes). Still safe to open: the restricted unpickler refuses all code."""
    path = Path(path)
    try:
        return Plan.from_data(_unpickle(_read_bytes(path)))
    except PlanError as e:
        raise e.at(path) from None
    except Exception as e:
        raise PlanError(f"invalid cached plan ({detail(e)})", path) from None
