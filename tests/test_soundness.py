"""The holes a set of independent wrong plans found, each closed: shape
reduction that hid confused dims, a rank ending with another shard's
gradient or with none, a loss left partial across tensor-parallel ranks;
and the numeric check's own holes. Every wrong plan here is also judged
wrong by the oracle (harness/oracle.py), which trusts no claim of a
computed tensor."""

from __future__ import annotations

import random
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import plan_pair

from gen_model.config import ModelConfig, Parallelism
from harness import mutations
from harness.oracle import judge
from main import verify
from verdict.differential import compare
from verdict.final import loss_groups, rank_states
from verdict.plan import Node, Plan

ROOT = Path(__file__).resolve().parent.parent
MLP = ModelConfig("mlp", layers=2, hidden=8)
LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=4)
BASE = Parallelism(dp=2, tp=2, pp=2, nm=2)


def plans(cfg: ModelConfig, par: Parallelism = BASE, gbs: int = 8) -> tuple[Plan, Plan]:
    return plan_pair(cfg, par, gbs)


def wrong(single: Plan, plan: Plan):
    """Verify a plan the oracle finds wrong; return the verdict."""
    assert not judge(single, plan).right
    v = verify(single, plan)
    assert not v.success
    return v


def insert_transpose(plan: Plan, t: int, dims: tuple[int, int]) -> Plan:
    p = mutations.copy_plan(plan)
    x = p.tensors[t]
    assert mutations._insert_after_producer(p, t, lambda a, b: [Node(
        x.rank, x.mb, "transpose", "fw", (a,), (b,), {"dim0": dims[0], "dim1": dims[1]}, "t")])
    return p


def computed(plan: Plan, pred) -> int:
    return next(o for n in plan.nodes for o in n.outputs if o >= 0 and pred(plan.tensors[o], n))


# --- 1. shape reduction and confused dims ------------------------------------


@pytest.mark.parametrize("nm", [1, 2])
def test_transpose_of_a_square_gradient_piece_is_a_dims_finding(nm):
    """mlp hidden 8, tp2 dp2: a [4, 4] piece of an input gradient (batch 4 by
    half the hidden size); reduced to 1x1 pieces a transpose would be the
    identity."""
    single, plan = plans(MLP, Parallelism(dp=2, tp=2, nm=nm), gbs=8 * nm)
    t = computed(plan, lambda x, n: x.shape == (4, 4) and n.rank == 1 and n.op == "linear"
                 and n.dir == "bw")
    v = wrong(single, insert_transpose(plan, t, (0, 1)))
    assert v.kind == "dims" and "op='transpose'" in v.message and "rank=1" in v.message


def test_swapped_linear_operands_of_equal_shape_are_a_dims_finding():
    """x and the weight shard both [4, 8] (mlp ly2 hidden 8 gbs 16 dp2 pp2
    tp2 nm2, layers.0 on rank 2, microbatch 1): x @ w.T and w @ x.T have the
    same shape and transposed values."""
    single, plan = plans(MLP, BASE, gbs=16)
    i = next(i for i, n in enumerate(plan.nodes) if n.op == "linear" and n.dir == "fw"
             and n.name == "layers.0" and n.rank == 2 and n.mb == 1)
    x, w = plan.nodes[i].inputs
    assert plan.tensors[x].shape == plan.tensors[w].shape == (4, 8)
    p = mutations.copy_plan(plan)
    p.nodes[i] = p.nodes[i]._replace(inputs=(w, x))
    v = wrong(single, p)
    assert v.kind == "dims" and "op='linear'" in v.message and "rank=2" in v.message
    assert "mb=1" in v.message


def test_transpose_of_a_non_square_piece_is_a_shape_mismatch():
    single, plan = plans(LLAMA)
    t = computed(plan, lambda x, n: len(x.shape) == 4 and x.shape[1] != x.shape[2]
                 and n.rank == 0 and n.dir == "fw")
    p = insert_transpose(plan, t, (1, 2))
    p.tensors[-1] = p.tensors[-1]._replace(shape=tuple(p.tensors[t].shape[i] for i in (0, 2, 1, 3)))
    v = verify(single, p)
    assert not v.success and v.kind == "shape"


