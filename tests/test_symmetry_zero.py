"""ZeRO-1 materialized plans proved by their checked symmetry (verdict/symmetry/owned.py;
docs/soundness.md "ZeRO-1: owned shards"): correct plans verify by classes,
wrong ones FAIL, whichever path proves them."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from gen_model.config import Parallelism
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge
from main import verify
from tests.helpers import MLP, plan_pair
from verdict.plan import Plan
from verdict.symmetry.find import Refusal, Symmetry, find_symmetry

ZERO1 = Policy(zero=1)


def pair(dp: int, nm: int = 4, policy: Policy = ZERO1, **par) -> tuple[Plan, Plan]:
    return plan_pair(MLP, Parallelism(dp=dp, nm=nm, **par), 2 * dp * nm, policy)


def replica(plan: Plan, rank: int) -> int:
    inner = int(plan.world.get("tp", 1)) * int(plan.world.get("cp", 1))
    return (rank // inner) % int(plan.world["dp"])


def wrong_and_fails(single: Plan, wrong: Plan) -> str:
    """The plan is wrong by the oracle and FAILs; the verifier's symmetry line."""
    assert not judge(single, wrong).right
    v = verify(single, wrong)
    assert not v.success and v.kind != "internal", v.message
    return v.symmetry


@pytest.mark.parametrize("par", [dict(dp=4), dict(dp=8), dict(dp=4, tp=2, pp=2)],
                         ids=["dp4", "dp8", "dp4_tp2_pp2"])
def test_correct_zero1_verifies_by_classes(par):
    single, plan = pair(**par)
    found = find_symmetry(single, plan)
    assert isinstance(found, Symmetry), found
    v = verify(single, plan)
    assert v.success, v.message
    dp = par["dp"]
    assert v.symmetry.startswith(f"{dp} x 4 blocks (replica x microbatch) checked against the "
                                 f"representatives"), v.symmetry
    assert v.blocks == (dp * 4, 4, 0) and v.classes == 1
    assert "ZeRO-1 owned shards checked on every rank" in v.symmetry


@pytest.mark.parametrize("zero,par", [(2, dict(dp=4)), (3, dict(dp=8)), (2, dict(dp=8, tp=2)),
                                      (3, dict(dp=4, pp=2))],
                         ids=["zero2_dp4", "zero3_dp8", "zero2_dp8_tp2", "zero3_dp4_pp2"])
def test_correct_zero2_and_zero3_verify_by_classes(zero, par):
    """docs/soundness.md "ZeRO-2 and ZeRO-3: reduce-scattered shards"."""
    single, plan = plan_pair(replace(MLP, optimizer="adamw"), Parallelism(nm=4, **par),
                             2 * par["dp"] * 4, Policy(zero=zero))
    v = verify(single, plan)
    assert v.success, v.message
    dp = par["dp"]
    assert v.blocks == (dp * 4, 4, 0) and v.classes == 1, v.symmetry
    assert f"ZeRO-{zero} owned shards checked on every rank" in v.symmetry
    assert "reduce-scatters each keep the rank's own gradient chunk" in v.symmetry


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_optimizer_on_owned_shards_verifies_by_classes(optimizer):
    single, plan = plan_pair(replace(MLP, optimizer=optimizer), Parallelism(dp=4, nm=4), 32,
                             ZERO1)
    v = verify(single, plan)
    assert v.success, v.message
    assert v.blocks == (16, 4, 0) and "ZeRO-1 owned shards checked" in v.symmetry, v.symmetry


def test_one_replica_stepping_with_another_rate_fails_in_its_class():
    single, plan = plan_pair(replace(MLP, optimizer="adamw"), Parallelism(dp=4, nm=4), 32,
                             ZERO1)
    p = mutations.copy_plan(plan)
    hit = 0
    for i, n in enumerate(plan.nodes):
        if n.op == "adam_step" and replica(plan, n.rank) == 2:
            p.nodes[i] = n._replace(kwargs={**n.kwargs, "lr": 2 * n.kwargs["lr"]})
            hit += 1
    assert hit
    found = find_symmetry(single, p)
    assert isinstance(found, Symmetry) and found.classes[0].replicas == (2,)
    assert "FAILED in its own cut: replica 2" in wrong_and_fails(single, p)


def test_a_state_shard_of_another_replica_fails():
    """Replica 2 loads replica 1's exp_avg shard (its parameter shard is its own)."""
    single, plan = plan_pair(replace(MLP, optimizer="adamw"), Parallelism(dp=4, nm=2), 16,
                             ZERO1)
    p = mutations.copy_plan(plan)
    states = {(t.rank, t.tid): t.slices for t in plan.tensors
              if plan.logical[t.tid].name.endswith("exp_avg") and t.lver == 0}
    for i, t in enumerate(plan.tensors):
        if (t.rank, t.tid) in states and t.lver == 0 and replica(plan, t.rank) == 2:
            p.tensors[i] = t._replace(slices=states[(t.rank - 1, t.tid)])
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal) and "state shards" in found.why, found
    wrong_and_fails(single, p)


