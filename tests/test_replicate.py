"""The array generator: a materialized plan of D replicas expanded from 2
and S replicas (S = 3, or with ZeRO a divisor of D; a replica is an
expert-parallel group with experts) is the row generator's plan, up to the
documented renumbering."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from backends.columnar import columns_bytes, save_columns, validate_columns
from gen_model.__main__ import main as gen_main
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_columns, make_plan, make_plan_at
from gen_model.parallelize import Policy
from gen_model.replicate import (
    NotReplicable,
    _fit,
    replicable,
    replicate,
    second_size,
    small_policy,
    small_sizes,
)
from gen_model.spill import Spill
from verdict.columns import Columns
from verdict.plan import Plan

MLP = ModelConfig("mlp", layers=2, hidden=8)
LLAMA = ModelConfig("llama3", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=32,
                    seqlen=8, optimizer="adam")
MOE = ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=32, vocab=32, seqlen=4,
                  experts=4, topk=2, capacity_factor=1.0, first_dense=1, moe_ffn=16)


def canonical(plan: Plan):
    """The plan without its numbering: its tensors, and on each rank the node
    sequence with tensors named by (rank, mb, tid, version)."""
    def key(i: int):
        return None if i < 0 else plan.tensors[i][:4]

    per_rank: dict[int, list] = {}
    for n in plan.nodes:
        per_rank.setdefault(n.rank, []).append(
            (n.mb, n.op, n.dir, tuple(map(key, n.inputs)), tuple(map(key, n.outputs)),
             sorted(n.kwargs.items(), key=str), n.name))
    return sorted(plan.tensors), per_rank


def smalls(cfg, par, gbs, policy):
    return [Columns.from_plan(make_plan_at(cfg, *small_sizes(par, gbs, dp), "default",
                                           small_policy(par, policy), loss_rows=gbs))
            for dp in (2, second_size(par, policy))]


@pytest.mark.parametrize(("cfg", "par", "gbs", "policy"), [
    (MLP, Parallelism(dp=5, tp=2, pp=2, nm=2), 20, Policy()),
    (LLAMA, Parallelism(dp=4, tp=2, pp=2, nm=2), 16, Policy(vocab_parallel=True)),
    (LLAMA, Parallelism(dp=4, cp=2, nm=2), 16, Policy(cp_balance=True, schedule="gpipe")),
    (replace(LLAMA, layers=4), Parallelism(dp=4, tp=2, pp=2, nm=2), 16,
     Policy(sequence_parallel=True, virtual_stages=2)),
    (MOE, Parallelism(dp=4, nm=2), 8, Policy()),
    (MOE, Parallelism(dp=8, ep=2, tp=2, pp=2, nm=2), 16, Policy()),
    (replace(MOE, kv_heads=4), Parallelism(dp=6, ep=4, tp=4, nm=2), 12, Policy()),
], ids=["mlp", "llama-vocab", "llama-cp", "llama-sp-vpp", "moe", "moe-ep2-edp4",
        "moe-experts-over-tp-edp6"])
def test_same_plan_as_the_row_generator(cfg, par, gbs, policy):
    assert replicable(par, policy, "default")
    rows = make_plan(cfg, par, gbs, policy=policy)
    two, three = smalls(cfg, par, gbs, policy)
    cols = replicate(two, three, par, rows.world)
    validate_columns(cols)
    got = cols.to_plan()
    assert got.world == rows.world and got.logical == rows.logical
    assert (got.loss, got.grads) == (rows.loss, rows.grads)
    assert canonical(got) == canonical(rows)
    # the replica groups share one input range: the pool grows as D, not D squared
    reducers = [n for n in rows.nodes if n.op == "reducer"]
    assert len(cols.nodes.inputs) < sum(len(n.inputs) for n in rows.nodes)
    assert reducers


def test_rows_where_the_array_path_does_not_apply():
    for par, policy in ((Parallelism(dp=4), Policy(zero=1)), (Parallelism(dp=2), Policy())):
        assert not replicable(par, policy, "default")
    cols = make_columns(MLP, Parallelism(dp=4), 8, policy=Policy(zero=2))
    assert canonical(cols.to_plan()) == canonical(make_plan(MLP, Parallelism(dp=4), 8,
                                                            policy=Policy(zero=2)))


def test_a_replica_that_differs_is_not_replicated():
    """Replica 1 of dp 2 reading replica 0's batch rows is not an affine
    family: the expansion refuses it instead of extrapolating."""
    par, gbs = Parallelism(dp=4), 8
    two, three = smalls(MLP, par, gbs, Policy())
    t = two.tensors
    ranks, mbs = np.asarray(t.rank), np.asarray(t.mb)
    data = [i for i, lg in enumerate(t.tid.tolist()) if two.logical[lg].kind == "data"]
    on_one = [i for i in data if ranks[i] == 1 and mbs[i] == 0]
    off = t.slice_offsets(two.logical)
    slices = np.array(t.slices)
    rows = off[on_one[0]]
    slices[rows] -= slices[rows][0]  # replica 1 loads rows [0, b) like replica 0
    bad = replace(two, tensors=replace(t, slices=slices))
    with pytest.raises(NotReplicable):
        replicate(bad, three, par, two.world)


def test_cli_writes_columns(tmp_path, capsys):
    args = ["--model", "mlp", "--layers", "2", "--hidden", "8", "--gbs", "8", "--dp", "4",
            "--format", "npz", "-o", str(tmp_path)]
    assert gen_main(args) == 0
    assert "nodes" in capsys.readouterr().out
    (path,) = tmp_path.glob("*.npz")
    assert not list(tmp_path.glob(".spill-*"))  # the spilled columns leave no file
    from backends.planfile import load_plan
    assert canonical(load_plan(path)) == canonical(make_plan(MLP, Parallelism(dp=4), 8))


def test_spilled_columns_write_the_same_file(tmp_path):
    """Columns spilled to disk as they are made (gen_model/spill.py) write
    the same bytes as columns kept in memory, which are np.savez's."""
    par = Parallelism(dp=5, tp=2, pp=2, nm=2)
    kept = make_columns(MLP, par, 20)
    spilled = make_columns(MLP, par, 20, spill=Spill(tmp_path / "work"))
    assert isinstance(spilled.nodes.inputs, np.memmap)
    assert not list((tmp_path / "work").iterdir())  # unlinked once mapped
    save_columns(spilled, tmp_path / "spilled.npz")
    save_columns(kept, tmp_path / "kept.npz")
    written = (tmp_path / "kept.npz").read_bytes()
    assert (tmp_path / "spilled.npz").read_bytes() == written == columns_bytes(kept)


