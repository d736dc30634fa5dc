"""The symbolic verifier: correct plans are proved, wrong plans fail at the
right node, and the soundness rules of docs/soundness.md hold."""

from __future__ import annotations

import pytest

from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from main import verify
from verdict.plan import Node, Plan
from verdict.report import failure

MLP = ModelConfig("mlp", layers=4, hidden=8)
LLAMA = ModelConfig("llama3", layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64,
                    seqlen=8)
MOE = ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12, seqlen=4,
                  experts=4, topk=2, moe_ffn=8, first_dense=1)
GBS = 16
BASE = Parallelism(dp=2, tp=2, pp=2, nm=2)

_SINGLE: dict[str, Plan] = {}


def single(cfg: ModelConfig) -> Plan:
    if cfg.model not in _SINGLE:
        _SINGLE[cfg.model] = make_plan(cfg, Parallelism(), GBS)
    return _SINGLE[cfg.model]


@pytest.mark.parametrize(("cfg", "par", "policy"), [
    (MLP, Parallelism(), Policy()),
    (MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), Policy()),
    (MLP, Parallelism(tp=4, pp=4, nm=4), Policy(schedule="gpipe")),
    (LLAMA, Parallelism(), Policy()),
    (LLAMA, Parallelism(dp=2), Policy()),
    (LLAMA, Parallelism(tp=2), Policy(vocab_parallel=True)),
    (LLAMA, Parallelism(pp=2, nm=4), Policy()),
    (LLAMA, BASE, Policy()),
    (MOE, Parallelism(dp=2, ep=2), Policy()),
    (MOE, Parallelism(dp=4, tp=2, ep=2, nm=2), Policy()),
], ids=str)
def test_correct_plans_are_proved(cfg, par, policy):
    plan = make_plan(cfg, par, GBS, policy=policy)
    v = verify(single(cfg), plan)
    assert v.success, failure(v, single(cfg), plan)[:3]
    assert len(v.results) == len(v.stages) > 0
    assert not v.coverage


def test_workers_and_memo_agree():
    plan = make_plan(LLAMA, BASE, GBS)
    one = verify(single(LLAMA), plan, workers=1)
    two = verify(single(LLAMA), plan, workers=2)
    assert one.success and two.success
    assert one.unique == two.unique < len(one.stages)
    assert one.memo_hits > 0
    memo: dict = {}
    first = verify(single(LLAMA), plan, memo=memo)
    again = verify(single(LLAMA), plan, memo=memo)
    assert first.success and again.success
    assert again.memo_hits == len(again.results)


# --- wrong plans -------------------------------------------------------------


def mutated(edit, cfg=LLAMA, par=BASE) -> Plan:
    plan = make_plan(cfg, par, GBS)
    edit(plan)
    return plan


def first(plan: Plan, pred) -> int:
    return next(i for i, n in enumerate(plan.nodes) if pred(n))


def replace(plan: Plan, i: int, **fields) -> None:
    plan.nodes[i] = plan.nodes[i]._replace(**fields)


def failing_gs_op(v) -> str:
    return single(LLAMA).nodes[v.failed[0].stage.gs_node].op


def scale_div(plan):
    i = first(plan, lambda n: n.op == "div" and n.rank == 1)
    replace(plan, i, kwargs={**plan.nodes[i].kwargs, "value": plan.nodes[i].kwargs["value"] * 2})


def drop_all_reduce(plan):
    i = first(plan, lambda n: n.op == "all_reduce" and ".wo" in n.name and n.dir == "fw")
    n = plan.nodes[i]
    own = next(t for t in n.inputs if plan.tensors[t].rank == n.rank)
    replace(plan, i, op="split", inputs=(own,), kwargs={"dim": 0, "parts": 1, "index": 0})


def eps_on_rank0(plan):
    i = first(plan, lambda n: n.op == "add_scalar" and n.rank == 0)
    replace(plan, i, kwargs={"value": plan.nodes[i].kwargs["value"] + 1.0})


def pow_one(plan):
    i = first(plan, lambda n: n.op == "pow" and n.rank == 0)
    replace(plan, i, kwargs={"exponent": 1})


def stale_reducer(plan):
    i = first(plan, lambda n: n.op == "reducer")
    stale = []
    for t in plan.nodes[i].inputs:
        tt = plan.tensors[t]
        stale.append(next(j for j, u in enumerate(plan.tensors)
                          if u.tid == tt.tid and u.rank == tt.rank and u.version == tt.version - 1))
    replace(plan, i, inputs=tuple(stale))


def send_from_other_replica(plan):
    i = first(plan, lambda n: n.op == "send_recv" and n.dir == "fw" and n.rank == 4)
    n = plan.nodes[i]
    other = next(j for j, t in enumerate(plan.tensors)
                 if t.rank == 2 and t.mb == n.mb and t.tid == plan.tensors[n.inputs[0]].tid)
    replace(plan, i, inputs=(other,), kwargs={**n.kwargs, "src": 2})