def test_an_updated_shard_missing_from_the_gather_fails():
    """Replica 0's gathers of updated shards read replica 1's in replica 2's slot."""
    single, plan = plan_pair(replace(MLP, optimizer="sgd"), Parallelism(dp=4, nm=2), 16, ZERO1)
    p = mutations.copy_plan(plan)
    hit = 0
    for i, n in enumerate(plan.nodes):
        if n.op == "all_gather" and replica(plan, n.rank) == 0 and \
                plan.tensors[n.inputs[0]].lver > 0:
            ins = list(n.inputs)
            ins[2] = ins[1]
            p.nodes[i] = n._replace(inputs=tuple(ins))
            hit += 1
    assert hit
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal) and "whole orbit" in found.why, found
    wrong_and_fails(single, p)


def owns(plan: Plan, d: int, j: int) -> Plan:
    """Replica d loads replica j's parameter shards (shard j owned twice,
    shard d by nobody)."""
    p = mutations.copy_plan(plan)
    written = {o for n in plan.nodes for o in n.outputs}
    source = {(t.rank, t.tid): t.slices for i, t in enumerate(plan.tensors)
              if i not in written and plan.logical[t.tid].kind == "param"}
    inner = int(plan.world.get("tp", 1)) * int(plan.world.get("cp", 1))
    for i, t in enumerate(plan.tensors):
        if i not in written and plan.logical[t.tid].kind == "param" and replica(plan, t.rank) == d:
            p.tensors[i] = t._replace(slices=source[(t.rank + inner * (j - d), t.tid)])
    return p


def test_two_replicas_owning_one_shard_fail():
    single, plan = pair(4)
    wrong = owns(plan, 2, 1)
    found = find_symmetry(single, wrong)
    assert isinstance(found, Refusal) and "owned twice or by nobody" in found.why
    assert "owned twice or by nobody" in wrong_and_fails(single, wrong)


def test_owned_shard_mutants_fail():
    single, plan = pair(4)
    for seed in range(4):
        made = mutations.owned_shard(plan, random.Random(seed))
        assert made is not None
        wrong_and_fails(single, made[0])


def keeps(plan: Plan, d: int, j: int) -> Plan:
    """Replica d's split keeps chunk j of the reduced gradient, claims moved."""
    p = mutations.copy_plan(plan)
    dp = int(plan.world["dp"])
    hit = 0
    for i, n in enumerate(plan.nodes):
        if n.op == "split" and n.mb < 0 and replica(plan, n.rank) == d and \
                n.kwargs.get("parts") == dp:
            p.nodes[i] = n._replace(kwargs={**n.kwargs, "index": j})
            out, whole = p.tensors[n.outputs[0]], p.tensors[n.inputs[0]]
            p.tensors[n.outputs[0]] = out._replace(
                slices=mutations._chunk(whole.slices, n.kwargs["dim"], dp, j))
            hit += 1
    assert hit
    return p


def test_a_replica_keeping_another_chunk_fails():
    single, plan = pair(4)
    wrong = keeps(plan, 3, 1)
    found = find_symmetry(single, wrong)
    assert isinstance(found, Refusal) and "does not keep chunk 3 of 4" in found.why
    wrong_and_fails(single, wrong)


def test_a_replica_missing_from_the_gather_fails():
    """Replica 1's gathers read replica 2's shard in replica 3's slot."""
    single, plan = pair(4)
    p = mutations.copy_plan(plan)
    hit = 0
    for i, n in enumerate(plan.nodes):
        if n.op == "all_gather" and n.mb < 0 and replica(plan, n.rank) == 1:
            ins = list(n.inputs)
            ins[3] = ins[2]
            p.nodes[i] = n._replace(inputs=tuple(ins))
            hit += 1
    assert hit
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal) and "whole orbit" in found.why
    wrong_and_fails(single, p)


def swapped(plan: Plan, d: int, m: int, op: str, kwargs: dict) -> Plan:
    """Every ``div`` node of microbatch m on the ranks of replica d made ``op``."""
    p = mutations.copy_plan(plan)
    hit = 0
    for i, n in enumerate(plan.nodes):
        if n.op == "div" and n.mb == m and replica(plan, n.rank) == d:
            p.nodes[i] = n._replace(op=op, kwargs=dict(kwargs))
            hit += 1
    assert hit
    return p


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_one_microbatch_of_one_replica_wrong_fails_in_its_class(zero):
    single, plan = pair(4, 4, Policy(zero=zero))
    wrong = swapped(plan, 2, 3, "mul_scalar", {"value": 32.0})
    found = find_symmetry(single, wrong)
    assert isinstance(found, Symmetry) and len(found.classes) >= 1
    text = wrong_and_fails(single, wrong)
    assert "FAILED in its own cut" in text and "microbatch 3" in text, text