def test_cyclic_permute_of_three_equal_dims_is_a_dims_finding():
    cfg = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=4, ffn=24, vocab=16,
                      seqlen=4)
    single, plan = plans(cfg, Parallelism(dp=2, nm=2))
    t = computed(plan, lambda x, n: x.shape[1:] == (4, 4, 4) and n.dir == "fw")
    p = insert_transpose(insert_transpose(plan, t, (1, 2)), len(plan.tensors), (2, 3))
    assert not judge(single, p).right
    v = verify(single, p)
    assert not v.success and v.kind == "dims"


def test_view_that_mixes_dims_before_a_reshape_is_a_dims_finding():
    """A transposed [S, S]-shaped score piece read by the next op: at reduced
    size the sequence dims of q and k must not be confused. The mask ties
    its two sequence dims into one class, so the transpose stays in that
    class and the mask's stage proof fails (each piece keeps 2 positions,
    rule 4), or another stage finds the dims mixed."""
    single, plan = plans(LLAMA, Parallelism(tp=2, nm=2))
    t = computed(plan, lambda x, n: n.op == "causal_mask" and n.dir == "fw")
    v = wrong(single, insert_transpose(plan, t, (2, 3)))
    assert v.kind in ("dims", "stage")


def test_causal_mask_keeps_both_sequence_dims_at_least_two_long():
    """At 1x1 the mask hides nothing and a transpose of its piece is the
    identity: both sequence dims keep at least 2 after reduction."""
    from verdict.lineage import infer_lineages
    from verdict.reduce import reduce_stage
    from verdict.stages import cut_stages

    single, plan = plans(LLAMA, Parallelism(tp=2))
    lineages, of_gs, of_gp = infer_lineages(single, plan)
    stages = cut_stages(single, plan, lineages, of_gs, of_gp)
    for st in stages:
        if st.gs_node < 0 or single.nodes[st.gs_node].op != "causal_mask":
            continue
        tensors = sorted({t for i in st.gp_nodes for t in (*plan.nodes[i].inputs,
                                                            *plan.nodes[i].outputs) if t >= 0})
        red = reduce_stage(single, plan, st, lineages, of_gp, tensors)
        assert all(min(red.gp_shape(t)[-2:]) >= 2 for t in tensors)


def test_unflatten_with_swapped_sizes_is_a_shape_mismatch():
    single, plan = plans(LLAMA)
    i = next(i for i, n in enumerate(plan.nodes) if n.op == "unflatten" and n.rank == 0
             and n.dir == "fw" and len(set(n.kwargs["sizes"])) > 1)
    p = mutations.copy_plan(plan)
    kw = plan.nodes[i].kwargs
    p.nodes[i] = p.nodes[i]._replace(kwargs={**kw, "sizes": list(reversed(kw["sizes"]))})
    v = verify(single, p)
    assert not v.success and v.kind == "shape"


# --- 2 and 3. what every rank ends with ----------------------------------------


def test_rank_ending_with_another_shards_gradient_fails_naming_both_slices():
    single, plan = plans(LLAMA)
    p, _ = mutations.wrong_final_shard(plan, random.Random(0))
    v = wrong(single, p)
    assert v.kind == "coverage"
    assert "holds shard" in v.message and "the gradient of slice" in v.message


def test_reducer_on_the_wrong_replica_group_fails():
    single, plan = plans(MLP)
    p, _ = mutations.wrong_reducer_group(plan, random.Random(0))
    v = wrong(single, p)
    assert v.kind == "coverage" and "the gradient of slice" in v.message


def test_rank_holding_a_shard_with_no_gradient_fails():
    single, plan = plans(LLAMA)
    p, target = mutations.missing_gradient(plan, random.Random(3))
    v = wrong(single, p)
    assert v.kind in ("coverage", "unreachable", "stage")
    if v.kind == "coverage":
        assert "ends with no gradient" in v.message


def test_missing_gradient_with_replicas_covering_the_union_fails_on_the_rank():
    """tp2 dp2: rank 1's chain for its shard is gone; the replica's reducer
    (a group of one now) still writes the same slice, so the union of all
    ranks covers the gradient. The rank that holds the shard has nothing."""
    single, plan = plans(MLP, Parallelism(dp=2, tp=2))
    buf = next(iter(plan.grads.values()))
    for seed in range(40):
        p, target = mutations.missing_gradient(plan, random.Random(seed))
        if target.endswith("on rank 1") and plan.logical[buf].name in target:
            break
    v = verify(single, p)
    assert not judge(single, p).right and not v.success
    assert v.kind == "stage" or "rank 1 holds shard" in v.message


