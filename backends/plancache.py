"""The cache of loaded plans: a pickled plan file validated once is read
again without validation while its bytes (and the verifier's code) are the
same. A columnar file is not cached: it opens and validates faster than its
bytes hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

from backends.columnar import is_columnar
from backends.planfile import PlanError, load_plan, load_plan_data_unchecked, load_plan_or_columns
from verdict.cache import atomic_write, code_fingerprint
from verdict.plan import VERSION


def file_key(path: Path) -> str:
    h = hashlib.sha256(f"plan-v{VERSION}:{code_fingerprint()}:".encode())
    h.update(path.read_bytes())
    return h.hexdigest()


def load_plan_cached(path: Path, cache_dir: Path | None, columns: bool = False):
    """A plan file, validated once: later loads of the same bytes skip validation.
    With ``columns``, a columnar file is returned as its columns
    (``verdict.columns.Columns``), not as a Plan."""
    if is_columnar(path) and columns:
        return load_plan_or_columns(path)
    if cache_dir is None or is_columnar(path):
        return load_plan(path)
    try:
        key = file_key(path)
    except OSError:
        return load_plan(path)
    entry = cache_dir / "plans" / f"{key}.pkl"
    if entry.exists():
        try:
            return load_plan_data_unchecked(entry)
        except PlanError:
            entry.unlink(missing_ok=True)
    plan = load_plan(path)
    atomic_write(entry, path.read_bytes())
    return plan
