"""Columns kept on disk while a large plan is generated.

The replica expansion (gen_model/replicate.py) makes a plan's columns one
after the other. Held in memory together they cost what the file does (about
80 bytes a node) on top of the expansion's own temporaries; spilled, each
finished column is written to a ``.npy`` file in a temporary directory and
replaced by a read-only memory map of it, whose pages the writer and the
validation read in order and let go (:func:`verdict.columns.drop_pages`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import TracebackType

import numpy as np


class Spill:
    """A temporary directory of spilled columns (removed on exit); calling
    it spills one array and returns its read-only map."""

    def __init__(self, near: str | Path):
        self.near = Path(near)
        self.dir: Path | None = None
        self.count = 0

    def __enter__(self) -> Spill:
        self.near.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=".spill-", dir=self.near))
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __call__(self, a: np.ndarray) -> np.ndarray:
        if self.dir is None:
            raise RuntimeError("Spill used outside its with block")
        if a.size == 0:
            return a
        path = self.dir / f"{self.count}.npy"
        self.count += 1
        np.save(path, np.ascontiguousarray(a), allow_pickle=False)
        return np.load(path, mmap_mode="r", allow_pickle=False)


def keep(a: np.ndarray) -> np.ndarray:
    """No spill: the array stays in memory."""
    return a
