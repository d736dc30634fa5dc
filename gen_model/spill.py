"""Columns kept on disk while a large plan is generated.

The replica expansion (gen_model/replicate.py) makes a plan's columns one
after the other. Held in memory together they cost what the file does (about
80 bytes a node) on top of the expansion's own temporaries; spilled, each
finished column is written to a ``.npy`` file beside the output and replaced
by a read-only memory map of it, whose pages the writer and the validation
read in order and let go (:func:`verdict.columns.drop_pages`). The file is
unlinked as soon as it is mapped: the map keeps its data until the process
drops it, and nothing is left on disk when the process ends, killed or not.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


class Spill:
    """Calling it spills one array to a file in ``near`` and returns its
    read-only map."""

    def __init__(self, near: str | os.PathLike[str]):
        self.near = Path(near)

    def __call__(self, a: np.ndarray) -> np.ndarray:
        if a.size == 0:
            return a
        self.near.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".spill-", suffix=".npy", dir=self.near)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, np.ascontiguousarray(a), allow_pickle=False)
            return np.load(name, mmap_mode="r", allow_pickle=False)
        finally:
            os.unlink(name)


def keep(a: np.ndarray) -> np.ndarray:
    """No spill: the array stays in memory."""
    return a