@pytest.mark.parametrize("zero", [1, 2])
def test_one_microbatch_of_one_replica_equal_verifies_by_classes(zero):
    single, plan = pair(4, 4, Policy(zero=zero))
    equal = swapped(plan, 2, 3, "mul_scalar", {"value": 1 / 32})
    assert judge(single, equal).right
    v = verify(single, equal)
    assert v.success, v.message
    assert v.classes > 1 and "classes of blocks" in v.symmetry, v.symmetry
    assert f"ZeRO-{zero} owned shards checked" in v.symmetry or zero == 1, v.symmetry


def test_a_keep_of_another_parameters_sum_fails():
    """Replica 2 keeps its chunk of layers.1's reduced gradient as layers.0's
    (both 8 x 8): the cut alone would prove layers.0's sum right."""
    single, plan = pair(4)
    name = {t: lg.name for t, lg in enumerate(plan.logical)}
    sums = {(n.rank, name[plan.tensors[n.outputs[0]].tid]): n.outputs[0]
            for n in plan.nodes if n.op == "reducer"}
    p = mutations.copy_plan(plan)
    hit = 0
    for i, n in enumerate(plan.nodes):
        buf = name[plan.tensors[n.outputs[0]].tid]
        if n.op == "split" and replica(plan, n.rank) == 2 and buf.startswith("layers.0."):
            other = sums[(n.rank, buf.replace("layers.0.", "layers.1."))]
            p.nodes[i] = n._replace(inputs=(other,))
            hit += 1
    assert hit
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal) and "does not keep chunk 2 of 4" in found.why, found
    wrong_and_fails(single, p)


# ZeRO-2 and ZeRO-3: reduce-scatters inside microbatches, per-use gathers (ZeRO-3)

def zero_pair(zero: int) -> tuple[Plan, Plan]:
    return pair(4, 4, Policy(zero=zero))


def scatters_of(plan: Plan, d: int, mb: int | None = None) -> list[int]:
    return [i for i, n in enumerate(plan.nodes) if n.op == "reduce_scatter" and
            replica(plan, n.rank) == d and (mb is None or n.mb == mb)]


@pytest.mark.parametrize("zero", [2, 3])
def test_a_scatter_keeping_another_index_fails(zero):
    """Replica 3's reduce-scatters in microbatch 1 keep chunk 1 (claims moved)."""
    single, plan = zero_pair(zero)
    p = mutations.copy_plan(plan)
    for i in scatters_of(plan, 3, 1):
        n = plan.nodes[i]
        p.nodes[i] = n._replace(kwargs={**n.kwargs, "index": 1})
        out, whole = plan.tensors[n.outputs[0]], plan.tensors[n.inputs[0]]
        p.tensors[n.outputs[0]] = out._replace(
            slices=mutations._chunk(whole.slices, n.kwargs["dim"], 4, 1))
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal), found
    wrong_and_fails(single, p)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_replica_missing_from_a_scatter_group_fails(zero):
    """Replica 1's scatters in microbatch 2 read replica 2's value in replica 3's slot."""
    single, plan = zero_pair(zero)
    p = mutations.copy_plan(plan)
    for i in scatters_of(plan, 1, 2):
        ins = list(plan.nodes[i].inputs)
        ins[3] = ins[2]
        p.nodes[i] = plan.nodes[i]._replace(inputs=tuple(ins))
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal) and "whole orbit" in found.why, found
    wrong_and_fails(single, p)


def test_a_replica_missing_from_a_zero3_gather_fails():
    """Replica 2's per-use gathers of microbatch 3 read replica 0's shard in replica 1's slot."""
    single, plan = zero_pair(3)
    p = mutations.copy_plan(plan)
    hit = 0
    for i, n in enumerate(plan.nodes):
        if n.op == "all_gather" and n.mb == 3 and replica(plan, n.rank) == 2:
            ins = list(n.inputs)
            ins[1] = ins[0]
            p.nodes[i] = n._replace(inputs=tuple(ins))
            hit += 1
    assert hit
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal) and "whole orbit" in found.why, found
    wrong_and_fails(single, p)


