"""What becomes of an owned shard's gradient and of the shard, checked on the whole plan.

A part of the scan of ZeRO's owned shards (verdict/symmetry/owned.py, whose
``_Scan`` inherits it and sets what it reads), run once the gathers are
found: ZeRO-1's keeps of the reduced gradient's own chunk (rule 3),
ZeRO-2/3's reduce-scatters inside microbatches and their chains of shards
(rules 7 and 8; with expert parallelism in two levels), and the optimizer
step on an owned shard (rule 4). docs/soundness.md, "ZeRO-1: owned shards",
"ZeRO-2 and ZeRO-3: reduce-scattered shards" and "ZeRO-2 and ZeRO-3 with
expert parallelism: scatters in two levels".
"""

from __future__ import annotations

import numpy as np

from verdict.ops.step import OPTIMIZERS
from verdict.symmetry.rules import ACCUMULATE, ORBIT_SUMS
from verdict.symmetry.shards import inputs_of, last_writers, refuse


class ShardGradients:
    """Keeps, scatters, chains and optimizer steps; reads the scan's
    ``cols``, ``p``, ``dp``, ``ep``, ``n_d``, ``n_cls``, ``kinds``,
    ``reads``, ``shard_of``, ``split_of``, ``gathers``, ``inner`` and its
    plan readers (``box``, ``whole``, ``ins``, ``outs``, ``op``, ``kw``,
    ``loaded``), and fills ``keeps``, ``kept``, ``scatters``,
    ``scattered``, ``reduced``, ``reduced_ep``, ``rewire``, ``widen``,
    ``shifts`` and ``updated``."""

    def find_keeps(self) -> None:
        """Rule 3: for every rank and gathered parameter, the node writing its
        last gradient buffer keeps the rank's own chunk of a reducer's sum."""
        cols, dp = self.cols, self.dp
        buf_of = {int(b): int(q) for q, b in self.p.grads.items()}
        last = last_writers(cols, buf_of)
        sums: dict[tuple[int, int], int] = {}
        for key, (dim, _, shard, full, _) in self.shard_of.items():
            i = last.get(key, -1)
            where = f"rank {key[0]}'s last gradient buffer of {self.p.logical[key[1]].name}"
            if i < 0 or self.op(i) != "split" or int(cols.n_mb[i]) != -1:
                refuse(f"{where} is not a split of the reduced gradient")
            src = self.ins(i)
            made = int(cols.t_producer[src[0]]) if len(src) == 1 and src[0] >= 0 else -1
            if made < 0 or self.op(made) not in ORBIT_SUMS or int(cols.n_rank[made]) != key[0]:
                refuse(f"{where} is not a split of a sum over the replicas")
            kw = self.p.kwargs_of(int(cols.n_kw[i]))
            parts, d = self.split_of.get(key, (dp, int(self.n_d[i])))
            o = self.outs(i)[0]
            if (kw.get("dim"), kw.get("parts"), kw.get("index")) != (dim, parts, d) or \
                    self.box(o) != self.box(shard) or self.box(src[0]) != full or \
                    not self.whole(o) or not self.whole(src[0]) or \
                    int(cols.t_lver[o]) != int(cols.t_lver[src[0]]) or \
                    int(cols.t_tid[o]) != int(cols.t_tid[src[0]]):
                refuse(f"{where} does not keep chunk {d} of {parts} of the whole reduced "
                       f"gradient along dim {dim}, the shard the rank loads")
            self.keeps[i] = True
            self.kept[key] = (o, src[0])
            sums[key] = made
        # without its keep, a rank ends with the sum the keep splits: what the cut proves
        before = last_writers(cols, buf_of, self.keeps)
        for key, made in sums.items():
            if before.get(key) != made:
                refuse(f"rank {key[0]} writes a gradient buffer of "
                       f"{self.p.logical[key[1]].name} between the sum and the kept chunk")

    def find_scatters(self) -> None:
        """ZeRO-2/3: every reduce_scatter that crosses replicas runs inside a
        microbatch over the whole orbit at its own index; every replica's
        scatter of it reads the same row of block values (so position j holds
        replica j's own value), its own value is computed in its block at the
        whole box B of a gathered parameter, and its output, the rank's shard,
        is read only by one accumulation of that parameter's gradient buffer
        on the rank, as its contribution. Each such buffer is one chain of
        these accumulations from a buffer nothing else reads, whose end is
        the last gradient buffer the rank writes, the rank's shard, whole
        (docs/soundness.md, "ZeRO-2 and ZeRO-3: reduce-scattered shards")."""
        cols = self.cols
        nodes = self.crossing("reduce_scatter")
        inside = nodes[cols.n_mb[nodes] < 0]
        if inside.size:
            refuse(f"the reduce_scatter {int(inside[0])} on rank "
                   f"{int(cols.n_rank[inside[0]])} runs outside microbatches")
        m = self.groups(nodes) if nodes.size else np.zeros((0, self.dp), dtype=np.int64)
        own = m[np.arange(len(nodes)), self.n_d[nodes].astype(np.int64)]
        owner = np.full(len(cols.t_rank), -1, dtype=np.int64)
        owner[own] = np.arange(len(nodes))
        if len(np.unique(own)) != len(own):
            refuse("two reduce_scatters read one value at their own index")
        _, row_id = np.unique(m, axis=0, return_inverse=True)
        row_id = row_id.reshape(-1)
        k = owner[m]
        bad = (k < 0).any(axis=1) | (row_id[np.maximum(k, 0)] != row_id[:, None]).any(axis=1) | \
            (cols.t_mb[m] != cols.n_mb[nodes][:, None]).any(axis=1)
        if bad.any():
            i = int(nodes[np.argmax(bad)])
            refuse(f"the reduce_scatter {i} on rank {int(cols.n_rank[i])} reads, in some "
                   f"replica's position, another value than that replica's own scatter of "
                   f"the same row in its microbatch")
        param_of = {int(b): int(q) for q, b in self.p.grads.items()}
        outs = cols.flat[cols.ptr[cols.n_outs[nodes]]]
        inner_of, rows = self.inner_scatters(nodes, outs) if self.ep > 1 else ({}, None)
        outs = np.concatenate((outs, np.array([self.outs(i)[0] if len(self.outs(i)) == 1 else -1
                                               for i in inner_of.values()], dtype=outs.dtype)))
        readers = self.accumulations_reading(outs)
        chains: dict[tuple[int, int], list[int]] = {}
        buffer = np.zeros(len(nodes), dtype=np.int64)  # the gradient buffer each one feeds
        for at, (i, v) in enumerate(zip(nodes.tolist(), own.tolist())):
            rank, mb = int(cols.n_rank[i]), int(cols.n_mb[i])
            o = self.outs(i)[0] if len(self.outs(i)) == 1 else -1
            mid = o if o in inner_of else -1  # two levels: the replica's box, scattered again
            if mid >= 0:
                o = self.outs(inner_of[mid])[0] if len(self.outs(inner_of[mid])) == 1 else -1
            acc = readers.get(o, [])
            where = f"the reduce_scatter {i} on rank {rank}"
            if len(acc) != 1 or self.op(acc[0]) != ACCUMULATE or \
                    int(cols.n_rank[acc[0]]) != rank or int(cols.n_mb[acc[0]]) != mb or \
                    self.ins(acc[0])[1:] != [o]:
                refuse(f"{where}: its output is read by another node than one accumulation "
                       f"of its microbatch, as the contribution")
            buf = self.outs(acc[0])[0]
            key = (rank, param_of.get(int(cols.t_tid[buf]), -1))
            if key not in self.shard_of:
                refuse(f"{where} accumulates into the gradient buffer of no gathered parameter")
            dim, width, shard, full, _ = self.shard_of[key]
            kw = self.kw(int(cols.n_kw[i]))
            two = self.split_of.get(key) is not None
            if kw.get("dim") != dim or self.box(o) != self.box(shard) or \
                    int(cols.t_producer[v]) < 0 or int(cols.t_mb[v]) != mb or \
                    self.box(v) != full or two != (mid >= 0) or (two and (
                        self.box(mid) != self.replica_box(full, dim, width, int(self.n_d[i]))
                        or self.kw(int(cols.n_kw[inner_of[mid]])).get("dim") != dim)):
                refuse(f"{where} does not scatter its block's value at the whole box of "
                       f"{self.p.logical[key[1]].name} to the shard the rank loads")
            if two:
                self.reduced_ep.add((rank, int(cols.t_tid[self.outs(acc[0])[0]])))
            chains.setdefault(key, []).append(acc[0])
            self.scattered[o] = v
            buffer[at] = int(cols.t_tid[buf])
        self.one_buffer_per_row(nodes, k, buffer)
        if rows is not None:
            self.inner_rows(inner_of, rows, buffer, nodes)
        self.scatters[nodes] = True
        self.chains(chains, param_of)

    def accumulations_reading(self, outs: np.ndarray) -> dict[int, list[int]]:
        """Of the tensors ``outs`` each read by one node only, those an
        accumulation reads -> the accumulations reading it."""
        cols = self.cols
        is_acc = np.array([op == ACCUMULATE for op in cols.ops] or [False])[cols.n_op]
        read, reader = inputs_of(cols, np.flatnonzero(is_acc))
        readers: dict[int, list[int]] = {}
        watched = np.isin(read, outs[self.reads[np.maximum(outs, 0)] == 1])
        for t, i in zip(read[watched].tolist(), reader[watched].tolist()):
            readers.setdefault(t, []).append(i)
        return readers

    def one_buffer_per_row(self, nodes: np.ndarray, k: np.ndarray, buffer: np.ndarray) -> None:
        """One row, one buffer: the scatters ``nodes`` of one row (``k``: for
        each, the scatter whose own member each position holds) feed one
        gradient buffer (``buffer``, by scatter), so replica j's value at
        position j is what its own chain of that buffer accumulates
        (docs/soundness.md)."""
        bad = (buffer[k] != buffer[:, None]).any(axis=1)
        if bad.any():
            i = int(nodes[np.argmax(bad)])
            refuse(f"the reduce_scatter {i} on rank {int(self.cols.n_rank[i])} sums values that "
                   f"other replicas accumulate into another gradient buffer")

    @staticmethod
    def replica_box(full: list, dim: int, width: int, d: int) -> list[tuple[int, int]]:
        """Replica ``d``'s box of ``full`` gathered in two levels: chunk d
        along ``dim``, ``width`` wide."""
        lo = full[dim][0] + d * width
        return [(lo, lo + width) if k == dim else ab for k, ab in enumerate(full)]

    def inner_scatters(self, nodes: np.ndarray, outs: np.ndarray
                       ) -> tuple[dict[int, int], tuple[np.ndarray, np.ndarray] | None]:
        """Expert parallelism (rule 7''): the reduce_scatters that read the
        orbit's scatters' outputs, each inside the microbatch of its inputs,
        over the ep ranks of its own replica and class (position j: the output
        of the orbit's scatter on the ep rank j), at its own index e; every
        member the own member of one of them with the same group. Returns
        each orbit scatter's output -> the in-block scatter that reads it at
        its own index, and the in-block scatters with, for each member, the
        one whose own member it is (by position in the first); each such
        output is read by in-block scatters only (docs/soundness.md, "ZeRO-2
        and ZeRO-3 with expert parallelism")."""
        cols, ep = self.cols, self.ep
        made = np.zeros(len(cols.t_rank), dtype=bool)
        made[outs[outs >= 0]] = True
        rs = np.flatnonzero(np.array([o == "reduce_scatter" for o in cols.ops]
                                     or [False])[cols.n_op])
        rs = rs[~np.isin(rs, nodes)]
        read, reader = inputs_of(cols, rs)
        found = np.unique(reader[(read >= 0) & made[np.maximum(read, 0)]])
        if not found.size:
            return {}, None
        lengths = cols.ptr[cols.n_ins[found] + 1] - cols.ptr[cols.n_ins[found]]
        nouts = cols.ptr[cols.n_outs[found] + 1] - cols.ptr[cols.n_outs[found]]
        ranks = cols.n_rank[found].astype(np.int64)
        e = ranks // self.ep_stride % ep
        index = np.array([self.kw(int(k)).get("index", -1) for k in cols.n_kw[found].tolist()])
        mb = cols.n_mb[found].astype(np.int64)
        bad = (lengths != ep) | (nouts != 1) | (index != e) | (mb < 0)
        m = cols.flat[cols.ptr[cols.n_ins[found]][:, None] + np.arange(ep)[None, :]
                      * ~bad[:, None]].astype(np.int64)
        safe = np.maximum(m, 0)
        want = ranks[:, None] + (np.arange(ep)[None, :] - e[:, None]) * self.ep_stride
        bad |= (m < 0).any(axis=1) | ~made[safe].all(axis=1) | \
            (cols.t_rank[safe] != want).any(axis=1) | (cols.t_mb[safe] != mb[:, None]).any(axis=1)
        own = m[np.arange(len(found)), e]
        owner = np.full(len(cols.t_rank), -1, dtype=np.int64)
        owner[own] = np.arange(len(found))
        _, row_id = np.unique(m, axis=0, return_inverse=True)
        row_id = row_id.reshape(-1)
        k = owner[safe]
        bad |= (k < 0).any(axis=1) | (row_id[np.maximum(k, 0)] != row_id[:, None]).any(axis=1)
        if len(np.unique(own)) != len(own):
            refuse("two in-block reduce_scatters read one value at their own index")
        by_inner = np.zeros(len(cols.t_rank), dtype=np.int64)
        np.add.at(by_inner, m.reshape(-1), 1)
        bad |= (by_inner[safe] != self.reads[safe]).any(axis=1)
        if bad.any():
            i = int(found[np.argmax(bad)])
            refuse(f"the reduce_scatter {i} on rank {int(cols.n_rank[i])} is not one of the "
                   f"orbit's scatters' outputs over the ep ranks of its replica, in its "
                   f"microbatch, at its own index, whose every member is read by the "
                   f"in-block scatters of one row only")
        self.inner[found] = True
        return dict(zip(own.tolist(), found.tolist())), (found, k)

    def inner_rows(self, inner_of: dict[int, int], rows: tuple[np.ndarray, np.ndarray],
                   buffer: np.ndarray, nodes: np.ndarray) -> None:
        """One in-block row, one buffer: the in-block scatters of a row feed
        the same gradient buffer (the orbit scatter whose output is each one's
        own member feeds it, ``buffer`` by orbit scatter)."""
        found, k = rows
        of_orbit = {int(self.outs(i)[0]): b for i, b in zip(nodes.tolist(), buffer.tolist())}
        buf = np.array([of_orbit.get(o, -1) for o in inner_of], dtype=np.int64)
        at = np.empty(len(found), dtype=np.int64)
        at[np.searchsorted(found, np.array(list(inner_of.values()), dtype=np.int64))] = buf
        bad = (at < 0) | (at[k] != at[:, None]).any(axis=1)
        if bad.any():
            i = int(found[np.argmax(bad)])
            refuse(f"the reduce_scatter {i} on rank {int(self.cols.n_rank[i])} sums values "
                   f"that other ep ranks accumulate into another gradient buffer")

    def chains(self, chains: dict[tuple[int, int], list[int]], param_of: dict[int, int]) -> None:
        """Each gathered parameter's gradient buffer on a rank: a chain of the
        scatters' accumulations only, from a buffer read by the first one
        only, each output read by the next only, the end the last gradient
        buffer the rank writes, claiming the rank's shard, whole."""
        cols = self.cols
        last = last_writers(cols, param_of)
        is_acc = np.array([op == ACCUMULATE for op in cols.ops] or [False])[cols.n_op]
        writes: dict[tuple[int, int], int] = {}
        for a in np.flatnonzero(is_acc).tolist():
            outs = self.outs(a)
            if outs and outs[0] >= 0:
                key = (int(cols.n_rank[a]), param_of.get(int(cols.t_tid[outs[0]]), -1))
                writes[key] = writes.get(key, 0) + 1
        for key, (_, _, shard, full, _) in self.shard_of.items():
            accs = chains.get(key, [])
            where = f"rank {key[0]}'s gradient buffer of {self.p.logical[key[1]].name}"
            end = last.get(key, -1)
            if not accs or writes.get(key) != len(accs) or end not in accs:
                refuse(f"{where} is not one chain of its reduce-scattered shards")
            ends = self.outs(end)[0]
            if self.box(ends) != self.box(shard) or not self.whole(ends):
                refuse(f"{where} does not end with the rank's shard, whole")
            outs = {self.outs(a)[0] for a in accs}
            prevs = {self.ins(a)[0] for a in accs}
            for prev in prevs:
                made = int(cols.t_producer[prev]) if prev >= 0 else -1
                if int(self.reads[prev]) != 1 or \
                        (prev not in outs and (made < 0 or self.op(made) != "zeros")):
                    refuse(f"{where}: a running buffer is read by another node, or starts "
                           f"from another value than zeros")
            if outs - prevs != {ends}:
                refuse(f"{where} is not one chain ending in the buffer the rank ends with")
            self.kept[key] = (ends, ends)
            self.reduced[(key[0], int(cols.t_tid[ends]))] = full

    def find_steps(self) -> None:
        """Rule 4: the only other reader of a rank's shard is an optimizer
        step on it, reading the kept chunk and loaded state shards of the
        same box, writing updated shards of that box; nothing else reads
        the kept chunk."""
        cols = self.cols
        watched = [shard for _, _, shard, _, _ in self.shard_of.values()] + \
            [o for o, _ in self.kept.values()]
        read, reader = inputs_of(cols)
        pick = np.flatnonzero(np.isin(read, watched) & ~self.gathers[reader] & ~self.inner[reader])
        readers: dict[int, list[int]] = {}
        for t, i in zip(read[pick].tolist(), reader[pick].tolist()):
            readers.setdefault(t, []).append(i)
        for key, (dim, width, shard, full, gathered) in self.shard_of.items():
            o, reduced = self.kept[key]
            steps = readers.get(shard, [])
            where = f"rank {key[0]}'s shard of {self.p.logical[key[1]].name}"
            if not steps:
                if readers.get(o):
                    refuse(f"{where}: its kept gradient chunk is read by another node than an "
                           f"optimizer step on the shard")
                continue
            if key in self.split_of:
                refuse(f"{where}: an optimizer step on a shard gathered in two levels (its "
                       f"updated shards are gathered so too, which the rules do not describe)")
            i = steps[0]
            ins, outs = self.ins(i), self.outs(i)
            if len(steps) != 1 or readers.get(o) != [i] or self.op(i) not in OPTIMIZERS or \
                    len(ins) < 2 or ins[:2] != [shard, o]:
                refuse(f"{where} is read by another node than its gathers and one optimizer "
                       f"step on it and its kept gradient chunk")
            states = ins[2:]
            own = self.box(shard)
            if any(not self.loaded(t) or self.kinds[int(cols.t_tid[t])] == "param"
                   or int(self.reads[t]) != 1 or self.box(t) != own or not self.whole(t)
                   for t in states) or \
                    not outs or outs[0] < 0 or int(cols.t_tid[outs[0]]) != key[1] or any(
                        t < 0 or self.box(t) != own or not self.whole(t) for t in outs) or \
                    any(int(self.reads[t]) for t in outs[1:]):
                refuse(f"{where}: its optimizer step does not read loaded state shards and "
                       f"write updated shards of the same box")
            d = int(self.n_d[i])
            self.rewire[i] = {0: gathered, 1: reduced}
            for t in (*states, *outs):
                self.widen[t] = full
            self.shifts.append((states, [dim] * len(states), [d * width] * len(states)))
            self.updated[(int(self.n_cls[i]), d, key[1])] = outs[0]