ZMLP = ModelConfig("mlp", layers=2, hidden=24, optimizer="adam")
ZLLAMA = ModelConfig("llama3", layers=2, hidden=48, heads=4, kv_heads=2, ffn=96, vocab=48,
                     seqlen=8, optimizer="sgd")


@pytest.mark.parametrize(("cfg", "par", "gbs", "zero", "size"), [
    (ZMLP, Parallelism(dp=6, tp=2, pp=2, nm=2), 12, 1, 3),
    (replace(ZMLP, optimizer="sgd"), Parallelism(dp=8, nm=2), 16, 2, 4),
    (ZMLP, Parallelism(dp=6, tp=2, pp=2, nm=2), 12, 3, 3),
    (ZLLAMA, Parallelism(dp=8, tp=2, pp=2, nm=2), 16, 3, 4),
    (replace(ZLLAMA, optimizer="adam"), Parallelism(dp=6, tp=2, nm=2), 12, 1, 3),
    (ZLLAMA, Parallelism(dp=16), 16, 1, 4),
], ids=["mlp-adam-zero1-dp6", "mlp-sgd-zero2-dp8", "mlp-adam-zero3-dp6", "llama-sgd-zero3-dp8",
        "llama-adam-zero1-dp6", "llama-sgd-zero1-dp16"])
def test_zero_plans_are_the_row_generators(cfg, par, gbs, zero, size):
    """ZeRO replicas differ in their owned shard ((e + f d) / D), the keep's
    and reduce-scatter's index and the zeros' shape: expanded from dp 2 and
    a divisor S of D, the plan is the row generator's up to renumbering. At
    dp 16 the keys' dim (24) cuts into 2 and 4 owners but not 16: the small
    plans cut the next dim, as dp 16 does (Policy.zero_dims_at)."""
    policy = Policy(zero=zero)
    assert replicable(par, policy, "default") and second_size(par, policy) == size
    rows = make_plan(cfg, par, gbs, policy=policy)
    cols = replicate(*smalls(cfg, par, gbs, policy), par, rows.world)
    validate_columns(cols)
    got = cols.to_plan()
    assert (got.world, got.logical, got.loss, got.grads) == (rows.world, rows.logical,
                                                             rows.loss, rows.grads)
    assert canonical(got) == canonical(rows)


