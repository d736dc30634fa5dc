"""Bug reproduction (harness.bugs, docs/bugs.md): every bug plan is a valid
plan file, and the verifier rejects each with the diagnosis its kind calls
for, pointing at the mutated operator and ranks. The correct plan passes.

Most checks use a 4-layer version of the base model (fast); a few use the
full 32-layer base plan of scripts/run_br.py."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

import main
from backends.planfile import load_plan, save_plan
from gen_model.__main__ import main as gen_main
from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.generate import make_plan
from harness import bugs
from main import verify
from verdict.engine import Verdict
from verdict.plan import Plan

BASE = Parallelism(dp=2, pp=2, tp=2, nm=2)
GBS = 32


def llama(layers: int) -> ModelConfig:
    # the sizes `python -m gen_model --model llama3 --heads 32 --hidden 128 --seqlen 8192` uses
    return ModelConfig("llama3", layers=layers, hidden=128, heads=32, kv_heads=8, ffn=448,
                       vocab=128256, seqlen=8192)


class Pair:
    """A single-device plan, its correct parallel plan, and verdicts (memoized)."""

    def __init__(self, layers: int):
        cfg = llama(layers)
        self.single = make_plan(cfg, Parallelism(), GBS)
        self.parallel = make_plan(cfg, BASE, GBS)
        self.memo: dict = {}
        self.plans: dict[int, Plan] = {}
        self.verdicts: dict[int, Verdict] = {}

    def plan(self, bug: int) -> Plan:
        if bug not in self.plans:
            self.plans[bug] = bugs.inject(self.parallel, bug)
        return self.plans[bug]

    def verdict(self, bug: int) -> Verdict:
        if bug not in self.verdicts:
            plan = self.parallel if bug == 0 else self.plan(bug)
            self.verdicts[bug] = verify(self.single, plan, memo=self.memo)
        return self.verdicts[bug]


@pytest.fixture(scope="module")
def small() -> Pair:
    return Pair(4)


@pytest.fixture(scope="module")
def full() -> Pair:
    return Pair(32)


def failing_node(pair: Pair, bug: int):
    """The single-device node of the failing stage."""
    verdict = pair.verdict(bug)
    assert verdict.kind == "stage", verdict.message
    return pair.single.nodes[verdict.failed[0].stage.gs_node]


def flagged(pair: Pair, bug: int) -> list:
    """The parallel tensors under a 🚨: groups whose value differs from Ts."""
    result = pair.verdict(bug).failed[0]
    problem, outcome = result.problem, result.outcome
    assert outcome.status == "counterexample"
    assert outcome.bad
    plan = pair.plan(bug)
    return [plan.tensors[problem.tp_global[m]]
            for c, g in outcome.bad for m in problem.claims[c].groups[g][1]]


def ranks(tensors) -> set[int]:
    return {t.rank for t in tensors}


# --- the correct plan ---------------------------------------------------------


def test_correct_plan_verifies(small):
    assert small.verdict(0).success


def test_reschedule_keeps_a_correct_plan_as_it_is(small):
    plan = bugs._copy(small.parallel)
    bugs._reschedule(plan)
    assert plan.nodes == small.parallel.nodes
    assert plan.tensors == small.parallel.tensors


def test_scatter_gather_form_is_equivalent(small):
    """Bug 4 starts from the all-reduce written as reduce-scatter + all-gather;
    that form alone is a correct plan."""
    plan = bugs._copy(small.parallel)
    gathers = bugs.scatter_gather(plan)
    assert len(gathers) == 8  # 4 ranks of stage 0 x 2 microbatches
    assert {plan.nodes[i].op for i in gathers} == {"all_gather"}
    assert verify(small.single, plan, memo=small.memo).success


# --- the bug plans are plain, valid plans ------------------------------------------


@pytest.mark.parametrize("bug", range(1, 15))
def test_bug_plan_is_a_valid_plan_file(small, bug, tmp_path):
    plan = small.plan(bug)
    pkl, _ = save_plan(plan, tmp_path / f"llama3_br{bug}.pkl")
    back = load_plan(pkl)
    assert back.nodes == plan.nodes and back.tensors == plan.tensors
    assert back.world["variant"] == small.parallel.world["variant"]  # the caller names it


@pytest.mark.parametrize("bug", range(1, 15))
def test_bug_plan_looks_like_a_correct_plan(small, bug):
    """Node names, ops and kwargs keys are those a parallelizer writes."""
    plan, base = small.plan(bug), small.parallel
    assert plan != base
    assert {n.name for n in plan.nodes} <= {n.name for n in base.nodes}
    keys = {n.op: set(n.kwargs) for n in base.nodes}
    keys.update(reduce_scatter={"dim", "index"}, all_gather={"dim", "index"})
    for n in plan.nodes:
        assert set(n.kwargs) == keys[n.op], n


def test_inject_leaves_its_input_alone(small):
    before = small.parallel.to_data()
    for bug in (2, 4, 14):
        bugs.inject(small.parallel, bug)
    assert small.parallel.to_data() == before


@pytest.mark.parametrize("bug", [0, 15, -1])
def test_unknown_bug_is_refused(small, bug):
    with pytest.raises(ValueError, match="no bug"):
        bugs.inject(small.parallel, bug)
    with pytest.raises(ConfigError):  # which python -m gen_model reports in one line
        bugs.inject(small.parallel, bug)


def test_bug_that_does_not_apply_is_refused(small):
    with pytest.raises(ValueError, match="parallel plan"):
        bugs.inject(small.single, 7)
    cfg = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12,
                      seqlen=4)
    dp_only = make_plan(cfg, Parallelism(dp=2), 8)
    for bug in (1, 2, 3, 4, 5, 6, 9, 10, 13, 14):  # need tp, pp or nm
        with pytest.raises(ValueError, match=f"bug {bug}"):
            bugs.inject(dp_only, bug)
    assert not verify(make_plan(cfg, Parallelism(), 8), bugs.inject(dp_only, 7)).success
    mlp = make_plan(ModelConfig("mlp", layers=2, hidden=8), Parallelism(tp=2), 8)
    with pytest.raises(ValueError, match="llama3"):
        bugs.inject(mlp, 1)


def test_cli_writes_bug_plans_and_refuses_bad_ones(tmp_path, capsys):
    tiny = ["--model", "llama3", "--layers", "2", "--heads", "4", "--kv_heads", "2", "--hidden", "16",
            "--seqlen", "4", "--vocab", "12", "--gbs", "8", "-o", str(tmp_path)]
    par = ["--dp", "2", "--pp", "2", "--tp", "2", "--nm", "2"]
    assert gen_main([*tiny, *par, "--variant", "br7"]) == 0
    plan = load_plan(tmp_path / "llama3_br7_dp2_pp2_tp2_nm2_gbs8_ly2_h4_hi16_sq4.pkl")
    assert plan.world["variant"] == "br7"
    assert gen_main([*tiny, *par, "--variant", "br15"]) == 2
    assert gen_main([*tiny, *par, "--model", "mlp", "--variant", "br1"]) == 2
    err = capsys.readouterr().err
    assert "no bug 15" in err and "made for llama3" in err
    assert not list(tmp_path.glob("*br15*")) and not list(tmp_path.glob("mlp*"))
    # a single-device plan has no parallelization to get wrong: br{N} only names it
    assert gen_main([*tiny, "--variant", "br7"]) == 0
    single = load_plan(tmp_path / "llama3_br7_dp1_pp1_tp1_nm1_gbs8_ly2_h4_hi16_sq4.pkl")
    assert single.nodes == make_plan(ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2,
                                                 ffn=56, vocab=12, seqlen=4),
                                     Parallelism(), 8).nodes


# --- what the verifier says --------------------------------------------------------


def test_bug1_missing_all_reduce_gives_a_counterexample(small):
    node = failing_node(small, 1)
    assert (node.op, node.dir, node.name) == ("linear", "fw", bugs.WO)
    bad = flagged(small, 1)
    # the outputs of the local copies claim the whole sum but hold a part
    assert {t.version for t in bad} == {1} and all(t.is_whole() for t in bad)
    assert ranks(bad) <= {0, 1, 2, 3}


def test_bug2_dropped_all_reduce_breaks_the_dataflow(small):
    verdict = small.verdict(2)
    assert verdict.kind == "unreachable"
    assert "which no node writes" in verdict.message and bugs.WO in verdict.message


def test_bug3_all_gather_for_all_reduce_is_a_shape_mismatch(small):
    verdict = small.verdict(3)
    assert verdict.kind == "shape"
    assert "Expect: [8, 8192, 128], Result: [8, 8192, 256]" in verdict.message
    assert "op='all_gather'" in verdict.message


def test_bug4_all_reduce_for_all_gather_is_a_shape_mismatch(small):
    verdict = small.verdict(4)
    assert verdict.kind == "shape"
    assert "Expect: [8, 8192, 128], Result: [8, 4096, 128]" in verdict.message
    assert "op='all_reduce'" in verdict.message and bugs.WO in verdict.message


def test_bug5_backward_reduce_missing_gives_a_counterexample(small):
    node = failing_node(small, 5)
    assert (node.op, node.dir) == ("multiref", "bw")
    bad = flagged(small, 5)
    norm_grad = next(i for i, t in enumerate(small.single.logical) if t.name == bugs.NORM_GRAD)
    assert {t.tid for t in bad} == {norm_grad}
    assert all(t.is_whole() and t.version == 1 for t in bad)  # the "reduced" copies


def test_bug6_send_from_the_wrong_replica_gives_a_counterexample(small):
    verdict = small.verdict(6)
    assert verdict.kind == "stage"
    bad = flagged(small, 6)
    assert {(t.rank, t.mb) for t in bad} == {(4, 0)}
    plan = small.plan(6)
    writer = next(n for n in plan.nodes if plan.tensors.index(bad[0]) in n.outputs)
    assert writer.op == "send_recv" and writer.kwargs["src"] == 2


def test_send_from_a_replica_of_the_same_rows_is_no_bug(small):
    """Not every wrong-looking source is a bug: the other TP rank of the
    sending replica holds the same rows, and the plan stays equivalent."""
    plan = bugs._copy(small.parallel)
    i = next(j for j, n in enumerate(plan.nodes) if n.op == "send_recv" and n.rank == 4)
    node = plan.nodes[i]
    sent = plan.tensors[node.inputs[0]]
    peer = next(k for k, t in enumerate(plan.tensors)
                if (t.rank, t.mb, t.tid, t.version) == (1, sent.mb, sent.tid, sent.version))
    plan.nodes[i] = node._replace(inputs=(peer,), kwargs={**node.kwargs, "src": 1})
    bugs._reschedule(plan)
    assert verify(small.single, plan, memo=small.memo).success


@pytest.mark.parametrize(("bug", "op", "mutated"), [
    (7, "add_scalar", {0}), (9, "add_scalar", {0, 1}),
    (8, "pow", {0}),
    (12, "div", {0}), (13, "div", {0, 1}),
])
def test_constant_mutants_are_flagged_on_the_mutated_ranks(small, bug, op, mutated):
    node = failing_node(small, bug)
    assert (node.op, node.dir) == (op, "fw")
    bad = flagged(small, bug)
    assert ranks(bad) <= mutated
    if bug in (7, 9):  # x + 1e-6 never equals x + 1e-5: every mutated tensor differs
        assert {(t.rank, t.mb) for t in bad} == {(r, m) for r in mutated for m in (0, 1)}
    else:
        assert ranks(bad) == mutated


def test_bug10_stale_gradient_in_multiref_backward(small):
    node = failing_node(small, 10)
    assert (node.op, node.dir, node.name) == ("multiref", "bw", bugs.RESIDUAL_MULTIREF)
    assert {(t.rank, t.mb) for t in flagged(small, 10)} == {(0, 1)}


def test_bug11_swapped_rotary_gradients_is_a_shape_mismatch(small):
    """q and k have different head counts (grouped KV), so the swap shows in
    the shapes before any value is compared."""
    verdict = small.verdict(11)
    assert verdict.kind == "shape"
    assert "op='apply_rotary_emb', dir='bw'" in verdict.message
    assert "rank=0" in verdict.message


def test_bug11_without_grouped_kv_heads_confuses_dims():
    """With as many KV heads as query heads, q and k have one shape: the swap
    still fits every shape, but the node ties the gradient of q to the dims
    of k's, which the single-device node never does (shape reduction
    refuses to prove it, see docs/soundness.md)."""
    cfg = ModelConfig("llama3", layers=2, hidden=64, heads=8, kv_heads=8, ffn=96, vocab=64,
                      seqlen=16)
    single, plan = make_plan(cfg, Parallelism(), GBS), bugs.inject(make_plan(cfg, BASE, GBS), 11)
    verdict = verify(single, plan)
    assert not verdict.success and verdict.kind == "dims"
    assert "op='apply_rotary_emb', dir='bw'" in verdict.message and "rank=0" in verdict.message


def test_bug14_early_reducer_is_caught_at_the_accumulation_stage(small):
    node = failing_node(small, 14)
    assert node.op == "local_grad_accumulation"
    bad = flagged(small, 14)
    plan = small.plan(14)
    reducers = {o for n in plan.nodes if n.op == "reducer" for o in n.outputs}
    assert {plan.tensors.index(t) for t in bad} <= reducers
    assert {t.mb for t in bad} == {-1}


# --- the full 32-layer base, as scripts/run_br.py runs it ----------------------------


def test_full_base_plan_verifies(full):
    verdict = full.verdict(0)
    assert verdict.success, verdict.message
    # one stage per single-device node, and one input stage: the labels' vocabulary
    # range, which each tensor-parallel rank cuts from the one-hot labels
    inputs = [s for s in verdict.stages if s.gs_node < 0]
    assert len(verdict.stages) == len(full.single.nodes) + len(inputs)
    assert {full.single.logical[full.single.tensors[verdict.lineages[s.outputs[0]].ts].tid].name
            for s in inputs} == {"labels"}


@pytest.mark.parametrize(("bug", "kind"), [(2, "unreachable"), (7, "stage"), (14, "stage")])
def test_full_base_bugs(full, bug, kind):
    verdict = full.verdict(bug)
    assert verdict.kind == kind, verdict.message
    if bug == 7:
        assert ranks(flagged(full, 7)) == {0}


def test_main_exits_1_with_the_counterexample(full, tmp_path, capsys):
    sm, _ = save_plan(full.single, tmp_path / "llama3_default_single.pkl")
    pm, _ = save_plan(full.plan(9), tmp_path / "llama3_br9.pkl")
    code = main.main(["--sm", str(sm), "--pm", str(pm), "--max_vrf_proc", "2",
                      "--no_cache_stages", "--no_cache_nodes", "--stats_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "❌ Stage 5 not equivalent: 🚨 the solver found inputs on which the plans differ" in out
    assert "op='add_scalar', dir='fw', name='layers.0.attention_norm.add'" in out
    assert out.count("🚨 ⬆️") == 4 and "❌ FAIL" in out
    summary = runpy.run_path(str(Path(__file__).parent.parent / "scripts" / "run_br.py"),
                             run_name="run_br")["summary"]
    assert "| Gs node: add_scalar, fw, layers.0.attention_norm.add | 🚨 under r" in summary(out)