@pytest.mark.parametrize(("edit", "op"), [
    (scale_div, "div"),
    (drop_all_reduce, "linear"),
    (eps_on_rank0, "add_scalar"),
    (pow_one, "pow"),
    (stale_reducer, "local_grad_accumulation"),
    (send_from_other_replica, "add"),
], ids=lambda x: getattr(x, "__name__", x))
def test_wrong_plan_fails_at_the_right_node(edit, op):
    plan = mutated(edit)
    v = verify(single(LLAMA), plan)
    assert not v.success and v.kind == "stage"
    assert v.failed[0].outcome.status == "counterexample"
    assert failing_gs_op(v) == op
    text = "\n".join(failure(v, single(LLAMA), plan))
    assert "🚨" in text and "differ (sat)" in text


def test_counterexample_flags_only_the_mutated_rank():
    plan = mutated(eps_on_rank0)
    v = verify(single(LLAMA), plan)
    r = v.failed[0]
    flagged = {plan.tensors[r.problem.tp_global[m]].rank
               for c, g in r.outcome.bad for m in r.problem.claims[c].groups[g][1]}
    assert flagged == {0}


def test_swapped_rotary_gradients_are_a_shape_mismatch():
    def edit(plan):
        i = first(plan, lambda n: n.op == "apply_rotary_emb" and n.dir == "bw" and n.rank == 2)
        out = list(plan.nodes[i].outputs)
        out[0], out[1] = out[1], out[0]
        replace(plan, i, outputs=tuple(out))
    v = verify(single(LLAMA), mutated(edit))
    assert not v.success and v.kind == "shape" and "apply_rotary_emb" in v.message


def test_all_reduce_replaced_by_all_gather_is_a_shape_mismatch():
    def edit(plan):
        i = first(plan, lambda n: n.op == "all_reduce" and n.dir == "bw")
        replace(plan, i, op="all_gather", kwargs={"index": plan.nodes[i].kwargs["index"], "dim": 0})
    v = verify(single(LLAMA), mutated(edit))
    assert not v.success and v.kind == "shape" and "Expect" in v.message


def test_keep_going_reports_every_failing_stage():
    def edit(plan):
        scale_div(plan)
        pow_one(plan)
    plan = mutated(edit)
    stop = verify(single(LLAMA), plan)
    going = verify(single(LLAMA), plan, keep_going=True)
    assert len(going.failed) >= 2 > len(stop.failed) - 0
    assert {single(LLAMA).nodes[r.stage.gs_node].op for r in going.failed} >= {"div", "pow"}


def test_harmless_reordering_is_proved():
    """Swapping the gradients a multiref backward sums changes nothing."""
    def edit(plan):
        i = first(plan, lambda n: n.op == "multiref" and n.dir == "bw" and n.rank == 2)
        ins = list(plan.nodes[i].inputs)
        k = len(plan.nodes[i].outputs)
        ins[k], ins[k + 1] = ins[k + 1], ins[k]
        replace(plan, i, inputs=tuple(ins))
    assert verify(single(LLAMA), mutated(edit)).success


# --- soundness rules ----------------------------------------------------------


def test_rule1_only_inputs_are_assumed():
    """A Tp that claims to be an activation but that nothing computes is not
    assumed: the stage needing it is unreachable."""
    def edit(plan):
        i = first(plan, lambda n: n.op == "all_reduce" and ".wo" in n.name and n.dir == "fw")
        del plan.nodes[i]
    v = verify(single(LLAMA), mutated(edit))
    assert not v.success and v.kind == "unreachable"
    assert "no node writes" in v.message


def test_rule2_stage_inputs_must_be_verified_before():
    """With 1F1B, microbatch 0's backward runs before microbatch 1's forward.
    A forward node of microbatch 1 that reads microbatch 0's gradient reads a
    lineage not verified before its stage: the stage is unreachable."""
    def edit(plan):
        i = first(plan, lambda n: n.op == "linear" and n.dir == "fw" and n.mb == 1
                  and n.name == "layers.1")
        grad = next(j for j, t in enumerate(plan.tensors) if t.mb == 0
                    and plan.logical[t.tid].name == "layers.0.grad")
        assert grad in {o for n in plan.nodes[:i] for o in n.outputs}
        replace(plan, i, inputs=(grad, plan.nodes[i].inputs[1]))
    plan = mutated(edit, cfg=MLP, par=Parallelism(nm=2))
    v = verify(make_plan(MLP, Parallelism(), GBS), plan)
    assert not v.success and v.kind == "unreachable"
    assert "not verified before" in v.message


def drop_tensors(plan: Plan, dead: set[int]) -> None:
    """Remove tensors and every node writing them, renumbering the rest."""
    plan.nodes[:] = [n for n in plan.nodes if not set(n.outputs) & dead]
    keep = [i for i in range(len(plan.tensors)) if i not in dead]
    index = {old: new for new, old in enumerate(keep)}
    plan.tensors[:] = [plan.tensors[i] for i in keep]
    plan.nodes[:] = [n._replace(inputs=tuple(index.get(i, -1) for i in n.inputs),
                                outputs=tuple(index.get(o, -1) for o in n.outputs))
                     for n in plan.nodes]


