"""The block check keeps its arrays narrow (int32, int16), finds the
representatives and compares kwargs and entries a chunk of nodes at a
time, and its later passes recheck only the nodes whose representative
changed: re-implementations of the same comparisons, so it must reach the
same result as the wide, one-chunk check whose every pass is in full, and
as the whole-plan representatives and kwargs comparison (kept here as the
reference), on uniform plans and on plans that differ in one block, one
microbatch, one rank's group or one replica's owned shard (verdict/symmetry/blocks.py, arrays.py)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest

from gen_model.config import Parallelism
from gen_model.parallelize import Policy
from harness import mutations
from tests.helpers import MLP, plan_pair
from verdict.columns import Columns
from verdict.lineage import StructureError
from verdict.symmetry import arrays, blocks, glue, programs
from verdict.symmetry.find import Refusal, Symmetry, find_symmetry

MESH = Parallelism(dp=4, tp=2, pp=2, nm=4)


def outcome(single, plan) -> str:
    """What find_symmetry concludes of a plan or its columns, as text (a
    layout finding included)."""
    try:
        found = find_symmetry(single, plan if isinstance(plan, Columns) else
                              Columns.from_plan(plan))
    except StructureError as e:
        return f"finding {e.kind}: {e}"
    if isinstance(found, Refusal):
        return f"refused (difference={found.difference}): {found.why}"
    assert isinstance(found, Symmetry)
    return (f"proved by {found.describe()}, ranks {found.ranks()}, "
            f"{len(found.folded.nodes)} nodes in the cut")


def plans():
    single, plan = plan_pair(MLP, MESH, 32)
    yield "uniform", single, plan
    for name, mutate in mutations.MATERIALIZED_MUTATIONS.items():
        made = mutate(plan, random.Random(f"narrow/{name}"))
        if made is not None:  # None: the operator needs another plan (ZeRO's owned shard)
            yield name, single, made[0]
    bad = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(plan.nodes) if n.op == "div" and n.mb == 3
             and (n.rank // 2) % 4 == 2)
    n = bad.nodes[i]
    bad.nodes[i] = n._replace(kwargs={**n.kwargs, "value": n.kwargs["value"] * 2})
    yield "one replica's constant", single, bad
    single, zero = plan_pair(MLP, Parallelism(dp=4, nm=2), 16, Policy(zero=1))
    yield "ZeRO-1", single, zero
    for seed in range(2):  # with and without the gradient split moved along
        made = mutations.owned_shard(zero, random.Random(f"narrow/owned/{seed}"))
        assert made is not None
        yield f"one replica's owned shard ({seed})", single, made[0]


def whole_representatives(self, only=None):
    """The representatives as one whole-plan sort (the reference)."""
    cols, dp, nm = self.cols, self.fold.dp, self.fold.nm
    n_cls, n_d = (a.astype(np.int64) for a in self.split(cols.n_rank.astype(np.int64)))
    nn = len(cols.n_rank)
    mb = cols.n_mb.astype(np.int64)
    block = (n_cls.astype(np.int64) * dp + n_d) * (nm + 1) + mb + 1
    order = np.argsort(block, kind="stable")
    ids, starts, counts = np.unique(block[order], return_index=True, return_counts=True)
    pos = np.empty(nn, dtype=np.int64)
    pos[order] = np.arange(nn) - np.repeat(starts, counts)
    self.check_present(ids)
    own_size = counts[np.searchsorted(ids, block)]
    rep_d = 0 if self.rep_of_d is None else self.rep_of_d[n_d]
    rep_slot = np.minimum(mb + 1, 1) if self.rep_of_m is None else \
        np.where(mb >= 0, self.rep_of_m[np.maximum(mb, 0)] + 1, 0)
    rep_block = (n_cls.astype(np.int64) * dp + rep_d) * (nm + 1) + rep_slot
    where = np.minimum(np.searchsorted(ids, rep_block), len(ids) - 1)
    found = ids[where] == rep_block
    size = np.where(found, counts[where], 0)
    found &= pos < size
    rep = np.where(found, order[np.minimum(starts[where] + pos, nn - 1)], -1)
    if only is not None:
        own_size = np.where(only, own_size, size)
    self.flag(own_size != size, np.arange(nn), "its block has another number of nodes than the "
              "representative's", np.where(rep >= 0, rep, order[starts[where]]))
    return rep


def whole_check_kwargs(self, rep, orbit, only=None):
    """Operator, direction, kwargs and counts against the representative's,
    over the whole plan at once, normalizing node by node (the reference)."""
    cols, p = self.cols, self.p
    kw = cols.n_kw.astype(np.int64)
    table, normal = {}, {}
    send = np.array([op == "send_recv" for op in cols.ops])[cols.n_op]
    own_index = orbit | self.owned.nodes
    for i in np.flatnonzero(own_index | send).tolist():
        key = (int(cols.n_kw[i]), int(self.n_d[i]), bool(own_index[i]))
        if key not in normal:
            kwargs = p.kwargs_of(key[0])
            if own_index[i]:
                kwargs.pop("index", None)
            off = False
            for k in ("src", "dst"):
                if send[i] and isinstance(kwargs.get(k), int):
                    cls, d = self.mesh.split(kwargs[k])
                    off |= d != key[1]
                    kwargs[k] = list(cls)
            text = json.dumps(kwargs, sort_keys=True)
            normal[key] = -1 if off else len(p.kwargs) + table.setdefault(text, len(table))
        kw[i] = normal[key]
    nodes = np.arange(len(kw))
    self.flag(kw == -1, nodes, "its send/receive peer is in another replica")
    ok = (rep >= 0) if only is None else (rep >= 0) & only
    r = np.maximum(rep, 0)
    self.flag(ok & ((cols.n_op != cols.n_op[r]) | (cols.n_dir != cols.n_dir[r])), nodes,
              "another operator or direction", rep)
    self.flag(ok & (kw != kw[r]), nodes, "other kwargs", rep)
    for tuples, what in ((cols.n_ins, "inputs"), (cols.n_outs, "outputs")):
        n = cols.ptr[tuples + 1] - cols.ptr[tuples]
        self.flag(ok & (n != n[r]), nodes, f"another number of {what}", rep)


def test_narrow_chunked_check_agrees_with_the_wide_one(monkeypatch):
    cases = list(plans())
    narrow = [outcome(s, p) for _, s, p in cases]
    with monkeypatch.context() as m:
        for module in (arrays, glue):
            m.setattr(module, "NODE_CHUNK", 7)  # many chunks, split inside blocks
        tiny = [outcome(s, p) for _, s, p in cases]
    with monkeypatch.context() as m:
        for module in (arrays, blocks, programs):  # where the check's arrays are made and read
            m.setattr(module, "index_array", lambda a: np.asarray(a).astype(np.int64))
            m.setattr(module, "fitting", lambda *values: np.dtype(np.int64))
        for module in (arrays, blocks):
            m.setattr(module, "small_array", lambda a, *limits: np.asarray(a).astype(np.int64))
        for module in (arrays, glue):
            m.setattr(module, "NODE_CHUNK", 1 << 40)
        wide = [outcome(s, p) for _, s, p in cases]
    with monkeypatch.context() as m:  # every pass of block_classes in full
        m.setattr(blocks.BlockCheck, "recheck", blocks.BlockCheck.first_pass)
        full = [outcome(s, p) for _, s, p in cases]
    with monkeypatch.context() as m:  # the whole-plan reference
        m.setattr(blocks.BlockCheck, "representatives", whole_representatives)
        m.setattr(blocks.BlockCheck, "check_kwargs", whole_check_kwargs)
        reference = [outcome(s, p) for _, s, p in cases]
    assert narrow == wide == tiny == full == reference
    assert any("class" in got for got in narrow)  # some plan needs a second pass
    names = [name for name, _, _ in cases]
    assert {"other_rows", "replica_group", "microbatch_op", "last_microbatch"} <= set(names)
    zero = names.index("ZeRO-1")
    assert narrow[0].startswith("proved") and narrow[zero].startswith("proved")
    for name, got in zip(names, narrow):
        if name not in ("uniform", "ZeRO-1"):
            # caught: a finding, a refusal, or the differing blocks in a cut of their own
            assert got != narrow[zero if "owned" in name else 0], name


def test_index_arrays_are_int32_when_they_fit():
    assert arrays.index_array(np.array([0, 2**31 - 1], dtype=np.int64)).dtype == np.int32
    assert arrays.index_array(np.array([-1, 5], dtype=np.int8)).dtype == np.int32
    assert arrays.index_array(np.array([2**31], dtype=np.int64)).dtype == np.int64


@pytest.mark.parametrize("dtype", [np.int8, np.int64])
def test_arrays_of_narrow_and_wide_columns_are_equal(dtype):
    _, plan = plan_pair(MLP, MESH, 32)
    cols = Columns.from_plan(plan)
    a = arrays.arrays(cols)
    for name in ("flat", "ptr", "t_producer"):
        assert getattr(a, name).dtype == np.int32
    # the world's ranks, microbatches, ops and tensor ids fit int8
    for name in ("t_rank", "n_rank", "n_mb", "t_mb", "n_op", "n_dir", "t_tid"):
        assert getattr(a, name).dtype == np.int8
    assert np.array_equal(a.n_rank, np.asarray(cols.nodes.rank, dtype=dtype).astype(np.int64))


def tuples_of(a: arrays.Arrays, i: int) -> tuple[list[int], list[int]]:
    """Node i's inputs and outputs as the check's arrays hold them."""
    ins, outs = int(a.n_ins[i]), int(a.n_outs[i])
    return (a.flat[a.ptr[ins]:a.ptr[ins + 1]].tolist(),
            a.flat[a.ptr[outs]:a.ptr[outs + 1]].tolist())


def with_gaps(cols: Columns) -> Columns:
    """The same plan with an unused pool entry (tensor 0) before every input range."""
    n = cols.nodes
    starts, counts = n.in_start.astype(np.int64), n.in_count.astype(np.int64)
    distinct = np.unique(starts[counts > 0])
    moved = starts + np.searchsorted(distinct, starts, side="right")
    pool = np.insert(n.inputs.astype(np.int64), distinct, 0)
    return replace(cols, nodes=replace(n, in_start=moved, inputs=pool))


def test_arrays_hold_every_nodes_entries_with_and_without_gaps_in_the_pool():
    _, plan = plan_pair(MLP, MESH, 32)
    cols = Columns.from_plan(plan)
    for c in (cols, with_gaps(cols)):
        a = arrays.arrays(c)
        assert len(a.ptr) == len(a.n_ins) + int(a.n_ins.max()) + 2
        for i in range(len(c.nodes)):
            assert tuples_of(a, i) == (c.inputs_of(i).tolist(), c.outputs_of(i).tolist())
        shared = [i for i in range(len(c.nodes)) if c.nodes.in_start[i] == c.nodes.in_start[0]
                  and c.nodes.in_count[i] > 0]
        assert len({int(a.n_ins[i]) for i in shared}) == 1  # one tuple per distinct range


def test_arrays_refuse_overlapping_input_ranges():
    _, plan = plan_pair(MLP, MESH, 32)
    cols = Columns.from_plan(plan)
    n = cols.nodes
    i = int(np.flatnonzero(n.in_count.astype(np.int64) > 1)[0])
    start = n.in_start.astype(np.int64)
    start[i] += 1  # now inside another range, or overlapping the next
    with pytest.raises(ValueError, match="input ranges"):
        arrays.arrays(replace(cols, nodes=replace(n, in_start=start)))


def padded(cols: Columns, ops: int, kwargs: int) -> Columns:
    """The same plan with ``ops`` and ``kwargs`` unused entries before its
    op and kwargs tables (codes moved along): the codes then need a wider
    type than the plan's own."""
    n = cols.nodes
    return replace(cols, ops=(cols.ops[0],) * ops + cols.ops,
                   kwargs=("{}",) * kwargs + cols.kwargs,
                   nodes=replace(n, op=n.op.astype(np.int64) + ops,
                                 kwargs=n.kwargs.astype(np.int64) + kwargs))


