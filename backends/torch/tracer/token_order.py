"""The ranks' order of the flattened token rows (docs/soundness.md, "Plans
traced from PyTorch", 89).

A mixture of experts flattens two dims of its activations into token rows:
(batch, position) in most models, (position, batch) in a sequence-first
one (Megatron-Core's ``[s, b]``). When both dims are cut over the ranks
(torchtitan's data and sequence parallelism), or the inner one is
(Megatron's data parallelism), a rank's rows are its block of each dim,
flattened: a strided set of the single-device rows, no one interval, so no
claim of a block states them.

Laid out in the ranks' order instead (each rank's rows in its own order,
the ranks one after another in the order their claim's axes number them),
every rank's rows are one contiguous block. That order is a permutation pi
of the rows, and the same permutation is an explicit chain of shape ops:
each flattened dim split into (parts, rows of a part), the parts' axes
moved in front, flattened again (``RowGrid.chain``). On a rank, whose dims
are one part each, that chain moves only dims of size 1: it is the
identity. This module computes the order and its chain, checks that they
agree and that the ranks' rows are exactly its blocks, and relabels the
recorded constants that hold token rows (``rows_in_order``) or token row
numbers (``numbers_in_order``) for a step written in that order. Anything
else (ranks whose rows overlap, miss rows, or are of unequal sizes) is
refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.torch.errors import LoweringError

#: a rank's rows of one flattened dim: [start, stop)
Span = tuple[int, int]


def _refuse(why: str) -> LoweringError:
    return LoweringError(f"the ranks' order of the token rows: {why}; not verified "
                         f"(docs/soundness.md, \"Plans traced from PyTorch\", 89)")


@dataclass(frozen=True)
class RowGrid:
    """Token rows made by flattening two dims, ``outer`` of size
    ``sizes[0]`` and ``inner`` of ``sizes[1]`` (row ``o * sizes[1] + i``),
    each cut into ``parts`` equal blocks over the ranks. ``inner_first``:
    the ranks' claim numbers the inner dim's block first (Megatron's data
    parallelism cuts the batch, the inner dim of ``[s, b]``)."""

    sizes: tuple[int, int]
    parts: tuple[int, int]
    inner_first: bool = False

    def __post_init__(self) -> None:
        for size, parts in zip(self.sizes, self.parts):
            if parts < 1 or size % parts:
                raise _refuse(f"a dim of {size} rows is not cut into {parts} equal blocks")

    @property
    def rows(self) -> int:
        return self.sizes[0] * self.sizes[1]

    def block(self, outer: int, inner: int) -> int:
        """The position of the rank holding block ``outer`` of the outer
        dim and block ``inner`` of the inner dim, in the ranks' order."""
        if self.inner_first:
            return inner * self.parts[0] + outer
        return outer * self.parts[1] + inner

    def chain(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shape ops that lay the rows out in the ranks' order: reshape
        the flattened rows to ``split`` (each dim as (parts, rows of a
        part)), permute its axes by ``axes``, flatten. On a rank (parts 1)
        the permutation moves only dims of size 1."""
        (so, si), (po, pi_) = self.sizes, self.parts
        split = (po, so // po, pi_, si // pi_)
        axes = (2, 0, 1, 3) if self.inner_first else (0, 2, 1, 3)
        return split, axes

    def order(self) -> np.ndarray:
        """pi: row j of the rows in the ranks' order is row ``pi[j]`` of the
        flattened rows (the chain applied to the row numbers)."""
        split, axes = self.chain()
        return np.arange(self.rows).reshape(split).transpose(axes).reshape(-1)

    def rank_rows(self, outer: int, inner: int) -> np.ndarray:
        """The flattened rows of the rank holding those blocks, in its own
        order (its block of each dim, outer first)."""
        (so, si), (po, pi_) = self.sizes, self.parts
        lo, li = so // po, si // pi_
        return held_rows(self, np.arange(outer * lo, (outer + 1) * lo),
                         np.arange(inner * li, (inner + 1) * li))


def held_rows(grid: RowGrid, outer: np.ndarray, inner: np.ndarray) -> np.ndarray:
    """The flattened rows a rank flattens when it holds rows ``outer`` of
    the outer dim and ``inner`` of the inner dim (what it loaded: its batch
    rows and positions), in its own order, outer first."""
    return (np.asarray(outer)[:, None] * grid.sizes[1] + np.asarray(inner)[None, :]).reshape(-1)


def check_blocks(grid: RowGrid, ranks: dict[int, np.ndarray]) -> dict[int, int]:
    """Each rank's token rows (``held_rows``, in its own order) found as a
    block of the rows laid out in the ranks' order, and the ranks' distinct
    blocks covering every row once (ranks holding the same rows, replicas,
    hold the same block). The block each rank holds; refused in one line
    otherwise. The order is found from what the ranks hold, never assumed."""
    pi = grid.order()
    count = grid.parts[0] * grid.parts[1]
    per = grid.rows // count
    blocks = {tuple(pi[k * per:(k + 1) * per]): k for k in range(count)}
    found: dict[int, int] = {}
    for rank, rows in sorted(ranks.items()):
        at = blocks.get(tuple(np.asarray(rows).tolist()))
        if at is None:
            raise _refuse(f"rank {rank}'s {len(rows)} token rows are no block of the "
                          f"{grid.rows} rows in the ranks' order")
        found[rank] = at
    missing = sorted(set(range(count)) - set(found.values()))
    if missing:
        raise _refuse(f"no rank holds block {missing[0]} of the token rows in the ranks' order")
    return found


def inverse(pi: np.ndarray) -> np.ndarray:
    """inv with ``inv[pi[j]] = j``: where row r of the flattened rows is
    in the ranks' order."""
    inv = np.empty_like(pi)
    inv[pi] = np.arange(len(pi))
    return inv


def per_slot(pi: np.ndarray, slots: int) -> np.ndarray:
    """The order of (token, slot) pairs numbered ``t * slots + k``: each
    token's pairs move with it, in slot order."""
    return (pi[:, None] * slots + np.arange(slots)[None, :]).reshape(-1)


def rows_in_order(const: np.ndarray, pi: np.ndarray, dim: int = 0,
                  slots: int = 1) -> np.ndarray:
    """A recorded constant with a dim of token rows (or of (token, slot)
    pairs, ``slots`` per token: a routing's indices flattened) in the
    ranks' order: row j is the constant's row ``pi[j]``."""
    order = per_slot(pi, slots) if slots > 1 else pi
    if const.shape[dim] != len(order):
        raise _refuse(f"a constant's dim {dim} of {const.shape[dim]} rows is not the "
                      f"{len(order)} token rows")
    return np.take(const, order, axis=dim)


def numbers_in_order(const: np.ndarray, pi: np.ndarray, slots: int = 1) -> np.ndarray:
    """A recorded constant whose values number token rows (or (token, slot)
    pairs): each number replaced by where that row is in the ranks' order,
    so that indexing the reordered rows picks the same rows as before."""
    inv = per_slot(inverse(pi), slots) if slots > 1 else inverse(pi)
    values = np.asarray(const)
    if values.size and (values.min() < 0 or values.max() >= len(inv)):
        raise _refuse(f"a constant numbers rows outside the {len(inv)} token rows")
    return inv[values]