def test_rule3_gradient_left_unreduced_on_a_rank_fails_coverage():
    def edit(plan):
        buf = next(iter(plan.grads.values()))
        dead = {o for n in plan.nodes if n.op == "reducer" and n.rank == 0
                for o in n.outputs if plan.tensors[o].tid == buf}
        drop_tensors(plan, dead)
    v = verify(single(LLAMA), mutated(edit))
    assert not v.success and v.kind == "coverage"
    assert "rank 0 holds shard" in v.message and "not the fully accumulated" in v.message


def test_rule3_gradient_slice_never_produced_fails_coverage():
    def edit(plan):
        buf = next(iter(plan.grads.values()))
        drop_tensors(plan, {i for i, t in enumerate(plan.tensors)
                            if t.tid == buf and t.rank == 1})
    v = verify(make_plan(MLP, Parallelism(), GBS), mutated(edit, MLP, Parallelism(tp=2)))
    assert not v.success and v.kind == "coverage"
    assert "rank 1 holds shard" in v.message and "no gradient" in v.message


def test_unwritten_gradient_is_unreachable():
    def edit(plan):
        buf = next(iter(plan.grads.values()))
        plan.nodes[:] = [n for n in plan.nodes if not (
            n.op == "reducer" and plan.tensors[n.outputs[0]].tid == buf and n.rank == 0)]
    v = verify(single(LLAMA), mutated(edit))
    assert not v.success and v.kind == "unreachable"


def test_not_every_stage_is_cheap_and_solver_finds_counterexamples():
    v = verify(single(LLAMA), mutated(scale_div))
    assert v.failed[0].outcome.solver
    values = v.failed[0].outcome.ts_values
    assert values and all(a.size > 0 for a in values.values())


def test_partial_input_is_refused_not_assumed():
    """Inputs are loaded whole: a parameter piece that claims to be a partial
    sum would let a plan add two copies of the same weight and still 'prove'."""
    def edit(plan):
        i = next(i for i, t in enumerate(plan.tensors)
                 if plan.logical[t.tid].kind == "param" and t.rank == 0)
        plan.tensors[i] = plan.tensors[i]._replace(parts=(0, 1, 2))
    v = verify(single(LLAMA), mutated(edit))
    assert not v.success and v.kind == "lineage" and "loaded whole" in v.message


def test_rule3_last_write_in_execution_order_counts_not_the_version_number():
    """A copy of the unreduced buffer written after the reducer, with a lower
    version number, is what the rank holds at the end: the gradient is
    incomplete, whatever the version numbers say."""
    def edit(plan):
        buf = next(iter(plan.grads.values()))
        red = first(plan, lambda n: n.op == "reducer" and n.rank == 0
                    and plan.tensors[n.outputs[0]].tid == buf)
        acc = max(i for i, n in enumerate(plan.nodes) if n.op == "local_grad_accumulation"
                  and n.rank == 0 and plan.tensors[n.outputs[0]].tid == buf)
        partial = plan.nodes[acc].outputs[0]
        plan.tensors.append(plan.tensors[partial]._replace(version=0))
        copy = Node(0, plan.tensors[partial].mb, "split", "none", (partial,),
                    (len(plan.tensors) - 1,), {"dim": 0, "parts": 1, "index": 0}, "copy")
        plan.nodes.insert(red + 1, copy)
    v = verify(single(LLAMA), mutated(edit))
    assert not v.success and v.kind == "coverage"
    assert "rank 0 holds shard" in v.message and "not the fully accumulated" in v.message


def test_replicas_of_a_partial_part_are_one_value():
    """TP replicas holding the same partial part (a replicated weight's
    gradient, one microbatch's share) form a 'same' set; covers use one of
    them, and a stage proves the others equal to it."""
    from verdict.lineage import infer_lineages

    plan = make_plan(LLAMA, Parallelism(dp=2, tp=2, nm=2), GBS)
    lineages, _, _ = infer_lineages(single(LLAMA), plan)
    buf = plan.grads[next(p for p, _ in plan.grads.items()
                          if plan.logical[p].name.endswith("attention_norm.weight"))]
    lin = next(x for x in lineages if single(LLAMA).tensors[x.ts].tid == buf
               and single(LLAMA).tensors[x.ts].version == 1)
    assert lin.same and all(len(s) == 2 for s in lin.same)
    ranks = [{plan.tensors[t].rank for t in s} for s in lin.same]
    assert {0, 1} in ranks and {2, 3} in ranks
    reps = {s[0] for s in lin.same}
    assert all(m in reps or plan.tensors[m].is_whole() for _, g in lin.groups for m in g)
