"""The array generator over microbatches: a materialized plan of N
microbatches expanded from 3, 4 and 5 is the row generator's plan, up to
the documented renumbering (each microbatch's node sequence per rank kept,
their interleaving not)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from backends.columnar import validate_columns
from gen_model import replicate
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import expanded_columns, make_plan, make_plan_at
from gen_model.microbatches import SIZES, expand_microbatches, microbatches_replicable
from gen_model.parallelize import Policy
from gen_model.replicate import NotReplicable
from verdict.columns import Columns
from verdict.plan import Plan

MLP = ModelConfig("mlp", layers=2, hidden=8)
LLAMA = ModelConfig("llama3", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=32,
                    seqlen=8, optimizer="adam")
MOE = ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=32, vocab=32, seqlen=4,
                  experts=4, topk=2, capacity_factor=1.0, first_dense=1, moe_ffn=16)


def per_block(plan: Plan):
    """The plan without its numbering and interleaving: its tensors, and per
    (rank, microbatch) the node sequence with tensors named by their key."""
    def key(i: int):
        return None if i < 0 else plan.tensors[i][:4]

    blocks: dict[tuple[int, int], list] = {}
    for n in plan.nodes:
        blocks.setdefault((n.rank, n.mb), []).append(
            (n.op, n.dir, tuple(map(key, n.inputs)), tuple(map(key, n.outputs)),
             sorted(n.kwargs.items(), key=str), n.name))
    return sorted(plan.tensors), blocks


@pytest.mark.parametrize(("cfg", "par", "gbs", "policy"), [
    (MLP, Parallelism(pp=2, nm=7), 14, Policy()),
    (MLP, Parallelism(dp=2, tp=2, pp=2, nm=6), 24, Policy(schedule="gpipe")),
    (LLAMA, Parallelism(dp=4, tp=2, pp=2, nm=6), 48, Policy(vocab_parallel=True)),
    (LLAMA, Parallelism(dp=2, cp=2, nm=6), 12, Policy(cp_balance=True, schedule="gpipe")),
    (MOE, Parallelism(dp=8, ep=2, nm=6), 48, Policy()),
    (replace(MLP, hidden=24), Parallelism(dp=6, tp=2, pp=2, nm=7), 42, Policy(zero=3)),
    (LLAMA, Parallelism(dp=2, tp=2, pp=2, nm=6), 12, Policy(zero=2)),
], ids=["mlp-pp", "mlp-dp-tp-gpipe", "llama-replicas-and-microbatches",
        "llama-cp-two-accumulations-per-microbatch", "moe-expert-groups-and-microbatches",
        "mlp-zero3-replicas-and-microbatches", "llama-zero2"])
def test_same_plan_as_the_row_generator(cfg, par, gbs, policy):
    assert microbatches_replicable(par, policy, "default")
    cols = expanded_columns(cfg, par, gbs, "default", policy, None)
    validate_columns(cols)
    got, rows = cols.to_plan(), make_plan(cfg, par, gbs, policy=policy)
    assert got.world == rows.world and got.logical == rows.logical
    assert (got.loss, got.grads) == (rows.loss, rows.grads)
    assert per_block(got) == per_block(rows)


def smalls(par: Parallelism, gbs: int) -> list[Columns]:
    return [Columns.from_plan(make_plan_at(MLP, replace(par, nm=n), gbs // par.nm * n,
                                           "default", Policy(), loss_rows=gbs))
            for n in SIZES]


def test_a_microbatch_that_differs_is_not_expanded():
    """Microbatch 2 of the 4-microbatch plan loading microbatch 1's rows is
    not an affine family: the expansion refuses it instead of extrapolating."""
    par, gbs = Parallelism(pp=2, nm=8), 16
    plans = smalls(par, gbs)
    four = plans[1]
    t = four.tensors
    data = [i for i, lg in enumerate(t.tid.tolist())
            if four.logical[lg].kind == "data" and int(t.mb[i]) == 2]
    off = t.slice_offsets(four.logical)
    slices = np.array(t.slices)
    slices[off[data[0]]] -= 2  # two rows earlier: microbatch 1's rows
    plans[1] = replace(four, tensors=replace(t, slices=slices))
    with pytest.raises(NotReplicable):
        expand_microbatches(plans, par.nm, four.world)


def test_a_microbatch_running_another_op_is_not_expanded():
    par, gbs = Parallelism(pp=2, nm=8), 16
    plans = smalls(par, gbs)
    five = plans[2]
    n = five.nodes
    ops = np.array(n.op)
    victim = int(np.flatnonzero((np.asarray(n.mb) == 3) & (ops != ops[0]))[0])
    ops[victim] = (int(ops[victim]) + 1) % len(five.ops)
    plans[2] = replace(five, nodes=replace(n, op=ops))
    with pytest.raises(NotReplicable):
        expand_microbatches(plans, par.nm, five.world)


def test_where_the_microbatch_path_does_not_apply():
    assert not microbatches_replicable(Parallelism(pp=2, nm=5), Policy(), "default")
    assert not microbatches_replicable(Parallelism(pp=2, nm=8), Policy(virtual_stages=2),
                                       "default")


def test_replica_expansion_in_small_chunks_is_the_same(monkeypatch):
    """The replica expansion computes its output a chunk at a time; chunks
    that split templates and slices give the same columns."""
    par, gbs = Parallelism(dp=5, tp=2, pp=2, nm=2), 20
    whole = expanded_columns(MLP, par, gbs, "default", Policy(), None)
    monkeypatch.setattr(replicate, "_CHUNK", 3)
    chunked = expanded_columns(MLP, par, gbs, "default", Policy(), None)
    for group in ("tensors", "nodes"):
        a, b = getattr(whole, group), getattr(chunked, group)
        for name, arr in vars(a).items():
            if arr is not None:
                assert np.array_equal(arr, getattr(b, name)), (group, name)
