"""ZeRO's owned shards: what the scan of a plan finds, and what its parts share.

:class:`Owned` is what verdict/symmetry/owned.py's :func:`find_owned` hands the
block check and the cut; :class:`OwnedError` says why a plan's shards are
none the symmetry covers (the plan is then verified in full). The functions
below read the block check's arrays (verdict/symmetry/arrays.py) for both
parts of the scan (owned.py, the gathers; owned_grads.py, what becomes of
their gradients and shards). docs/soundness.md, "ZeRO-1: owned shards".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class OwnedError(Exception):
    """Why the owned shards of a plan are not ones the symmetry covers."""


@dataclass(frozen=True)
class Owned:
    """What the block check and the cut need: the gathers, keeps and
    gathers of updated shards (node masks), the gathers' outputs (a tensor
    mask), for each loaded shard the dim and offset the block check
    subtracts from its slices, and, for an optimizer step on owned shards,
    the inputs the cut gives it (node -> position -> tensor) and the boxes
    its shards widen to (tensor -> slices)."""

    gathers: np.ndarray
    keeps: np.ndarray
    updates: np.ndarray
    gathered: np.ndarray
    shifts: tuple[np.ndarray, np.ndarray, np.ndarray]  # (tensor, dim, offset), by tensor
    rewire: dict[int, dict[int, int]]
    widen: dict[int, list[tuple[int, int]]]
    #: ZeRO-2/3: the reduce-scatters inside microbatches (a node mask), each
    #: one's output -> its input at its own index (the block's whole-box value)
    scatters: np.ndarray | None = None
    scattered: dict[int, int] = field(default_factory=dict)
    #: ZeRO-2/3: (rank, gradient buffer tid) -> the box its chain of reduced
    #: shards widens to in the cut, where a reducer sums the chain ends
    reduced: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)
    #: expert parallelism: the in-block gathers of a shared parameter's
    #: loaded shards over the ep ranks of one replica, whose outputs the
    #: orbit's gathers read, and (ZeRO-2/3) the in-block scatters of the
    #: orbit's scatters' outputs (a node mask); compared with their index,
    #: dropped by the cut with the gathers and scatters they go with
    inner: np.ndarray | None = None
    #: ZeRO-2/3 with expert parallelism: the (rank, gradient buffer tid) of
    #: ``reduced`` scattered in two levels, whose reducer in the cut sums the
    #: chain ends of every ep rank of the shown replicas
    reduced_ep: frozenset = frozenset()

    @property
    def nodes(self) -> np.ndarray:
        """The nodes whose ``index`` is their replica (compared without it),
        which the cut drops."""
        out = self.gathers | self.keeps | self.updates
        return out if self.scatters is None else out | self.scatters

    @property
    def dropped(self) -> np.ndarray:
        """The nodes the cut leaves out: :attr:`nodes` and the in-block gathers."""
        return self.nodes if self.inner is None else self.nodes | self.inner

    @staticmethod
    def none(nodes: int, tensors: int) -> Owned:
        return Owned(np.zeros(nodes, dtype=bool), np.zeros(nodes, dtype=bool),
                     np.zeros(nodes, dtype=bool), np.zeros(tensors, dtype=bool),
                     (np.zeros(0, dtype=np.int64),) * 3, {}, {})


def inputs_of(cols, nodes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every (tensor read, node reading it) of ``nodes`` (all by default)."""
    nodes = np.arange(len(cols.n_rank)) if nodes is None else nodes
    tuples = cols.n_ins[nodes]
    lengths = cols.ptr[tuples + 1] - cols.ptr[tuples]
    starts = np.repeat(cols.ptr[tuples] - np.concatenate(([0], np.cumsum(lengths)[:-1])),
                       lengths)
    read = cols.flat[starts + np.arange(int(lengths.sum()))].astype(np.int64)
    return read, np.repeat(nodes, lengths)


def read_counts(cols) -> np.ndarray:
    """How many nodes read each tensor."""
    out = np.zeros(len(cols.t_rank), dtype=np.int64)
    read = inputs_of(cols)[0]
    np.add.at(out, read[read >= 0], 1)
    return out


def last_writers(cols, buf_of: dict[int, int], skip: np.ndarray | None = None
                  ) -> dict[tuple[int, int], int]:
    """(rank, parameter) -> the last node (in plan order, but the nodes
    ``skip``) writing one of its gradient buffers."""
    lengths = cols.ptr[cols.n_outs + 1] - cols.ptr[cols.n_outs]
    starts = np.repeat(cols.ptr[cols.n_outs] - np.concatenate(([0], np.cumsum(lengths)[:-1])),
                       lengths)
    t = cols.flat[starts + np.arange(int(lengths.sum()))].astype(np.int64)
    writer = np.repeat(np.arange(len(cols.n_rank)), lengths)
    bufs = np.array(sorted(buf_of), dtype=np.int64)
    keep = (t >= 0) & np.isin(cols.t_tid[np.maximum(t, 0)], bufs)
    if skip is not None:
        keep &= ~skip[writer]
    t, writer = t[keep], writer[keep]
    last: dict[tuple[int, int], int] = {}
    for rank, tid, i in zip(cols.t_rank[t].tolist(), cols.t_tid[t].tolist(), writer.tolist()):
        if last.get((rank, buf_of[tid]), -1) < i:
            last[(rank, buf_of[tid])] = i
    return last


def check_loaded(cols, kinds: list[str], shard_of: dict) -> None:
    """A rank that gathers a parameter loads of it only its own shard."""
    loaded = np.flatnonzero((cols.t_producer < 0) & (cols.t_lver == 0) & np.array(
        [k == "param" for k in kinds] or [False])[cols.t_tid])
    for t in loaded.tolist():
        key = (int(cols.t_rank[t]), int(cols.t_tid[t]))
        if key in shard_of and shard_of[key][2] != t:
            refuse(f"rank {key[0]} loads a second piece of a parameter it gathers")


def refuse(why: str):
    raise OwnedError(why)