def test_codes_and_ranks_past_the_narrow_types_take_the_wide_path():
    """A world of 128 ranks (int16 ranks) and op and kwargs codes past
    int8 and int16: the check's range checks choose the wide types, and it
    concludes as it does with the narrow ones, on a uniform plan, one whose
    blocks differ and one that breaks a rule."""
    single, plan = plan_pair(MLP, Parallelism(dp=32, tp=2, pp=2, nm=2), 64)
    cases = [("uniform", plan)]
    for name in ("replica_op", "other_rows"):
        made = mutations.MATERIALIZED_MUTATIONS[name](plan, random.Random(f"wide/{name}"))
        assert made is not None
        cases.append((name, made[0]))
    seen = []
    for name, p in cases:
        cols = Columns.from_plan(p)
        wide = padded(cols, 200, 40_000)
        a = arrays.arrays(wide)
        assert (a.n_rank.dtype, a.t_rank.dtype) == (np.int16, np.int16)
        assert (a.n_op.dtype, a.n_kw.dtype) == (np.int16, np.int32)
        assert arrays.arrays(cols).n_kw.dtype.itemsize < 4
        got, want = outcome(single, wide), outcome(single, cols)
        assert got == want, name
        seen.append(got)
    # the differing replica is proved as a class of its own, the rows outside a block refused
    assert seen[0].startswith("proved") and "another operator" not in seen[0]
    assert "another operator or direction" in seen[1]
    assert not seen[2].startswith("proved")


def test_fitting_types():
    assert arrays.fitting(-1, 127) == np.int8
    assert arrays.fitting(-129, 0) == np.int16
    assert arrays.fitting(32768) == np.int32
    assert arrays.fitting(-2**31 - 1) == np.int64
    assert arrays.small_array(np.array([0, 40_000]), 5).dtype == np.int32
    assert arrays.small_array(np.array([0, 3]), 128).dtype == np.int16