@pytest.mark.parametrize("zero", [2, 3])
def test_two_replicas_owning_one_shard_fail_with_scatters(zero):
    single, plan = zero_pair(zero)
    wrong = owns(plan, 2, 1)
    found = find_symmetry(single, wrong)
    assert isinstance(found, Refusal) and "owned twice or by nobody" in found.why, found
    wrong_and_fails(single, wrong)


def accumulations(plan: Plan, d: int) -> dict[tuple[int, int, int], int]:
    """(rank, buffer tid, mb) -> the accumulation node, on replica d."""
    return {(n.rank, plan.tensors[n.outputs[0]].tid, n.mb): i for i, n in enumerate(plan.nodes)
            if n.op == "local_grad_accumulation" and replica(plan, n.rank) == d}


@pytest.mark.parametrize("zero", [2, 3])
def test_a_shard_chain_missing_a_microbatch_fails(zero):
    """Replica 1's accumulation of microbatch 2 adds to microbatch 0's buffer:
    microbatch 1's scattered shard is lost."""
    single, plan = zero_pair(zero)
    p = mutations.copy_plan(plan)
    accs = accumulations(plan, 1)
    for (rank, tid, mb), i in accs.items():
        if mb == 2:
            n = plan.nodes[i]
            p.nodes[i] = n._replace(inputs=(plan.nodes[accs[(rank, tid, 0)]].outputs[0],
                                            *n.inputs[1:]))
    wrong_and_fails(single, p)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_shard_chain_from_ones_fails(zero):
    """Replica 3's gradient buffers start from ones."""
    single, plan = zero_pair(zero)
    p = mutations.copy_plan(plan)
    hit = 0
    for i, n in enumerate(plan.nodes):
        if n.op == "zeros" and replica(plan, n.rank) == 3 and \
                plan.tensors[n.outputs[0]].tid in set(plan.grads.values()):
            p.nodes[i] = n._replace(op="ones")
            hit += 1
    assert hit
    wrong_and_fails(single, p)


def test_a_rule_broken_by_a_right_plan_verifies_in_full():
    """Replica 1's gradient buffers start from zeros times one: right, but no
    chain from a zeros buffer, so the plan is verified in full."""
    single, plan = zero_pair(2)
    p = mutations.copy_plan(plan)
    nodes = []
    for n in plan.nodes:
        nodes.append(n)
        if n.op == "zeros" and replica(plan, n.rank) == 1 and \
                plan.tensors[n.outputs[0]].tid in set(plan.grads.values()):
            old = n.outputs[0]
            p.tensors.append(plan.tensors[old]._replace(version=plan.tensors[old].version))
            new = len(p.tensors) - 1
            nodes[-1] = n._replace(outputs=(new,))
            nodes.append(n._replace(op="mul_scalar", inputs=(new,), outputs=(old,),
                                    kwargs={"value": 1.0}))
    p.nodes = nodes
    assert judge(single, p).right
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal), found
    v = verify(single, p)
    assert v.success and "verified in full" in v.symmetry, v.message


def test_a_row_summing_another_buffers_value_fails():
    """In microbatch 1 every replica's scatter of layers.0 reads replica 2's
    layers.1 gradient in position 2 (and the other way round), and replica 2
    accumulates each scatter into the other buffer: each replica's own value
    goes into its own chain, as the cut sees it, but the sums mix the two
    parameters."""
    single, plan = zero_pair(2)
    p = mutations.copy_plan(plan)
    name = {t: lg.name for t, lg in enumerate(plan.logical)}
    row: dict[tuple[int, str], int] = {}
    for i, n in enumerate(plan.nodes):
        if n.op == "reduce_scatter" and n.mb == 1:
            row[(replica(plan, n.rank), name[plan.tensors[n.outputs[0]].tid][:8])] = i
    for d in range(4):
        a, b = row[(d, "layers.0")], row[(d, "layers.1")]
        ia, ib = list(plan.nodes[a].inputs), list(plan.nodes[b].inputs)
        ia[2], ib[2] = ib[2], ia[2]
        p.nodes[a] = plan.nodes[a]._replace(inputs=tuple(ia))
        p.nodes[b] = plan.nodes[b]._replace(inputs=tuple(ib))
    out = {plan.nodes[row[(2, k)]].outputs[0]: k for k in ("layers.0", "layers.1")}
    swap = {o: plan.nodes[row[(2, "layers.1" if k == "layers.0" else "layers.0")]].outputs[0]
            for o, k in out.items()}
    for i, n in enumerate(plan.nodes):
        if n.op == "local_grad_accumulation" and n.inputs[1] in swap:
            p.nodes[i] = n._replace(inputs=(n.inputs[0], swap[n.inputs[1]]))
    found = find_symmetry(single, p)
    assert isinstance(found, Refusal) and "another gradient buffer" in found.why, found
    wrong_and_fails(single, p)
