"""The checks the plan-file and columnar readers share, and their one error.

Both readers (backends/planfile.py, backends/columnar.py) report every
problem as one :class:`PlanError` whose message is one line, and check a
plan's world spec, logical tensors, loss and gradients, and a folded plan's
keys, with the functions here; each keeps the checks of its own format.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from verdict.plan import FOLD_KEYS, KINDS

LOGICAL_COLUMNS = ("name", "shape", "kind")

_SHOW_LIMIT = 60
_DETAIL_LIMIT = 200
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1  # ints in a plan fit in 64 bits

Shape = tuple[int, ...]


class PlanError(ValueError):
    """A plan file that cannot be used. ``str()`` is one line: ``<path>: <problem>``."""

    def __init__(self, problem: str, path: str | os.PathLike[str] | None = None) -> None:
        self.problem = one_line(problem)
        self.path = None if path is None else Path(path)
        super().__init__(self.problem, self.path)

    def __str__(self) -> str:
        if self.path is None:
            return self.problem
        return one_line(f"{self.path}: {self.problem}")

    def at(self, path: str | os.PathLike[str]) -> PlanError:
        """The same problem, reported against ``path``."""
        return PlanError(self.problem, path)


# ---------------------------------------------------------------- messages


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def clip(text: str, limit: int = _SHOW_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show(value: Any) -> str:
    """A short, safe repr of a value read from a file, for messages."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # ints beyond the str-digits limit, deep nesting
        text = f"<{type(value).__name__}>"
    return clip(one_line(text))


def type_name(value: Any) -> str:
    return type(value).__name__


def detail(exc: BaseException) -> str:
    return clip(one_line(f"{type_name(exc)}: {exc}"), _DETAIL_LIMIT)


# ---------------------------------------------------------------- paths and writing


def world_path(path: str | os.PathLike[str]) -> Path:
    """The JSON world spec beside a plan file: same stem, suffix .json."""
    return Path(path).with_suffix(".json")


def write_atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then move it to
    ``path``: a crash leaves the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- values


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_seq(x: Any) -> bool:
    return isinstance(x, (list, tuple))


def as_int(x: Any, where: str, what: str, low: int | None = None) -> int:
    if not is_int(x):
        raise PlanError(f"{where}: {what} must be an int, got {type_name(x)} {show(x)}")
    if not _INT_MIN <= x <= _INT_MAX:
        raise PlanError(f"{where}: {what} does not fit in 64 bits")
    if low is not None and x < low:
        raise PlanError(f"{where}: {what} must be >= {low}, got {x}")
    return x


def as_seq(x: Any, where: str, what: str, length: int | None = None) -> Sequence[Any]:
    if not is_seq(x):
        raise PlanError(f"{where}: {what} must be a list, got {type_name(x)}")
    if length is not None and len(x) != length:
        raise PlanError(f"{where}: {what} must have {length} entries, got {len(x)}")
    return x


def as_ints(x: Any, where: str, what: str, low: int | None = None) -> tuple[int, ...]:
    return tuple(as_int(v, where, f"{what}[{i}]", low) for i, v in enumerate(as_seq(x, where, what)))


def as_str(x: Any, where: str, what: str) -> str:
    if not isinstance(x, str):
        raise PlanError(f"{where}: {what} must be a str, got {type_name(x)} {show(x)}")
    return x


def as_row(x: Any, where: str, columns: Sequence[str]) -> Sequence[Any]:
    if not is_seq(x) or len(x) != len(columns):
        got = f"{len(x)} entries" if is_seq(x) else type_name(x)
        raise PlanError(f"{where}: must be a list [{', '.join(columns)}], got {got}")
    return x


# ---------------------------------------------------------------- checks of both formats


def check_world(world: Any) -> None:
    """The world spec is a flat dict of JSON scalars, so it round-trips through JSON."""
    if not isinstance(world, dict):
        raise PlanError(f"field 'world' must be a dict, got {type_name(world)}")
    for key, value in world.items():
        where = f"world {show(key)}"
        if not isinstance(key, str):
            raise PlanError(f"{where}: keys must be str, got {type_name(key)}")
        if not (value is None or isinstance(value, (str, int, float))):
            allowed = "a str, number, bool or None"
            raise PlanError(f"{where}: value must be {allowed}, not {type_name(value)}")
        if is_int(value):
            as_int(value, where, "value")
        if isinstance(value, float) and not math.isfinite(value):
            raise PlanError(f"{where}: value must be a finite number, got {value}")


def check_fold_keys(world: dict, version: int | None = None) -> None:
    """A folded plan's keys: all three, positive ints, and in a plan file
    (``version`` given) version 2 or later."""
    present = [k for k in FOLD_KEYS if k in world]
    if not present:
        return
    if version is not None and version < 2:
        raise PlanError(f"world {present[0]!r}: folded-plan keys need plan version 2, "
                        f"this file is version {version}")
    if len(present) != len(FOLD_KEYS):
        raise PlanError(f"world: a folded plan needs all of {', '.join(FOLD_KEYS)}; "
                        f"it has {', '.join(present)}")
    for key in FOLD_KEYS:
        if not is_int(world[key]) or world[key] < 1:
            raise PlanError(f"world {key!r}: must be an int >= 1, got {show(world[key])}")


def check_logical(rows: Sequence[Any]) -> list[Shape]:
    shapes = []
    for i, row in enumerate(rows):
        where = f"logical {i}"
        name, shape, kind = as_row(row, where, LOGICAL_COLUMNS)
        as_str(name, where, "name")
        shapes.append(as_ints(shape, where, "shape", low=0))
        if kind not in KINDS:
            raise PlanError(f"{where} ({show(name)}): kind {show(kind)} is not one of {KINDS}")
    return shapes


def check_loss_and_grads(loss: int, grads: Sequence[Any], n_logical: int) -> None:
    if not 0 <= loss < n_logical:
        raise PlanError(f"loss {loss} is not a logical id (plan has {n_logical})")
    params: dict[int, int] = {}
    for i, pair in enumerate(grads):
        where = f"grad {i}"
        param, grad = as_ints(as_seq(pair, where, "entry", length=2), where, "entry")
        for what, tid in (("param", param), ("grad", grad)):
            if not 0 <= tid < n_logical:
                raise PlanError(f"{where}: {what} {tid} is not a logical id (plan has {n_logical})")
        if param in params:
            raise PlanError(f"{where}: param {param} already has a gradient (grad {params[param]})")
        params[param] = i


def check_world_matches(world: dict[str, Any], spec: dict[str, Any], path: Path) -> None:
    if spec == world:
        return
    for key in sorted(set(world) | set(spec)):
        if world.get(key, ...) != spec.get(key, ...):
            got = show(spec[key]) if key in spec else "nothing"
            want = show(world[key]) if key in world else "nothing"
            raise PlanError(
                f"world spec {world_path(path).name} does not match the plan: "
                f"{show(key)} is {got} in the JSON but {want} in the plan",
                path,
            )
