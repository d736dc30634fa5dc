"""The glue of a materialized plan, on arrays: what crosses replicas and microbatches.

A part of the block check (:class:`verdict.symmetry.blocks.BlockCheck`, which
inherits it and sets the arrays it reads): the nodes that read another
replica's tensor (:meth:`GlueCheck.orbits`), rule (b), the accumulation
chains (:meth:`GlueCheck.check_chains`), and rules (a), (d) and (f) of the
glue (:meth:`GlueCheck.check_glue`), each stated once in
verdict/symmetry/rules.py. docs/soundness.md, "Folded plans", step 3, and
"Materialized plans", step 1.
"""

from __future__ import annotations

import numpy as np

from verdict.ops import get_op
from verdict.symmetry.arrays import NODE_CHUNK, chunks, spans
from verdict.symmetry.rules import (
    NOT_A_SUM_OF_ENDS,
    NOT_LAST_BUFFER,
    NOT_OWN_INDEX,
    NOT_RUNNING_BUFFER,
    NOT_WHOLE_ORBIT,
    ORBIT_SUMS,
    accumulation_chains,
    ends_with_chains,
    index_kwarg,
    last_writes,
    own_index,
    sum_of_ends,
    whole_orbit,
)


class GlueCheck:
    """Rules (a), (b), (d) and (f) over every node; reads the block check's
    ``cols``, ``p``, ``fold``, ``rank_d``, ``rank_cls``, ``gradbuf_tid``
    and ``owned``, records through its ``flag`` and ``is_acc``, and sets
    ``chain_start`` and ``chain_end``."""

    def orbits(self) -> np.ndarray:
        """Nodes of a group operator that read another replica's tensor, a
        chunk of nodes at a time."""
        cols = self.cols
        group = np.array([get_op(op).group for op in cols.ops], dtype=bool)
        orbit = np.zeros(len(cols.n_op), dtype=bool)
        for lo, hi in chunks(len(orbit)):
            g = np.flatnonzero(group[cols.n_op[lo:hi]]) + lo
            if g.size:
                orbit[g] = self.reads_other_replicas(g)
        return orbit

    def reads_other_replicas(self, g: np.ndarray) -> np.ndarray:
        """Whether each node ``g`` reads a tensor of a replica not its own."""
        cols = self.cols
        tuples, inverse = np.unique(cols.n_ins[g], return_inverse=True)
        ts = cols.flat[spans(cols.ptr, tuples)]
        lengths = cols.ptr[tuples + 1] - cols.ptr[tuples]
        d = self.rank_d[cols.t_rank[np.maximum(ts, 0)]]
        big = self.fold.dp
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        nonempty = lengths > 0
        low = np.full(len(tuples), big)
        high = np.full(len(tuples), -1)
        low[nonempty] = np.minimum.reduceat(np.where(ts >= 0, d, big), starts[nonempty])
        high[nonempty] = np.maximum.reduceat(np.where(ts >= 0, d, -1), starts[nonempty])
        own = self.rank_d[cols.n_rank[g]]
        low, high = low[inverse.reshape(-1)], high[inverse.reshape(-1)]
        return ((low != own) & (low != big)) | ((high != own) & (high != -1))

    def check_chains(self) -> np.ndarray:
        """Rule (b), :func:`~verdict.symmetry.rules.accumulation_chains`, per
        rank and gradient buffer, every accumulation that breaks it flagged.
        Returns the chains' ends (tensors, sorted), which rules (d) and (f)
        read."""
        cols = self.cols
        found = [np.flatnonzero(self.is_acc(slice(lo, hi))) + lo
                 for lo, hi in chunks(len(cols.n_rank))]
        acc = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        if not acc.size:
            return np.zeros(0, dtype=np.int64)
        lengths = cols.ptr[cols.n_ins[acc] + 1] - cols.ptr[cols.n_ins[acc]]
        buf = np.where(lengths > 0, cols.flat[cols.ptr[cols.n_ins[acc]]], -1)
        out = cols.flat[cols.ptr[cols.n_outs[acc]]]
        key_tid = np.where(buf >= 0, cols.t_tid[np.maximum(buf, 0)], -1)
        key = cols.n_rank[acc].astype(np.int64) * (len(self.p.logical) + 1) + key_tid + 1
        zeros_op = np.array([op == "zeros" for op in cols.ops], dtype=bool)
        made = cols.t_producer[np.maximum(buf, 0)]
        from_zeros = (buf >= 0) & (made >= 0) & zeros_op[cols.n_op[np.maximum(made, 0)]] & \
            (cols.t_mb[np.maximum(buf, 0)] == -1)
        order, ok, first, last = accumulation_chains(acc, key, buf, out, from_zeros)
        acc, buf, out = acc[order], buf[order], out[order]
        self.flag(~ok, acc, NOT_RUNNING_BUFFER)
        #: (rank, gradient buffer) -> the zeros buffer its chain starts from
        self.chain_start = {(int(cols.n_rank[a]), int(cols.t_tid[o])): int(b)
                            for a, b, o in zip(acc[first], buf[first], out[first])}
        self.chain_end = {(int(cols.n_rank[a]), int(cols.t_tid[o])): int(o)
                          for a, o in zip(acc[last], out[last])}
        return np.unique(out[last])

    def sums_of_ends(self, is_end: np.ndarray) -> np.ndarray:
        """The nodes (in order) of an orbit-sum operator whose inputs are
        all chain ends (``is_end``). Each distinct input tuple is read once
        (the replicas of a reducer share theirs: a tuple of dp entries read
        per node would be dp times the plan's entries), a bounded number of
        entries at a time."""
        cols = self.cols
        sums_op = np.array([op in ORBIT_SUMS for op in cols.ops], dtype=bool)
        found = [np.flatnonzero(sums_op[cols.n_op[lo:hi]]) + lo
                 for lo, hi in chunks(len(cols.n_rank))]
        cand = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        groups, inverse = np.unique(cols.n_ins[cand], return_inverse=True)
        lengths = (cols.ptr[groups + 1] - cols.ptr[groups]).astype(np.int64)
        upto = np.cumsum(lengths)
        ok = np.ones(len(groups), dtype=bool)  # an empty input tuple holds no other tensor
        lo = 0
        while lo < len(groups):
            hi = max(lo + 1, int(np.searchsorted(upto, upto[lo] - lengths[lo] + NODE_CHUNK,
                                                 side="right")))
            ln = lengths[lo:hi]
            ts = cols.flat[spans(cols.ptr, groups[lo:hi])]
            bad = (ts < 0) | ~is_end[np.maximum(ts, 0)]
            nonempty = np.flatnonzero(ln > 0)
            if len(nonempty):
                starts = (np.cumsum(ln) - ln)[nonempty]
                ok[lo + nonempty] = ~np.logical_or.reduceat(bad, starts)
            lo = hi
        return cand[ok[inverse]]

    def check_glue(self, orbit: np.ndarray, ends: np.ndarray) -> None:
        """(a), (d), (f): orbits are sums of chain ends (``ends``) over
        the whole orbit, at their own index; a rank's last gradient buffer
        is a chain end or such a sum."""
        cols, p = self.cols, self.p
        is_end = np.zeros(len(cols.t_rank), dtype=bool)
        is_end[ends] = True
        sums_ends = self.sums_of_ends(is_end)
        found = [np.flatnonzero(orbit[lo:hi]) + lo for lo, hi in chunks(len(orbit))]
        orbits = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        of_ends = np.isin(orbits, sums_ends)  # of an op of ORBIT_SUMS (sums_of_ends)
        is_sum = np.array([op in ORBIT_SUMS for op in cols.ops], dtype=bool)[cols.n_op[orbits]]
        self.flag(~self.owned.nodes[orbits] & ~sum_of_ends(is_sum, cols.n_mb[orbits], of_ends),
                  orbits, NOT_A_SUM_OF_ENDS)
        sums = orbits[of_ends]
        groups = cols.n_ins[sums]
        whole = {int(g): self.whole_orbit(cols.flat[cols.ptr[g]:cols.ptr[g + 1]])
                 for g in np.unique(groups)}
        not_whole = np.array([not whole[int(g)] for g in groups], dtype=bool)
        self.flag(not_whole, sums, NOT_WHOLE_ORBIT)
        index_of = {code: index_kwarg(self.p.kwargs_of(code))  # kwargs code -> its index
                    for code in np.unique(cols.n_kw[sums]).tolist()}
        index = np.array([index_of[c] for c in cols.n_kw[sums].tolist()], dtype=np.int64)

        def rank_at(valid: np.ndarray, index: np.ndarray) -> np.ndarray:
            member = cols.flat[np.where(valid, cols.ptr[groups] + index, 0)]
            return np.where(member >= 0, cols.t_rank[np.maximum(member, 0)], -1)

        own = own_index(index, cols.ptr[groups + 1] - cols.ptr[groups], rank_at,
                        cols.n_rank[sums])
        self.flag(~not_whole & ~own, sums, NOT_OWN_INDEX)
        # (f) the gradient buffer a rank ends with
        t, writer = self.gradbuf_writes(len(cols.ptr) - 1 - len(cols.n_rank))
        if not len(t):
            return
        key = cols.t_rank[t].astype(np.int64) * (len(p.logical) + 1) + cols.t_tid[t]
        last = last_writes(key, writer)
        w, out = writer[last], t[last]
        ok = ends_with_chains(self.is_acc(w) & is_end[out], np.isin(w, sums_ends)) | \
            self.owned.keeps[w]
        self.flag(~ok, w, NOT_LAST_BUFFER)

    def gradbuf_writes(self, n_in: int) -> tuple[np.ndarray, np.ndarray]:
        """The gradient buffers written and their writers, in node order:
        the output tuples lie after the ``n_in`` input tuples in flat, one
        per node (arrays()); read a chunk of nodes at a time."""
        cols = self.cols
        nn = len(cols.n_rank)
        out_ptr = cols.ptr[n_in:]
        found_t, found_w = [np.zeros(0, dtype=cols.flat.dtype)], [np.zeros(0, dtype=np.int64)]
        for lo in range(0, nn, NODE_CHUNK):
            hi = min(lo + NODE_CHUNK, nn)
            t = cols.flat[int(out_ptr[lo]): int(out_ptr[hi])]
            writer = np.repeat(np.arange(lo, hi), np.diff(out_ptr[lo: hi + 1]))
            keep = t >= 0
            t, writer = t[keep], writer[keep]
            g = self.gradbuf_tid[cols.t_tid[t]]
            found_t.append(t[g])
            found_w.append(writer[g])
        return np.concatenate(found_t), np.concatenate(found_w)

    def whole_orbit(self, members: np.ndarray) -> bool:
        """Rule (a), :func:`~verdict.symmetry.rules.whole_orbit`, of a
        collective's input tensors (none absent)."""
        if (members < 0).any():
            return False
        rank = self.cols.t_rank[members]
        return whole_orbit(self.rank_cls[rank], self.rank_d[rank], self.fold.dp)