def test_every_rank_that_holds_a_shard_is_checked():
    single, plan = plans(LLAMA)
    states = rank_states(single, plan)
    assert sorted(states) == list(range(8))
    assert all(st.held and set(st.held) == set(st.last_grad) for st in states.values())


# --- 4. the loss -----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_loss_left_partial_across_tensor_parallel_ranks_fails(seed):
    single, plan = plans(LLAMA)
    p, target = mutations.partial_loss(plan, random.Random(seed))
    v = wrong(single, p)
    assert v.kind in ("stage", "coverage")
    if v.kind == "coverage":
        assert "the loss on ranks" in v.message


def test_loss_groups_are_data_parallel_replicas():
    single, plan = plans(LLAMA)
    groups = loss_groups(single, plan, rank_states(single, plan))
    ranks = [sorted({plan.tensors[t].rank for t in g}) for g in groups]
    assert ranks == [[4, 6], [5, 7]] and all(len(g) == 4 for g in groups)


# --- the numeric check -----------------------------------------------------------


def test_numeric_check_refuses_a_read_of_another_ranks_tensor():
    single, plan = plans(LLAMA)
    p, _ = mutations.drop_send(plan, random.Random(0))
    report = compare(single, p)
    assert not report.equal and "without communication" in report.broken


def test_numeric_check_compares_every_replica_of_a_partial_part():
    """A replica of a partial part (rank 1's copy of a part rank 0 also
    holds) scaled: the first cover may not use it, the replica check does."""
    single, plan = plans(LLAMA, Parallelism(dp=2, tp=2, nm=2))
    reps = {}
    for i, t in enumerate(plan.tensors):
        if not t.is_whole() and t.mb >= 0 and plan.logical[t.tid].kind == "grad":
            reps.setdefault((t.tid, t.lver, t.slices, t.parts), []).append(i)
    same = next(v for v in reps.values() if len(v) > 1)
    p = mutations.copy_plan(plan)
    x = p.tensors[same[1]]
    assert mutations._insert_after_producer(p, same[1], lambda a, b: [Node(
        x.rank, x.mb, "mul_scalar", "fw", (a,), (b,), {"value": 2.0}, "scale")])
    report = compare(single, p)
    assert any(d.what == "replica of one partial part" for d in report.differences)


def test_numeric_check_applies_the_per_rank_contract():
    single, plan = plans(LLAMA)
    p, _ = mutations.wrong_final_shard(plan, random.Random(0))
    report = compare(single, p)
    assert any("not the single-device gradient of its shard" in u for u in report.uncovered)
    p, _ = mutations.partial_loss(plan, random.Random(0))
    assert not compare(single, p).equal


# --- the harness -------------------------------------------------------------------


def test_quick_subset_covers_sequence_context_ring_zero_and_optimizer_bases():
    harness = runpy.run_path(str(ROOT / "scripts" / "mutate.py"))
    bases = {**harness["BASES"], **harness["FOLD_BASES"]}
    quick = [bases[b] for b in harness["QUICK_BASES"] if b in bases]
    assert any(b in harness["RING_BASES"] for b in harness["QUICK_BASES"])
    assert any(policy.sequence_parallel for _, _, policy in quick)
    assert any(par.cp > 1 and not policy.ulysses for _, par, policy in quick)
    assert {1, 2} <= {policy.zero for _, _, policy in quick}
    assert {"sgd", "adam"} <= {cfg.optimizer for cfg, _, _ in quick}


#: The part of the ``--quick`` bases run here: all but the llama3 one with
#: sequence and context parallelism, two thirds of the whole ``--quick``
#: run's time, which runs before each merge (docs/mutation.md). Every
#: unfolded base runs the canaries.
QUICK_SAMPLE = ("mlp_dp2_pp2_tp2_nm2", "mlp_zero1_dp2_pp2_tp2_nm2", "mlp_sgd_dp2_tp2_nm2",
                "mlp_adam_zero2_dp2_nm2", "mlp_fold_dp4_pp2_tp2_nm4", "ring_cpbal2")


def test_quick_sample_keeps_a_ring_zero_optimizer_and_folded_base():
    harness = runpy.run_path(str(ROOT / "scripts" / "mutate.py"))
    assert set(QUICK_SAMPLE) < set(harness["QUICK_BASES"])
    assert any(b in harness["RING_BASES"] for b in QUICK_SAMPLE)
    assert any(b in harness["FOLD_BASES"] for b in QUICK_SAMPLE)
    bases = harness["BASES"]
    sample = [bases[b] for b in QUICK_SAMPLE if b in bases]
    assert {1, 2} <= {policy.zero for _, _, policy in sample}
    assert {"sgd", "adam"} <= {cfg.optimizer for cfg, _, _ in sample}


