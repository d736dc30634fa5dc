"""The array generator: a materialized plan of D replicas expanded from dp 2
and dp 3 is the row generator's plan, up to the documented renumbering."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from backends.columnar import columns_bytes, save_columns, validate_columns
from gen_model.__main__ import main as gen_main
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_columns, make_plan, make_plan_at
from gen_model.parallelize import Policy
from gen_model.replicate import NotReplicable, replicable, replicate, small_sizes
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
    return [Columns.from_plan(make_plan_at(cfg, *small_sizes(par, gbs, dp), "default", policy,
                                           loss_rows=gbs)) for dp in (2, 3)]


@pytest.mark.parametrize(("cfg", "par", "gbs", "policy"), [
    (MLP, Parallelism(dp=5, tp=2, pp=2, nm=2), 20, Policy()),
    (LLAMA, Parallelism(dp=4, tp=2, pp=2, nm=2), 16, Policy(vocab_parallel=True)),
    (LLAMA, Parallelism(dp=4, cp=2, nm=2), 16, Policy(cp_balance=True, schedule="gpipe")),
    (replace(LLAMA, layers=4), Parallelism(dp=4, tp=2, pp=2, nm=2), 16,
     Policy(sequence_parallel=True, virtual_stages=2)),
    (MOE, Parallelism(dp=4, nm=2), 8, Policy()),
], ids=["mlp", "llama-vocab", "llama-cp", "llama-sp-vpp", "moe"])
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
