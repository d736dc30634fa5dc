"""Parallel plans: the differential numeric check passes on correct plans and
fails, naming the right tensor, on plans with a parallelization bug."""

from __future__ import annotations

import pytest

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from verdict.differential import compare
from verdict.plan import Node, Plan

MLP = ModelConfig("mlp", layers=4, hidden=8)
LLAMA = ModelConfig("llama3", layers=4, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12,
                    seqlen=4)
MOE = ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12, seqlen=4,
                  experts=4, topk=2, moe_ffn=8, first_dense=1)
GBS = 16

CASES = [
    (MLP, Parallelism(dp=2)),
    (MLP, Parallelism(tp=4)),
    (MLP, Parallelism(pp=4, nm=4)),
    (MLP, Parallelism(dp=2, tp=2, pp=2, nm=2)),
    (LLAMA, Parallelism(dp=2)),
    (LLAMA, Parallelism(tp=2)),
    (LLAMA, Parallelism(pp=2, nm=2)),
    (LLAMA, Parallelism(dp=2, tp=2, pp=2, nm=2)),
    (LLAMA, Parallelism(dp=4, pp=4, nm=1)),
    (MOE, Parallelism(dp=2, ep=2)),
    (MOE, Parallelism(dp=2, tp=2, ep=2, nm=2)),
    (MOE, Parallelism(dp=4, ep=4)),
]


def single(cfg: ModelConfig) -> Plan:
    return make_plan(cfg, Parallelism(), GBS)


@pytest.mark.parametrize(("cfg", "par"), CASES, ids=lambda x: getattr(x, "model", None) or str(x))
def test_correct_plans_match(cfg, par):
    plan = make_plan(cfg, par, GBS)
    report = compare(single(cfg), plan)
    assert report.equal, [d.describe() for d in report.differences] + report.uncovered
    assert report.checked > 0
    assert max(n.rank for n in plan.nodes) == par.world_size - 1


@pytest.mark.parametrize("policy", [Policy(vocab_parallel=True), Policy(schedule="gpipe")])
def test_policies(policy):
    plan = make_plan(LLAMA, Parallelism(tp=2, pp=2, nm=2), GBS, policy=policy)
    assert compare(single(LLAMA), plan).equal


def test_megatron_collectives_present():
    plan = make_plan(LLAMA, Parallelism(dp=2, tp=2, pp=2, nm=2), GBS)
    ops = {n.op for n in plan.nodes}
    assert {"all_reduce", "send_recv", "reducer", "local_grad_accumulation"} <= ops
    moe = make_plan(MOE, Parallelism(dp=2, ep=2), GBS)
    assert "all_to_all" in {n.op for n in moe.nodes}


def test_1f1b_interleaves_forward_and_backward():
    plan = make_plan(MLP, Parallelism(pp=2, nm=4), GBS)
    first_stage = [(n.dir, n.mb) for n in plan.nodes if n.rank == 0 and n.dir in ("fw", "bw")]
    bw0 = first_stage.index(("bw", 0))
    assert any(d == "fw" and mb > 0 for d, mb in first_stage[bw0:])


def test_gradient_versions_chain_across_microbatches():
    plan = make_plan(MLP, Parallelism(dp=2, nm=2), GBS)
    buf = plan.grads[next(iter(plan.grads))]
    versions = sorted(t.version for t in plan.tensors if t.tid == buf and t.rank == 0)
    assert versions == [0, 1, 2, 3]  # zeros, mb 0, mb 1, reduced


@pytest.mark.parametrize(("par", "message"), [
    (Parallelism(dp=3), "gbs"),
    (Parallelism(tp=3), "divisible"),
    (Parallelism(pp=8), "layers"),
    (Parallelism(ep=2), "ep"),
])
def test_bad_parallelism(par, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(LLAMA, par, GBS)


# --- mutations: each must be caught, naming the right tensor -----------------

BASE = Parallelism(dp=2, tp=2, pp=2, nm=2)


def mutated(edit) -> tuple[Plan, Plan]:
    plan = make_plan(LLAMA, BASE, GBS)
    edit(plan)
    return single(LLAMA), plan


def replace(plan: Plan, index: int, **fields) -> None:
    plan.nodes[index] = plan.nodes[index]._replace(**fields)


def first(plan: Plan, pred) -> int:
    return next(i for i, n in enumerate(plan.nodes) if pred(n))


def assert_caught(s: Plan, p: Plan, name_part: str) -> None:
    report = compare(s, p)
    assert not report.equal
    found = [d.logical for d in report.differences] + report.uncovered
    assert any(name_part in x for x in found), found


def test_dropped_all_reduce_is_caught():
    def edit(plan):
        i = first(plan, lambda n: n.op == "all_reduce" and "wo" in n.name and n.dir == "fw")
        node = plan.nodes[i]
        own = next(t for t in node.inputs if plan.tensors[t].rank == node.rank)
        replace(plan, i, op="split", inputs=(own,), kwargs={"dim": 0, "parts": 1, "index": 0})
    assert_caught(*mutated(edit), "wo")


def test_scaled_tensor_on_one_rank_is_caught():
    def edit(plan):
        i = first(plan, lambda n: n.op == "div" and n.rank == 1)
        node = plan.nodes[i]
        replace(plan, i, kwargs={**node.kwargs, "value": node.kwargs["value"] * 2})
    assert_caught(*mutated(edit), "truediv")


def test_send_from_wrong_rank_is_caught():
    def edit(plan):
        i = first(plan, lambda n: n.op == "send_recv" and n.dir == "fw" and n.rank == 4)
        node = plan.nodes[i]
        other = next(j for j, t in enumerate(plan.tensors)
                     if t.rank == 2 and t.mb == node.mb
                     and t.tid == plan.tensors[node.inputs[0]].tid)
        replace(plan, i, inputs=(other,), kwargs={**node.kwargs, "src": 2})
    s, p = mutated(edit)
    assert not compare(s, p).equal


def test_stale_gradient_in_reducer_is_caught():
    def edit(plan):
        i = first(plan, lambda n: n.op == "reducer")
        node = plan.nodes[i]
        stale = []
        for t in node.inputs:
            tt = plan.tensors[t]
            older = [j for j, u in enumerate(plan.tensors)
                     if u.tid == tt.tid and u.rank == tt.rank and u.version == tt.version - 1]
            stale.append(older[0])
        replace(plan, i, inputs=tuple(stale))
    s, p = mutated(edit)
    report = compare(s, p)
    assert not report.equal
    assert report.uncovered or report.differences


def test_dropped_gradient_shard_is_caught():
    def edit(plan):
        buf = next(iter(plan.grads.values()))
        keep = [n for n in plan.nodes
                if not (n.op == "reducer" and plan.tensors[n.outputs[0]].tid == buf
                        and n.rank == 0)]
        plan.nodes[:] = keep
    s, p = mutated(edit)
    report = compare(s, p)
    assert any("rank 0 ends with a gradient" in u and "not the single-device" in u
               for u in report.uncovered)


def test_missing_node_output_is_reported_as_difference_not_crash():
    def edit(plan):
        i = first(plan, lambda n: n.op == "add_scalar" and n.rank == 0)
        node = plan.nodes[i]
        replace(plan, i, kwargs={"value": node.kwargs["value"] + 1.0})
    s, p = mutated(edit)
    assert_caught(s, p, "add")


def test_node_type_is_plain():
    plan = make_plan(MLP, Parallelism(dp=2), GBS)
    assert all(isinstance(n, Node) for n in plan.nodes)