def test_zero_sizes_without_a_small_divisor_stay_rows():
    """dp 4, 5 and 9 have no divisor S with 3 <= S < D and 2 | D: a dim the
    small plans shard could differ from the one D replicas shard."""
    for dp in (4, 5, 9):
        assert not replicable(Parallelism(dp=dp), Policy(zero=1), "default")
    assert second_size(Parallelism(dp=10), Policy(zero=2)) == 5


def test_a_wrong_owned_shard_is_not_replicated():
    """Replica 1 of dp 2 owning replica 0's shard fits no family: refused."""
    par, gbs, policy = Parallelism(dp=6, nm=2), 12, Policy(zero=1)
    two, big = smalls(ZMLP, par, gbs, policy)
    t = two.tensors
    off = t.slice_offsets(two.logical)
    slices = np.array(t.slices)
    params = [i for i, lg in enumerate(t.tid.tolist()) if two.logical[lg].kind == "param"]
    on_one = [i for i in params if t.rank[i] == 1 and slices[off[i], 0] > 0]
    assert on_one
    first = off[on_one[0]]
    slices[first] -= slices[first, 0]  # the shard of replica 0
    with pytest.raises(NotReplicable):
        replicate(replace(two, tensors=replace(t, slices=slices)), big, par, two.world)


def test_shard_fits_refuse_what_they_cannot_tell_apart():
    """A value constant in d at 12 (dp 2) and 8 (dp 3) is 20 - 4 D or 24 / D:
    refused rather than guessed; a shard whose width is not whole at D too."""
    points = [np.array([v]) for v in (12, 12, 8, 8, 8)]
    with pytest.raises(NotReplicable, match="both"):
        _fit(points, 6, "x", shards=True)
    assert [int(v[0]) for v in _fit(points, 6, "x")] == [-4, 0]  # linear without ZeRO
    bounds = [np.array([v]) for v in (0, 12, 0, 8, 16)]  # offsets d * 24 / D
    assert [int(v[0]) for v in _fit(bounds, 6, "x", shards=True)] == [0, 4]
    with pytest.raises(NotReplicable, match="cut"):
        _fit(bounds, 5, "x", shards=True)


def test_the_generator_validates_once(tmp_path, monkeypatch):
    """An expanded ZeRO plan is validated once, by make_columns; the writer
    is told so."""
    import backends.columnar
    import gen_model.generate
    calls = []

    def counting(cols):
        calls.append(len(cols.nodes))
        real(cols)

    real = backends.columnar.validate_columns
    monkeypatch.setattr(backends.columnar, "validate_columns", counting)
    monkeypatch.setattr(gen_model.generate, "validate_columns", counting)
    args = ["--model", "mlp", "--layers", "2", "--hidden", "24", "--gbs", "6", "--dp", "6",
            "--zero", "2", "--format", "npz", "-o", str(tmp_path)]
    assert gen_main(args) == 0
    assert len(calls) == 1
    from backends.planfile import load_plan
    (path,) = tmp_path.glob("*.npz")
    rows = make_plan(ModelConfig("mlp", layers=2, hidden=24), Parallelism(dp=6), 6,
                     policy=Policy(zero=2))
    assert canonical(load_plan(path)) == canonical(rows)


@pytest.mark.parametrize("zero", [1, 3])
def test_expert_parallel_zero_plans_are_the_row_generators(zero):
    """With experts a replica is an expert-parallel group (d = edp x ep + e):
    ZeRO-1 and ZeRO-3 at edp 8 from edp 2 and 4, dense shards cut over all
    16 ranks and expert shards over the 8 groups."""
    cfg = replace(MOE, hidden=32, kv_heads=4, ffn=64, moe_ffn=32, experts=16)
    par, gbs, policy = Parallelism(dp=16, ep=2, nm=2), 32, Policy(zero=zero)
    assert replicable(par, policy, "default") and second_size(par, policy) == 4
    rows = make_plan(cfg, par, gbs, policy=policy)
    cols = replicate(*smalls(cfg, par, gbs, policy), par, rows.world)
    validate_columns(cols)
    assert canonical(cols.to_plan()) == canonical(rows)


def test_expert_layouts_that_change_with_the_size_stay_rows():
    """ep 4 over tp 2 at dp 6 (2 groups of the data-parallel axis) lays
    experts out otherwise at dp 4: no expansion."""
    assert not replicable(Parallelism(dp=10, ep=4, tp=2), Policy(), "default")
