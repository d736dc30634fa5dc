"""Materialized plans of many data-parallel replicas, by array arithmetic.

The plan of D replicas is not built one Python object per node. The
generator emits the plans of 2 and S replicas (S = 3, or with ZeRO a
divisor of D: :func:`second_size`; same microbatches, the same rows per
replica), whose size does not depend on D, and expands them to D replicas
with numpy (docs/plan-format.md, "Replicated generation"). With expert
parallelism a replica is one expert-parallel group: the data-parallel
index is d' = d ep + e, and D counts the groups (:func:`replicas`).

* Replica d of the plan of D replicas runs the same per-rank program as
  replica d of the small plans: node for node, the same ops, directions,
  names and microbatches, reading and writing tensors of the same logical
  ids and versions.
* Every integer that differs between replicas (a rank, a batch slice, a
  partial-sum part, a reducer's group index, a send's source rank, a ZeRO
  keep's or reduce-scatter's index) is affine in (D, d): ``v = a + b D +
  c d``, or, with ZeRO, an owned shard's bound ``v = (e + f d) / D`` (d
  times the width of a dim cut in D). The coefficients come from replicas
  0 and 1 of dp 2 (and replica 0 of dp S for the linear form); the other
  replicas of dp S check them, and a value that fits neither form, or both
  with different values at D, refuses the array path
  (:class:`NotReplicable`), as does an owned shard whose e and f do not
  divide by D. The dependence on D of the linear form is fitted from the
  two sizes: it is linear by the parallelizer's formulas (rank ``(stage D +
  d) block + rest``, batch offset ``(m D + d) R w``, parts ``d S + r`` of
  ``D S``, a reducer's index ``d cp + c``), and tests/test_replicate.py
  compares the result with the row generator's. A ``zeros`` node's shape
  that differs between replicas (ZeRO's owned gradient buffer) is its
  output's extents, checked on the small plans. A tensor's scale (a
  rational) must be the same on every replica and size.
* A node reads tensors of its own replica, or (a cross-replica reducer) one
  block of tensors per replica, in replica order: the D members of such a
  group share one range of the input pool.

The nodes are in the small plan's order with each node of replica 0
standing for replicas 0 to D - 2 and each node of replica 1 for replica D - 1;
tensors likewise. That order is a valid execution order (a reader's copies
sit where its template sat, after the templates of everything it reads); it
differs from the row generator's interleaving of ranks (a renumbering: the
same tensors, and on every rank the same node sequence).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from gen_model.config import ConfigError, Parallelism
from gen_model.parallelize import Policy
from gen_model.spill import keep
from verdict.columns import Columns, NodeColumns, TensorColumns, canonical_kwargs, narrow, row_ids
from verdict.plan import Logical

Array = np.ndarray


class NotReplicable(ValueError):
    """The plan is not the same program on every replica up to affine integers."""


def replicas(par: Parallelism) -> int:
    """The replicas D the expansion counts: data-parallel ranks, or with
    expert parallelism the expert-data-parallel ones (a replica is then one
    expert-parallel group: data-parallel index d = edp x ep + e)."""
    return par.dp // par.ep_dp


def second_size(par: Parallelism, policy: Policy) -> int | None:
    """The replicas S of the second small plan (the first has 2), or None
    when no size fits. 3 in general. With ZeRO, the smallest divisor of an
    even D from 3 up to D - 1: the small plans cut each parameter on the dim
    the plan of D replicas cuts (``Policy.zero_dims_at``), and a dim that
    cuts into D owned shards cuts into 2 and S too. (A dim cut other than
    D's would not cut into D: the fit refuses it, :func:`_fit`.)"""
    dp = replicas(par)
    if not policy.zero:
        return 3
    if dp % 2:
        return None
    return next((s for s in range(3, dp) if dp % s == 0), None)


def small_policy(par: Parallelism, policy: Policy) -> Policy:
    """The policy of the small plans: with ZeRO, each parameter cut on the
    dim the plan of ``par.dp`` ranks cuts (the first one its D owners
    divide, which the small plans' fewer owners need not pass over)."""
    return replace(policy, zero_dims_at=par.dp) if policy.zero else policy


def replicable(par: Parallelism, policy: Policy, variant: str) -> bool:
    """Whether the array path expresses this plan: replicas beyond 3, a
    second small size (:func:`second_size`), the small plans laying experts
    out as the plan does (:attr:`Parallelism.experts_over_tp`), and no bug
    variant (edited per node)."""
    size = second_size(par, policy)
    return (replicas(par) > 3 and variant == "default" and size is not None
            and all(replace(par, dp=s * par.ep_dp).experts_over_tp == par.experts_over_tp
                    for s in (2, size)))


@dataclass(frozen=True)
class _Small:
    """One small plan (2 or S replicas) in columns, with each rank's
    replica, the rank's place in its replica, and each node's position on
    its rank."""

    cols: Columns
    dp: int  # replicas (expert-parallel groups with experts)
    block: int  # ranks per replica and stage: ep_dp * cp * tp

    def replica(self, ranks: Array) -> Array:
        return (ranks // self.block) % self.dp

    def place(self, ranks: Array) -> Array:
        """The rank's (stage, index within the replica) as one number."""
        return (ranks // (self.block * self.dp)) * self.block + ranks % self.block


def _keys(small: _Small) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
    """The replica of every tensor and node and its key without the replica:
    tensors (place, mb, tid, version), nodes (place, position on the rank)."""
    t = small.cols.tensors
    t_ranks = t.rank.astype(np.int64)
    tkeys = np.stack([small.place(t_ranks), t.mb.astype(np.int64), t.tid.astype(np.int64),
                      t.version.astype(np.int64)], axis=1)
    n = small.cols.nodes
    ranks = n.rank.astype(np.int64)
    order = np.argsort(ranks, kind="stable")
    pos = np.empty(len(ranks), dtype=np.int64)
    sorted_ranks = ranks[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_ranks)) + 1]
    run = np.repeat(starts, np.diff(np.r_[starts, len(ranks)]))
    pos[order] = np.arange(len(ranks)) - run
    nkeys = np.stack([small.place(ranks), pos], axis=1)
    return (small.replica(t_ranks), tkeys), (small.replica(ranks), nkeys)


def _twins(keys2: tuple[Array, Array], keys_s: tuple[Array, Array], size: int,
           what: str) -> Array:
    """For each replica-0 entry of dp 2 (rows, in index order): its index in
    dp 2 replica 1 and dp S replicas 0 to S - 1. Columns: j0, j1, k0 .. k(S-1)."""
    (rep2, k2), (rep_s, k_s) = keys2, keys_s
    ids = row_ids(np.concatenate((k2, k_s)))
    id2, id_s = ids[:len(k2)], ids[len(k2):]
    points = [(rep2, id2, 0), (rep2, id2, 1)] + [(rep_s, id_s, k) for k in range(size)]
    where = np.full((len(points), int(ids.max(initial=-1)) + 1), -1, dtype=np.int64)
    for col, (rep, own, replica) in enumerate(points):
        pick = np.flatnonzero(rep == replica)
        where[col, own[pick]] = pick
    n0 = int((rep2 == 0).sum())
    if 2 * n0 != len(k2) or size * n0 != len(k_s):
        raise NotReplicable(f"the replicas do not hold the same {what}s")
    out = where[:, id2[rep2 == 0]].T
    if (out < 0).any():
        raise NotReplicable(f"a {what} of replica 0 has no counterpart in another replica")
    return out[np.argsort(out[:, 0])]


#: A fitted value at D replicas: (base, step), the value on replica d is base + step d.
Fit = tuple[Array, Array]


def _fit(points: list[Array], dp: int, what: str, shards: bool = False) -> Fit:
    """A value of every template at D replicas from its points: replicas 0
    and 1 of dp 2, then replicas 0 to S - 1 of dp S.

    Linear: ``v = a + b D + c d``, fitted from dp 2 and replica 0 of dp S,
    checked on replicas 1 to S - 1 of dp S. With ``shards`` (ZeRO) a value
    that is not linear may be an owned shard's bound, ``v = (e + f d) / D``
    (offset d times the width of a dim of length f cut in D), fitted from
    dp 2 and checked on every replica of dp S; its e and f must divide by D.
    A value both forms fit (possible only for one constant in d) must have
    the same value at D in both, else the fit refuses."""
    v0, v1, big = points[0], points[1], points[2:]
    size = len(big)
    c = v1 - v0
    b, rem = np.divmod(big[0] - v0, size - 2)
    a = v0 - 2 * b
    linear = rem == 0
    for k in range(1, size):
        linear &= a + b * size + c * k == big[k]
    base, step = a + b * dp, c
    if shards:
        e, f = 2 * v0, 2 * c
        sharded = np.ones_like(linear)
        for k in range(size):
            sharded &= size * big[k] == e + f * k
        whole = (e % dp == 0) & (f % dp == 0)
        shard_base, shard_step = e // dp, f // dp
        if (linear & sharded & (~whole | (shard_base != base) | (shard_step != step))).any():
            raise NotReplicable(f"{what} fits both a linear and an owned-shard family")
        shard = sharded & ~linear
        if (shard & ~whole).any():
            raise NotReplicable(f"{what}: an owned shard does not cut into {dp}")
        base = np.where(shard, shard_base, base)
        step = np.where(shard, shard_step, step)
        linear |= sharded
    if not linear.all():
        raise NotReplicable(f"{what} is not affine in the replicas")
    return base, step


#: Output entries computed at a time (bounds the int64 temporaries).
_CHUNK = 1 << 22


def _affine_type(fit: Fit, dp: int) -> np.dtype:
    """The narrowest type that holds every template's value on every
    replica d of D."""
    base, c = fit
    reach = base + c * (dp - 1)
    return narrow(np.array([base.min(initial=0), base.max(initial=0), reach.min(initial=0),
                            reach.max(initial=0)])).dtype


def _affine(fit: Fit, rows: Array, d: Array, dp: int, kind: np.dtype | None = None) -> Array:
    """The fitted value of template ``rows`` on replicas ``d``, in ``kind``
    (by default :func:`_affine_type`), computed a chunk of entries at a time."""
    base, c = fit
    out = np.empty(rows.shape + base.shape[1:], dtype=kind or _affine_type(fit, dp))
    wide = c.any()
    for lo in range(0, len(rows), _CHUNK):
        r = rows[lo: lo + _CHUNK]
        piece = base[r]
        if wide:
            dd = d[lo: lo + _CHUNK]
            piece += c[r] * (dd if piece.ndim == 1 else dd[:, None])
        out[lo: lo + _CHUNK] = piece
    return out


def _runs(counts: Array) -> tuple[Array, Array]:
    """For runs of the given lengths: each element's run and place in it
    (int32 when the runs' total fits it: these index arrays are the size of
    the output)."""
    starts = np.cumsum(counts, dtype=np.int64)
    total = int(starts[-1]) if len(starts) else 0
    starts -= counts
    kind = np.int32 if max(total, len(counts)) < _I32_MAX else np.int64
    owner = np.repeat(np.arange(len(counts), dtype=kind), counts)
    within = np.arange(total, dtype=kind)
    within -= starts.astype(kind)[owner]
    return owner, within


_I32_MAX = np.iinfo(np.int32).max


class _Expander:
    """The expansion; ``spill`` is applied to every finished column (it may
    move it to disk: gen_model/spill.py)."""

    def __init__(self, two: _Small, big: _Small, dp: int,
                 spill: Callable[[Array], Array] = keep, shards: bool = False):
        self.two, self.big, self.dp, self.spill = two, big, dp, spill
        self.shards = shards
        self.slice_fit: Fit | None = None
        self.slice_start: Array | None = None
        tkeys2, nkeys2 = _keys(two)
        tkeys_s, nkeys_s = _keys(big)
        self.tw = _twins(tkeys2, tkeys_s, big.dp, "tensor")
        self.nw = _twins(nkeys2, nkeys_s, big.dp, "node")
        self.points = [(two, 0), (two, 1)] + [(big, 2 + k) for k in range(big.dp)]
        self.slice_off = {s.dp: s.cols.tensors.slice_offsets(s.cols.logical) for s in (two, big)}
        t2 = two.cols.tensors
        self.trep = two.replica(t2.rank.astype(np.int64))
        # template (replica-0 tensor of dp 2) of every dp-2 tensor, and its row in self.tw
        self.t_row = np.full(len(t2), -1, dtype=np.int64)
        self.t_row[self.tw[:, 0]] = np.arange(len(self.tw))
        self.t_row[self.tw[:, 1]] = np.arange(len(self.tw))
        self.t_count = np.where(self.trep == 0, dp - 1, 1)
        self.t_base = np.cumsum(self.t_count) - self.t_count

    def tensor_index(self, rows: Array, d: Array) -> Array:
        """The real index of template row ``rows`` on replica ``d``."""
        j0, j1 = self.tw[rows, 0], self.tw[rows, 1]
        return np.where(d < self.dp - 1, self.t_base[j0] + d, self.t_base[j1])

    def order(self, rep: Array, template_rows: Array) -> tuple[Array, Array]:
        """Copies in output order: each dp-2 entry of replica 0 stands for
        replicas 0..D-2, of replica 1 for D-1. Returns (template row, d)."""
        counts = np.where(rep == 0, self.dp - 1, 1)
        owner, d = _runs(counts)
        d[rep[owner] != 0] = self.dp - 1
        return template_rows.astype(owner.dtype)[owner], d

    def fit(self, values: Callable[[_Small], Array], index: Array, what: str,
            shards: bool = False) -> Fit:
        """The fit of ``values`` (an int64 column of a small plan) at the
        entries ``index`` (rows of self.tw or self.nw: a column per point)."""
        return _fit([values(small)[index[:, col]] for small, col in self.points], self.dp, what,
                    shards)

    # ------------------------------------------------------------ tensors
    def tensors(self, logical: tuple[Logical, ...]) -> TensorColumns:
        tw, dp = self.tw, self.dp
        rows, d = self.order(self.trep, self.t_row)
        out = {}
        for name in ("rank", "mb", "tid", "version", "lver", "parts"):
            fit = self.fit(lambda s, n=name: getattr(s.cols.tensors, n).astype(np.int64), tw,
                           f"tensor {name}")
            out[name] = self.spill(_affine(fit, rows, d, dp))
        scale = self.scales(rows)
        out["scale"] = None if scale is None else self.spill(scale)
        out["slices"] = self.spill(self.slices(rows, d))
        return TensorColumns(**out)

    def scales(self, rows: Array) -> Array | None:
        """The tensors' scales (None: none scaled), which must be the same
        on every replica and size."""
        tw = self.tw

        def of(t: TensorColumns, col: int) -> Array:
            if t.scale is None:
                return np.ones((len(tw), 2), dtype=np.int64)
            return t.scale[tw[:, col]].astype(np.int64)

        scale = of(self.two.cols.tensors, 0)
        if not all(np.array_equal(scale, of(s.cols.tensors, k)) for s, k in self.points[1:]):
            raise NotReplicable("a tensor's scale differs between replicas or sizes")
        return None if (scale == 1).all() else narrow(scale[rows])

    def slices(self, rows: Array, d: Array) -> Array:
        """The tensors' slices; a ZeRO owned shard's bounds are ``(e + f d) / D``."""
        ndim = np.diff(self.offsets(self.two))[self.tw[:, 0]]
        owner, within = _runs(ndim)
        points = [s.cols.tensors.slices.astype(np.int64)[self.offsets(s)[self.tw[owner, col]]
                                                          + within]
                  for s, col in self.points]
        fit = _fit(points, self.dp, "tensor slices", self.shards)
        row_start = np.cumsum(ndim) - ndim
        if self.shards:  # for the zeros nodes' shapes (:meth:`extents`), until nodes() ends
            self.slice_fit, self.slice_start = fit, row_start
        counts = narrow(ndim)[rows]
        kind = _affine_type(fit, self.dp)
        out = np.empty((int(counts.sum(dtype=np.int64)), 2), dtype=kind)
        at = 0
        for lo in range(0, len(rows), _CHUNK):
            r, dd = rows[lo: lo + _CHUNK], d[lo: lo + _CHUNK]
            owner, within = _runs(counts[lo: lo + _CHUNK])
            piece = _affine(fit, row_start[r[owner]] + within, dd[owner], self.dp, kind)
            out[at: at + len(piece)] = piece
            at += len(piece)
        return out

    def offsets(self, small: _Small) -> Array:
        """The slice offsets of a small plan's tensors."""
        return self.slice_off[small.dp]

    def extents(self, row: int) -> Fit:
        """The extents of template tensor ``row`` (its shape) at D replicas,
        per dim, from the slices' fit (:meth:`slices` runs first)."""
        (base, step), at = self.slice_fit, int(self.slice_start[row])
        count = int(np.diff(self.offsets(self.two))[self.tw[row, 0]])
        span = slice(at, at + count)
        return base[span, 1] - base[span, 0], step[span, 1] - step[span, 0]

    # ------------------------------------------------------------ nodes
    def nodes(self) -> tuple[NodeColumns, tuple[str, ...]]:
        n2 = self.two.cols.nodes
        nw, dp = self.nw, self.dp
        nrep = self.two.replica(n2.rank.astype(np.int64))
        n_row = np.full(len(n2.rank), -1, dtype=np.int64)
        n_row[nw[:, 0]] = np.arange(len(nw))
        n_row[nw[:, 1]] = np.arange(len(nw))
        rows, d = self.order(nrep, n_row)
        self.same_program()
        fit = self.fit(lambda s: s.cols.nodes.rank.astype(np.int64), nw, "node rank")
        cols = {"rank": self.spill(_affine(fit, rows, d, dp))}
        for name in ("mb", "op", "dir", "name"):
            cols[name] = self.spill(getattr(n2, name)[nw[:, 0]][rows])
        kw_codes, table = self.kwargs(rows, d)
        self.slice_fit = self.slice_start = None
        cols["kwargs"] = self.spill(kw_codes)
        del kw_codes
        cols.update(self.inputs(rows, d))
        cols.update(self.outputs(rows, d))
        self.check_big("in")
        self.check_big("out")
        return NodeColumns(**cols), table

    def same_program(self) -> None:
        """Replicas run the same ops, directions, names and microbatches."""
        n2 = self.two.cols
        nw = self.nw
        for name in ("mb", "op", "dir", "name"):
            ref = getattr(n2.nodes, name)[nw[:, 0]]
            for small, col in self.points[1:]:
                which = small.cols
                vals = getattr(which.nodes, name)[nw[:, col]]
                if name in ("op", "name"):
                    table = which.ops if name == "op" else which.names
                    ref_table = n2.ops if name == "op" else n2.names
                    same = [ref_table[x] == table[y] for x, y in zip(ref.tolist(), vals.tolist())]
                    ok = all(same)
                else:
                    ok = np.array_equal(ref, vals)
                if not ok:
                    raise NotReplicable(f"replicas differ in node {name}")

    def kwargs(self, rows: Array, d: Array) -> tuple[Array, tuple[str, ...]]:
        """Kwargs codes of the copies and the table: equal kwargs keep their
        text; kwargs whose ints differ between replicas are fitted per key
        (:func:`_fit`), and a ``zeros`` node's shape that differs is its
        output's extents (a ZeRO owned shard's width is constant in d and
        differs between sizes: fitting it could not tell D - a from e / D)."""
        nw = self.nw
        texts = [[s.cols.kwargs[int(k)] for k in s.cols.nodes.kwargs[nw[:, col]].tolist()]
                 for s, col in self.points]
        table: dict[str, int] = {}
        fixed = np.full(len(nw), -1, dtype=np.int64)
        # kwargs that vary by replica, in classes of equal (text, fitted fields)
        kind = np.full(len(nw), -1, dtype=np.int64)
        classes: dict[tuple, int] = {}
        varying: list[tuple[dict, list[tuple[str, Fit]]]] = []
        for i, group in enumerate(zip(*texts)):
            if all(g == group[0] for g in group):
                fixed[i] = table.setdefault(group[0], len(table))
                continue
            dicts = [json.loads(g) for g in group]
            if any(set(x) != set(dicts[0]) for x in dicts):
                raise NotReplicable("replicas differ in a node's kwargs keys")
            fields = [(k, self.kwarg_fit(i, k, [x[k] for x in dicts])) for k in dicts[0]
                      if any(x[k] != dicts[0][k] for x in dicts)]
            key = (group[0], tuple((k, b.tobytes(), c.tobytes()) for k, (b, c) in fields))
            if key not in classes:
                classes[key] = len(varying)
                varying.append((dicts[0], fields))
            kind[i] = classes[key]
        codes = fixed.astype(np.int32)[rows]
        pick = np.flatnonzero(codes < 0)
        if len(pick):
            distinct, inverse = np.unique(kind[rows[pick]] * self.dp + d[pick],
                                          return_inverse=True)
            made = np.empty(len(distinct), dtype=np.int64)
            for k, (cls, dv) in enumerate(zip(*np.divmod(distinct, self.dp))):
                base, fields = varying[int(cls)]
                kw = dict(base)
                for name, (b, c) in fields:
                    value = (b + c * int(dv)).tolist()
                    kw[name] = value if isinstance(base[name], list) else value[0]
                made[k] = table.setdefault(canonical_kwargs(kw), len(table))
            codes[pick] = made[inverse.reshape(-1)]
        return narrow(codes), tuple(table)

    def kwarg_fit(self, node: int, key: str, values: list) -> Fit:
        """The fit of kwarg ``key`` of template ``node`` from its values at
        the points: an int, or a zeros node's shape."""
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return _fit([np.array([v], dtype=np.int64) for v in values], self.dp,
                        "node kwargs", self.shards)
        n2 = self.two.cols.nodes
        if not self.shards or key != "shape" or (
                self.two.cols.ops[int(n2.op[self.nw[node, 0]])] != "zeros"):
            raise NotReplicable("replicas differ in a node's kwargs beyond integers")
        for (small, col), value in zip(self.points, values):
            n = small.cols.nodes
            idx = self.nw[node, col]
            out = int(n.outputs[int(n.out_off[idx])])
            off = self.offsets(small)
            view = small.cols.tensors.slices[off[out]: off[out + 1]].astype(np.int64)
            if value != (view[:, 1] - view[:, 0]).tolist():
                raise NotReplicable("a zeros node's shape is not its output's extents")
        out = int(n2.outputs[int(n2.out_off[self.nw[node, 0]])])
        return self.extents(int(self.t_row[out]))

    def entries(self, cols: Columns, which_col: int, kind: str) -> tuple[Array, Array]:
        """Per template node (rows of self.nw) the (start, count) of its inputs
        or outputs in the small plan of column ``which_col`` of nw."""
        n = cols.nodes
        idx = self.nw[:, which_col]
        if kind == "in":
            return n.in_start.astype(np.int64)[idx], n.in_count.astype(np.int64)[idx]
        off = n.out_off.astype(np.int64)
        return off[idx], off[idx + 1] - off[idx]

    def inputs(self, rows: Array, d: Array) -> dict[str, Array]:
        c2 = self.two.cols
        s0, n0 = self.entries(c2, 0, "in")
        s1, n1 = self.entries(c2, 1, "in")
        _, m0 = self.entries(self.big.cols, 2, "in")
        group = m0 != n0
        if not np.array_equal(n0, n1) or not (np.array_equal(m0[group], n0[group] // 2 * self.big.dp)
                                              and (n0[group] % 2 == 0).all()):
            raise NotReplicable("replicas differ in the number of a node's inputs")
        pool2 = c2.nodes.inputs.astype(np.int64)
        # own-replica entries: template of each entry, checked against replica 1
        owner, within = _runs(n0)
        e0 = pool2[s0[owner] + within]
        e1 = pool2[s1[owner] + within]
        plain_entry = ~group[owner]
        self.check_entries(e0[plain_entry], e1[plain_entry], same_replica=True)
        # group entries: block k of the dp-2 list is replica k's
        g_owner, g_within = owner[~plain_entry], within[~plain_entry]
        half = n0[g_owner] // 2
        first = g_within < half
        ge0 = e0[~plain_entry]
        self.check_group(ge0, first, g_owner, g_within, half, s0)
        # the pool: own-replica lists copied per node copy, then one range per group
        counts = narrow(np.where(group, 0, n0))[rows]
        blocks = [self.entry_rows(pool2[s0[t]: s0[t] + n0[t] // 2])
                  for t in np.flatnonzero(group).tolist()]
        extra = sum(len(b) for b in blocks) * self.dp
        plain, at = self.copies(pool2, s0, counts, rows, d, extra)
        g_start = np.zeros(len(self.nw), dtype=np.int64)
        for t, block in zip(np.flatnonzero(group).tolist(), blocks):
            dd = np.repeat(np.arange(self.dp), len(block))
            piece = self.index_or_absent(np.tile(block, self.dp), dd)
            plain[at: at + len(piece)] = piece
            g_start[t] = at
            at += len(piece)
        out = {"inputs": self.spill(narrow(plain))}
        del plain
        out["in_count"] = self.spill(narrow(np.where(group, n0 // 2 * self.dp, n0))[rows])
        in_start = np.cumsum(counts, dtype=np.int64)
        in_start -= counts
        del counts
        in_group = np.flatnonzero(group[rows])
        in_start[in_group] = g_start[rows[in_group]]
        del in_group
        out["in_start"] = self.spill(narrow(in_start))
        return out

    def copies(self, pool2: Array, s0: Array, counts: Array, rows: Array, d: Array,
               extra: int = 0) -> tuple[Array, int]:
        """The entries of the node copies (``counts`` of template ``rows``
        on replicas ``d``, from the dp-2 pool at ``s0``), a chunk of nodes
        at a time, in an array of tensor indices with ``extra`` more
        entries left for the caller; and the number of entries written."""
        total = int(counts.sum(dtype=np.int64))
        index = np.int32 if self.t_total() < _I32_MAX else np.int64
        out = np.empty(total + extra, dtype=index)
        at = 0
        for lo in range(0, len(rows), _CHUNK):
            owner, within = _runs(counts[lo: lo + _CHUNK])
            r, dd = rows[lo: lo + _CHUNK][owner], d[lo: lo + _CHUNK][owner]
            piece = self.index_or_absent(self.entry_rows(pool2[s0[r] + within]), dd)
            out[at: at + len(piece)] = piece
            at += len(piece)
        return out, at

    def t_total(self) -> int:
        """The number of tensors of the expanded plan."""
        return int(self.t_count.sum())

    def entry_rows(self, entries: Array) -> Array:
        """Template rows of dp-2 tensor indices (-1 stays -1)."""
        return np.where(entries >= 0, self.t_row[np.maximum(entries, 0)], -1)

    def index_or_absent(self, rows: Array, d: Array) -> Array:
        return np.where(rows >= 0, self.tensor_index(np.maximum(rows, 0), d), -1)

    def check_entries(self, e0: Array, e1: Array, same_replica: bool) -> None:
        """Replica 0's entries are its own tensors and replica 1's are their twins."""
        absent = e0 < 0
        if not np.array_equal(absent, e1 < 0):
            raise NotReplicable("replicas differ in a node's absent slots")
        e0, e1 = e0[~absent], e1[~absent]
        if (self.trep[e0] != 0).any() or (self.trep[e1] != 1).any() or not np.array_equal(
                self.tw[self.t_row[e0], 1], e1):
            raise NotReplicable("a node reads another replica's tensors outside a group")

    def check_group(self, ge0: Array, first: Array, g_owner: Array, g_within: Array,
                    half: Array, s0: Array) -> None:
        """A group list of dp 2 is [replica 0's block, replica 1's block], the
        second block the twins of the first (dp S's S blocks: :meth:`check_big`)."""
        if (ge0 < 0).any():
            raise NotReplicable("a group list has absent slots")
        if (self.trep[ge0[first]] != 0).any() or (self.trep[ge0[~first]] != 1).any():
            raise NotReplicable("a group list is not in replica order")
        pool2 = self.two.cols.nodes.inputs.astype(np.int64)
        second = pool2[s0[g_owner[first]] + g_within[first] + half[first]]
        if not np.array_equal(self.tw[self.t_row[ge0[first]], 1], second):
            raise NotReplicable("a group list's replica blocks differ")

    def check_big(self, kind: str) -> None:
        """dp S's replicas read and write what the fit predicts: replica k's
        own tensors (the templates' rows), or, in a group list, S blocks."""
        c2, c3, size = self.two.cols, self.big.cols, self.big.dp
        t3 = c3.tensors
        t3_row = np.full(len(t3), -1, dtype=np.int64)
        for k in range(size):
            t3_row[self.tw[:, 2 + k]] = np.arange(len(self.tw))
        t3_rep = self.big.replica(t3.rank.astype(np.int64))
        pool = "inputs" if kind == "in" else "outputs"
        pool2 = getattr(c2.nodes, pool).astype(np.int64)
        pool3 = getattr(c3.nodes, pool).astype(np.int64)
        s0, n0 = self.entries(c2, 0, kind)
        half = np.maximum(n0 // 2, 1)
        for k in range(size):
            s3, n3 = self.entries(c3, 2 + k, kind)
            group = n3 != n0
            if not np.array_equal(n3[group], n0[group] // 2 * size):
                raise NotReplicable("replicas differ in the number of a node's entries")
            owner, within = _runs(n3)
            e3 = pool3[s3[owner] + within]
            got = np.stack([np.where(e3 >= 0, t3_row[e3], -1), np.where(e3 >= 0, t3_rep[e3], -1)])
            g = group[owner]
            src = pool2[s0[owner] + np.where(g, within % half[owner], within)]
            rows = self.entry_rows(src)
            want = np.stack([rows, np.where(rows < 0, -1, np.where(g, within // half[owner], k))])
            if not np.array_equal(got, want):
                raise NotReplicable(f"dp {size}'s node {pool} are not those of dp 2's replicas")

    def outputs(self, rows: Array, d: Array) -> dict[str, Array]:
        s0, n0 = self.entries(self.two.cols, 0, "out")
        s1, n1 = self.entries(self.two.cols, 1, "out")
        if not np.array_equal(n0, n1):
            raise NotReplicable("replicas differ in the number of a node's outputs")
        pool2 = self.two.cols.nodes.outputs.astype(np.int64)
        owner, within = _runs(n0)
        self.check_entries(pool2[s0[owner] + within], pool2[s1[owner] + within], True)
        counts = narrow(n0)[rows]
        outs = self.spill(narrow(self.copies(pool2, s0, counts, rows, d)[0]))
        off = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=off[1:])
        return {"out_off": self.spill(narrow(off)), "outputs": outs}


def real_logical(two: Columns, big: Columns, size: int, dp: int) -> tuple[Logical, ...]:
    """The logical tensors at dp replicas: batch dims grow linearly with the
    replicas (fitted from dp 2 and dp ``size``), everything else is the same."""
    out = []
    for a, b in zip(two.logical, big.logical, strict=True):
        if (a.name, a.kind, len(a.shape)) != (b.name, b.kind, len(b.shape)):
            raise NotReplicable(f"logical tensor {a.name} differs between dp 2 and dp {size}")
        grow = [divmod(y - x, size - 2) for x, y in zip(a.shape, b.shape)]
        if any(rem for _, rem in grow):
            raise NotReplicable(f"logical tensor {a.name} does not grow linearly")
        out.append(Logical(a.name, tuple(x + g * (dp - 2) for x, (g, _) in zip(a.shape, grow)),
                           a.kind))
    return tuple(out)


def replicate(two: Columns, big: Columns, par: Parallelism, world: dict,
              spill: Callable[[Array], Array] = keep) -> Columns:
    """The columns of ``par`` (dp D) from its plans at dp 2 and dp S (``big``,
    S from its world spec, 3 <= S < D), each finished column passed through
    ``spill`` (gen_model/spill.py). ZeRO's owned shards (world key ``zero``)
    may be fitted as ``(e + f d) / D``."""
    block = par.cp * par.tp * par.ep_dp
    dp, unit = replicas(par), par.ep_dp
    size = int(big.world.get("dp", 0)) // unit
    if not 3 <= size < dp or int(two.world.get("dp", 0)) != 2 * unit:
        raise NotReplicable(f"expands plans of 2 and S replicas, 3 <= S < {dp}")
    if (two.loss, two.grads) != (big.loss, big.grads):
        raise NotReplicable(f"the loss or gradients differ between dp 2 and dp {size}")
    ex = _Expander(_Small(two, 2, block), _Small(big, size, block), dp, spill,
                   shards=bool(world.get("zero")))
    logical = real_logical(two, big, size, dp)
    tensors = ex.tensors(logical)
    nodes, kwargs = ex.nodes()
    return Columns(world=dict(world), logical=logical, loss=two.loss, grads=dict(two.grads),
                   tensors=tensors, nodes=nodes, ops=two.ops, names=two.names, kwargs=kwargs)


def small_sizes(par: Parallelism, gbs: int, count: int) -> tuple[Parallelism, int]:
    """The parallelism and batch of the same run at ``count`` replicas
    (:func:`replicas`: expert-parallel groups with experts)."""
    if gbs % (par.dp * par.nm):
        raise ConfigError(f"--gbs {gbs} does not split into dp {par.dp} x nm {par.nm} microbatches")
    dp = count * par.ep_dp
    return replace(par, dp=dp), gbs // par.dp * dp
