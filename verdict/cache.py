"""On-disk cache of proved stages (keyed by their canonical problem); the
cache of loaded plans (keyed by the file's bytes) is the loader's,
backends/plancache.py. Writes are atomic; a corrupt or foreign cache entry
is ignored, never trusted.

Both caches are also keyed by the verifier's own code: a canonical problem
names operators, not their rules, so a proof cached by a version of the
verifier whose rules (or loader, or solver) differ says nothing about this
one. Any change to a source file of ``verdict/`` or ``backends/`` starts
both caches afresh."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

STAGE_CACHE_VERSION = 2
_CODE_DIRS = ("verdict", "backends")


def code_fingerprint() -> str:
    """A hash of every Python source file of the verifier and the plan loader."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for folder in _CODE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def atomic_write(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


class StageCache:
    """Keys of stages proved before, in one JSON file."""

    def __init__(self, cache_dir: Path | None):
        self.path = None if cache_dir is None else cache_dir / "stages.json"
        self.proved: set[str] = set()
        self.code = code_fingerprint()
        if self.path and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                if data.get("version") == STAGE_CACHE_VERSION and data.get("code") == self.code:
                    self.proved = {k for k in data.get("proved", []) if isinstance(k, str)}
            except (OSError, ValueError, AttributeError):
                self.proved = set()

    def save(self, keys: set[str]) -> None:
        if self.path is None:
            return
        self.proved |= keys
        blob = json.dumps({"version": STAGE_CACHE_VERSION, "code": self.code,
                           "proved": sorted(self.proved)})
        atomic_write(self.path, blob.encode())