def test_mutation_harness_quick_subset():
    """0 wrong SUCCESS means something only while the harness still sees:
    every canary caught, no (base, operator) below its floor, no operator
    over its ceiling of equivalent outcomes (harness/blindness.py). On
    ``QUICK_SAMPLE``, the floors of its bases."""
    done = subprocess.run([sys.executable, "scripts/mutate.py", "--quick", "--bases",
                           ",".join(QUICK_SAMPLE)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "0 wrong SUCCESS (a wrong mutant verified), 0 false alarms (a rewrite" in out
    assert "0 without a verdict" in out and "harmless that FAILed on the plan's claims" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("harness blindness:"))
    caught, total = (int(w) for w in line.split()[2:5:2])
    assert caught == total >= 5 and line.endswith(" 0 blind spots"), line


# --- the world's layout ------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_layout_that_calls_tensor_parallel_peers_replicas_fails(seed):
    """With tp folded into dp in the world spec, the peers' loss parts would
    sum to the whole loss: the layout is checked against the rows each rank
    loads, by the verifier, the numeric check and the oracle."""
    single, plan = plans(LLAMA, Parallelism(tp=2, nm=2))
    p, _ = mutations.mislabel_layout(plan, random.Random(seed))
    v = wrong(single, p)
    assert v.kind == "layout" and "the layout does not describe the plan" in v.message
    assert not compare(single, p).equal


def test_ranks_outside_the_layout_fail():
    single, plan = plans(LLAMA)
    p = mutations.copy_plan(plan)
    p.world = {**p.world, "pp": 1}
    v = verify(single, p)
    assert not v.success and v.kind == "layout" and "outside" in v.message


def test_layout_of_every_grid_shape_is_accepted():
    for par in (Parallelism(dp=2, tp=2, pp=2, nm=2), Parallelism(dp=4, nm=2),
                Parallelism(tp=4, pp=2), Parallelism(dp=2, pp=2)):
        single, plan = plans(MLP, par, gbs=16)
        assert verify(single, plan).success


# --- regrouped accumulation: (buf + g0) + g1 as buf + (g0 + g1) ---------------


def regrouped_on_a_replicated_weight(plan: Plan) -> Plan:
    """The regrouping rewrite struck at a norm weight's gradient buffer,
    which the tensor-parallel peer accumulates in the other grouping."""
    for seed in range(200):
        made, where = mutations.REWRITES["regroup_accumulation"](plan, random.Random(seed))
        if "norm.weight" in where:
            return made
    raise AssertionError("no norm-weight accumulation to regroup")


def test_regrouped_accumulation_is_proved_equal_to_its_replica():
    single, plan = plans(LLAMA, Parallelism(dp=2, tp=2, nm=2))
    made = regrouped_on_a_replicated_weight(plan)
    assert judge(single, made).right
    v = verify(single, made)
    assert v.success, v.message


def test_regrouped_accumulation_of_a_wrong_part_fails():
    """The add claims the union of two microbatches' parts but reads the
    first twice: judged wrong, and a FAIL."""
    single, plan = plans(LLAMA, Parallelism(dp=2, tp=2, nm=2))
    made = regrouped_on_a_replicated_weight(plan)
    i = next(i for i, n in enumerate(made.nodes) if n.name.endswith(".regrouped"))
    n = made.nodes[i]
    made.nodes[i] = n._replace(inputs=(n.inputs[0], n.inputs[0]))
    wrong(single, made)


def test_linking_covers_tie_every_grouping_of_the_parts():
    from verdict.lineage import exact_covers, linking_covers
    parts = [(0, 1, 10), (1, 2, 11), (2, 3, 12), (3, 4, 13), (0, 2, 14), (1, 3, 15)]
    covers, rest = exact_covers(parts, 4)
    assert covers == [(14, 12, 13)] and rest == [10, 11, 15]
    linked, loose = linking_covers(parts, 4, rest)
    assert linked == [(10, 15, 13), (10, 11, 12, 13)] and loose == []
    assert linking_covers([(0, 1, 1), (2, 3, 2), (0, 3, 3)], 3, [1, 2]) == ([], [1, 2])
