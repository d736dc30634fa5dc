"""Each node of a materialized plan matched with its representative's, on arrays.

A part of the block check (:class:`verdict.symmetry.blocks.BlockCheck`, which
inherits it and sets the arrays it reads): every block program (class, d, m)
and step program (class, d) is laid beside its class's representative one,
node by node (:meth:`ProgramMatch.representatives`), every class runs a
program in every block (:meth:`ProgramMatch.check_present`), and each node's
operator, direction and kwargs equal its representative node's up to what
differs between blocks by construction (:meth:`ProgramMatch.check_kwargs`:
an orbit's or an owned shard's own ``index``, a send/receive peer's
replica). docs/soundness.md, "Folded plans", step 3, and "Materialized
plans", step 1.
"""

from __future__ import annotations

import json

import numpy as np

from verdict.lineage import StructureError
from verdict.symmetry.arrays import I32, chunks, fitting, index_array, member_mask


class ProgramMatch:
    """The matching of nodes with their representatives' and the comparison
    of their kwargs; reads the block check's ``cols``, ``p``, ``fold``,
    ``mesh``, ``rank_d``, ``rank_cls``, ``cp``, ``tp``, ``rep_of_d``,
    ``rep_of_m``, ``owned`` and records through its ``flag``."""

    def representatives(self, only: np.ndarray | None = None) -> np.ndarray:
        """For each node, the node at its position in its class's
        representative program ((class, 0, 0) for a block, (class, 0) for
        a step program; (class, rep(d), rep(m)) and (class, rep(d)) when
        ``rep_of_d``/``rep_of_m`` are set); -1 where that program is shorter. Raises when a
        class lacks a block or a step program of some replica.

        Three passes over the nodes, a chunk at a time: the blocks present
        and their sizes; each node's position in its block and the blocks'
        nodes in order (a stable counting sort); each node's representative.
        Only those two and the answer span the whole plan (the position in
        the narrowest type that holds the largest block's size)."""
        nn = len(self.cols.n_rank)
        ids = self.block_ids()
        self.check_present(ids)
        kind = np.int32 if max(len(ids), 2 * nn) < I32.max else np.int64
        counts = np.zeros(len(ids), dtype=np.int64)
        for lo, hi in chunks(nn):
            b = np.searchsorted(ids, self.block_of(lo, hi, False))
            counts += np.bincount(b, minlength=len(ids))
        starts = np.zeros(len(ids), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        order = np.empty(nn, dtype=kind)  # the nodes block by block, in node order within one
        # each node's position in its block
        pos = np.empty(nn, dtype=fitting(int(counts.max(initial=0))))
        filled = np.zeros(len(ids), dtype=np.int64)
        for lo, hi in chunks(nn):
            b = np.searchsorted(ids, self.block_of(lo, hi, False))
            sort = np.argsort(b, kind="stable")
            first = np.searchsorted(b[sort], b[sort], side="left")
            within = np.empty(len(b), dtype=np.int64)
            within[sort] = np.arange(len(b)) - first
            at = filled[b] + within
            pos[lo:hi] = at
            order[starts[b] + at] = np.arange(lo, hi, dtype=kind)
            filled += np.bincount(b, minlength=len(ids))
        rep = np.empty(nn, dtype=index_array(np.array([nn])).dtype)
        for lo, hi in chunks(nn):
            own_size = counts[np.searchsorted(ids, self.block_of(lo, hi, False))]
            rep_block = self.block_of(lo, hi, True)
            where = np.minimum(np.searchsorted(ids, rep_block), len(ids) - 1)
            found = ids[where] == rep_block
            size = np.where(found, counts[where], 0)
            at = pos[lo:hi]
            found &= at < size
            got = np.where(found, order[np.minimum(starts[where] + at, nn - 1)], -1)
            rep[lo:hi] = got
            if only is not None:
                own_size = np.where(only[lo:hi], own_size, size)
            self.flag(own_size != size, np.arange(lo, hi), "its block has another number of "
                      "nodes than the representative's",
                      np.where(got >= 0, got, order[starts[where]]))
        return rep

    def block_ids(self) -> np.ndarray:
        """The distinct blocks of the nodes (:meth:`block_of`), sorted."""
        found = [np.unique(self.block_of(lo, hi, False))
                 for lo, hi in chunks(len(self.cols.n_rank))]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)

    def block_of(self, lo: int, hi: int, representative: bool) -> np.ndarray:
        """The block of nodes lo..hi-1 (class, replica, microbatch + 1, 0:
        outside microbatches) as one int64, or with ``representative`` the
        block of their representative (``rep_of_d``, ``rep_of_m``)."""
        dp, nm = self.fold.dp, self.fold.nm
        rank = self.cols.n_rank[lo:hi]
        d = self.rank_d[rank].astype(np.int64)
        mb = self.cols.n_mb[lo:hi].astype(np.int64)
        slot = mb + 1
        if representative:
            d = 0 if self.rep_of_d is None else self.rep_of_d.astype(np.int64)[d]
            slot = np.minimum(slot, 1) if self.rep_of_m is None else \
                np.where(slot > 0, self.rep_of_m.astype(np.int64)[np.maximum(mb, 0)] + 1, 0)
        return (self.rank_cls[rank].astype(np.int64) * dp + d) * (nm + 1) + slot

    def check_present(self, ids: np.ndarray) -> None:
        """Every class with a block program has one for each (d, m), and a
        class with a step program on replica 0 has one on every replica."""
        dp, nm = self.fold.dp, self.fold.nm
        slot = ids % (nm + 1)
        cls_d = ids // (nm + 1)
        cls = cls_d // dp
        for which, mask, want in (("blocks (replica, microbatch)", slot > 0, dp * nm),
                                  ("step programs (outside microbatches)", slot == 0, dp)):
            classes, counts = np.unique(cls[mask], return_counts=True)
            short = classes[counts != want]
            if short.size:
                raise StructureError("symmetry", (
                    f"rank class {self.class_name(int(short[0]))} runs "
                    f"{int(counts[counts != want][0])} {which}, not {want}: a replica or "
                    f"microbatch lacks its program"))

    def class_name(self, cls: int) -> tuple[int, int, int]:
        t = cls % self.tp
        c = (cls // self.tp) % self.cp
        return cls // (self.tp * self.cp), c, t

    def check_kwargs(self, rep: np.ndarray, orbit: np.ndarray,
                     only: np.ndarray | None = None) -> None:
        """Operator, direction and kwargs equal the representative's (of the
        nodes ``only``, default all); an orbit's ``index`` is compared as
        its own position (checked in :meth:`check_glue`), a send/receive
        peer as its class, in the replica."""
        cols = self.cols
        special, special_kw = self.normal_kwargs(orbit)

        def kwargs_code(nodes: np.ndarray) -> np.ndarray:
            """The kwargs code of nodes, the normalized one where there is one."""
            kw = cols.n_kw[nodes].astype(np.int64)
            at = np.minimum(np.searchsorted(special, nodes), max(len(special) - 1, 0))
            hit = special[at] == nodes if len(special) else np.zeros(len(nodes), dtype=bool)
            kw[hit] = special_kw[at[hit]]
            return kw

        for lo, hi in chunks(len(cols.n_kw)):
            nodes = np.arange(lo, hi)
            kw = kwargs_code(nodes)
            self.flag(kw == -1, nodes, "its send/receive peer is in another replica")
            ok = rep[lo:hi] >= 0
            if only is not None:
                ok &= only[lo:hi]
            r = np.maximum(rep[lo:hi], 0)
            self.flag(ok & ((cols.n_op[lo:hi] != cols.n_op[r]) | (cols.n_dir[lo:hi] != cols.n_dir[r])),
                      nodes, "another operator or direction", rep[lo:hi])
            self.flag(ok & (kw != kwargs_code(r)), nodes, "other kwargs", rep[lo:hi])
            for tuples, what in ((cols.n_ins, "inputs"), (cols.n_outs, "outputs")):
                own, of_r = tuples[lo:hi], tuples[r]
                n = cols.ptr[own + 1] - cols.ptr[own]
                self.flag(ok & (n != cols.ptr[of_r + 1] - cols.ptr[of_r]), nodes,
                          f"another number of {what}", rep[lo:hi])

    def normal_kwargs(self, orbit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The nodes whose kwargs are compared normalized, in order, and
        their normalized codes (-1: a send/receive peer in another replica).
        An orbit's or an owned shard's ``index`` is left out (checked in
        :meth:`check_glue` and verdict/symmetry/owned.py), a send/receive peer is
        its class, in the replica."""
        cols, p = self.cols, self.p
        is_send = np.array([op == "send_recv" for op in cols.ops] or [False])
        owned = np.flatnonzero(self.owned.nodes)
        found = [np.flatnonzero(orbit[lo:hi] | member_mask(owned, lo, hi) | is_send[cols.n_op[lo:hi]])
                 + lo for lo, hi in chunks(len(cols.n_kw))]
        special = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        if not len(special):
            return special, np.zeros(0, dtype=np.int64)
        own_index = orbit[special] | np.isin(special, owned)
        # one normalization per (kwargs code, replica, own index), made as its first node has it
        own_d = self.rank_d[cols.n_rank[special]].astype(np.int64)
        keys = np.stack((cols.n_kw[special].astype(np.int64), own_d,
                         own_index.astype(np.int64)), axis=1)
        distinct, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        table: dict[str, int] = {}
        normal = np.empty(len(distinct), dtype=np.int64)
        for k, ((code, own_d, own), i) in enumerate(zip(distinct.tolist(), special[first].tolist())):
            kwargs = p.kwargs_of(code)
            if own:
                kwargs.pop("index", None)
            off = False
            for name in ("src", "dst"):
                if is_send[cols.n_op[i]] and isinstance(kwargs.get(name), int):
                    cls, d = self.mesh.split(kwargs[name])
                    off |= d != own_d
                    kwargs[name] = list(cls)
            text = json.dumps(kwargs, sort_keys=True)
            normal[k] = -1 if off else len(p.kwargs) + table.setdefault(text, len(table))
        codes = normal[inverse.reshape(-1)]
        return special, codes
