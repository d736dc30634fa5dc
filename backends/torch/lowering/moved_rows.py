"""Rows moved by a permutation of their own: how a rank that puts routed
rows out of order is written exactly (docs/soundness.md, "Plans traced
from PyTorch", 103). A helper module: it registers nothing.

A dispatcher that sorts the received rows into the wrong local experts
adds rows back at other copies than they were gathered at, and in the
backward meets an expert's activation rows and gradient rows at two
indices. Both are written as a lookup of a value's rows by a permutation,
a one-hot constant of the rank's own of the value's shape (``lookup``):
the rows ``b[j]`` read at index ``a`` are rows ``a`` of ``P @ base`` with
``(P @ base)[a[k]] = base[j[k]]``. The lookup's values are exactly the
rows read, and it stands in for the value it moves (item 73), a claim
refuted wherever the permutation moves a row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backends.torch.lowering.constants import constant_input

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


def moved_rows(sources: np.ndarray, targets: np.ndarray, rows: int) -> np.ndarray:
    """A permutation ``order`` of ``rows`` rows with ``order[targets[i]] =
    sources[i]`` (both without repeats), every other row in place where it
    can be, the rest in increasing order: row r of the moved value is row
    ``order[r]``."""
    order = np.full(rows, -1, dtype=np.int64)
    order[targets] = sources
    free_src = np.setdiff1d(np.arange(rows), sources)
    free_dst = np.setdiff1d(np.arange(rows), targets)
    stay = np.intersect1d(free_src, free_dst)
    order[stay] = stay
    order[np.setdiff1d(free_dst, stay)] = np.setdiff1d(free_src, stay)
    return order


def lookup(lw: Lowerer, x: int, order: np.ndarray) -> int:
    """Rows ``order`` of x: the one-hot rows of the permutation times x
    (x's shape; the lookup reads the constant once and x once). A 1-d x is
    contracted with the permutation's transpose (``x @ S^T``), which needs
    no reshape of x."""
    shape = tuple(lw.shapes[x])
    if len(shape) == 1:
        table = np.zeros((shape[0], len(order)))
        table[order, np.arange(len(order))] = 1.0
        return lw.emit("embedding", [x, constant_input(lw, table)], [(len(order),)])[0]
    flat = lw.reshape(x, (shape[0], int(np.prod(shape[1:], dtype=np.int64))))
    select = np.zeros((len(order), shape[0]))
    select[np.arange(len(order)), order] = 1.0
    out = lw.emit("embedding", [constant_input(lw, select), flat], [lw.shapes[flat]])[0]
    return lw.reshape(out, shape)


def reread(lw: Lowerer, base: int, index: np.ndarray, at: np.ndarray,
           window: int | None = None) -> int | None:
    """A value whose rows ``at`` are rows ``index`` of ``base``: the base's
    rows moved by a permutation (a lookup), then, for a ``window`` of fewer
    rows than the base has (the copies of this rank's tokens among every
    rank's), cut to the window the rows were most read from
    (``nearest_window``). None when the two indices cannot be so related
    (other lengths, a repeat, a row beyond the base or the window)."""
    rows = lw.shapes[base][0]
    window = rows if window is None else window
    index, at = np.asarray(index, dtype=np.int64), np.asarray(at, dtype=np.int64)
    if len(index) != len(at) or len(np.unique(index)) != len(index) or rows % window \
            or len(np.unique(at)) != len(at) or (len(index) and (
                min(index.min(), at.min()) < 0 or index.max() >= rows or at.max() >= window)):
        return None
    lo = nearest_window(index, at, rows, window)
    moved = lookup(lw, base, moved_rows(index, lo + at, rows))
    if window == rows:
        return moved
    cut = list(lw.shapes[moved])
    cut[0] = window
    out = lw.emit("narrow", [moved], [tuple(cut)], {"dim": 0, "start": lo, "length": window})[0]
    lw.moved_windows.add(out)
    return out


def nearest_window(index: np.ndarray, p: np.ndarray, rows: int, window: int) -> int:
    """The start of the window of ``window`` dense rows that copies ``p``
    are read from: of the windows that tile the rows, the one where the
    most rows stay in place (``index[i] == start + p[i]``), then the one
    holding the most of the rows, then the first. A choice of the claim
    only: whatever it is, the rows moved stand in for the dense rows and
    are proved or refuted as such."""
    def score(k: int) -> tuple[int, int, int]:
        lo = k * window
        inside = int(np.sum((index >= lo) & (index < lo + window)))
        return int(np.sum(index == lo + p)), inside, -k
    return max(range(rows // window), key=score) * window
