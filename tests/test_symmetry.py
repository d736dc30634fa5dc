"""Materialized plans: blocks found and checked, representatives proved
(verdict/symmetry/find.py, verdict/symmetry/blocks.py; docs/soundness.md "Materialized plans")."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from backends.planfile import save_plan
from gen_model.config import ModelConfig, Parallelism
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge
from main import verify
from tests.helpers import MLP, plan_pair
from verdict.columns import Columns
from verdict.lineage import StructureError
from verdict.plan import Plan
from verdict.symmetry.blocks import BlockCheck
from verdict.symmetry.find import Symmetry, find_symmetry
from verdict.symmetry.fold import Fold
from verdict.symmetry.uniform import Uniformity

ROOT = Path(__file__).resolve().parent.parent
GBS = 32
MESH = Parallelism(dp=4, tp=2, pp=2, nm=4)


def pair(par: Parallelism = MESH, policy: Policy = Policy(), cfg: ModelConfig = MLP  # noqa: B008
         ) -> tuple[Plan, Plan]:
    return plan_pair(cfg, par, GBS, policy)


def node_of(plan: Plan, replica: int, mb: int, op: str) -> int:
    """The first node of ``op`` on a rank of ``replica`` (tp 2 inner) in ``mb``."""
    inner = int(plan.world.get("tp", 1)) * int(plan.world.get("cp", 1))
    dp = int(plan.world["dp"])
    return next(i for i, n in enumerate(plan.nodes)
                if n.op == op and n.mb == mb and (n.rank // inner) % dp == replica)


def test_uniform_plan_is_proved_by_its_representatives():
    single, plan = pair()
    found = find_symmetry(single, plan)
    assert isinstance(found, Symmetry)
    w = found.folded.world
    assert (w["dp"], w["nm"], w["fold_dp"], w["fold_nm"]) == (2, 2, 4, 4)
    v = verify(single, plan)
    assert v.success, v.message
    assert v.blocks == (16, 4, 0) and "checked" in v.symmetry and not v.fold


def test_replica_reading_another_replicas_rows_fails():
    """Issue 20's hole: replica 3 of an mlp dp4 run reads replica 2's rows."""
    single, plan = pair(Parallelism(dp=4))
    bad = mutations.copy_plan(plan)
    written = {o for n in plan.nodes for o in n.outputs}
    rows = {t.tid: t.slices for i, t in enumerate(plan.tensors)
            if t.rank == 2 and i not in written and plan.logical[t.tid].kind in ("data", "tokens")}
    for i, t in enumerate(bad.tensors):
        if t.rank == 3 and t.tid in rows and i not in written:
            bad.tensors[i] = t._replace(slices=rows[t.tid])
    assert not judge(single, bad).right
    v = verify(single, bad)
    assert not v.success and v.kind == "layout"


def test_one_replica_that_differs_fails_and_is_named():
    single, plan = pair()
    bad = mutations.copy_plan(plan)
    i = node_of(plan, 3, 2, "div")
    n = bad.nodes[i]
    bad.nodes[i] = n._replace(kwargs={**n.kwargs, "value": n.kwargs["value"] * 2})
    found = find_symmetry(single, bad)
    assert isinstance(found, Symmetry)  # a class of blocks: replica 3 x microbatch 2
    assert ((3,), (2,)) in [(c.replicas, c.microbatches) for c in found.classes]
    assert not judge(single, bad).right
    v = verify(single, bad)
    assert not v.success
    assert "FAILED in its own cut: replica 3 x microbatch 2 runs another program (replica 3, " \
        f"microbatch 2: node {i} " in v.symmetry


def test_block_that_differs_but_is_right_is_no_false_alarm():
    """A rewrite on one rank makes its blocks differ; the plan is verified
    in full and proves."""
    single, plan = pair()
    for name in ("insert_identity", "rename"):
        made = mutations.REWRITES[name](plan, random.Random(f"sym/{name}"))
        assert made is not None
        v = verify(single, made[0])
        assert v.success, (name, made[1], v.message)
        if name == "insert_identity":
            assert "classes of blocks" in v.symmetry or "the blocks differ" in v.symmetry


@pytest.mark.parametrize("operator", ["change_constant_everywhere", "last_microbatch",
                                      "replica_group", "other_rows"])
def test_wrong_plans_fail(operator):
    single, plan = pair()
    for k in range(2):
        made = mutations.MUTATIONS.get(operator, mutations.MATERIALIZED_MUTATIONS.get(operator))(
            plan, random.Random(f"sym/{operator}/{k}"))
        assert made is not None
        mutant, where = made
        if judge(single, mutant).right:
            continue
        assert not verify(single, mutant).success, where


def test_uniform_bug_fails_in_the_representatives():
    single, plan = pair()
    mutant, _ = mutations.change_constant_everywhere(plan, random.Random(3))
    v = verify(single, mutant)
    assert not v.success
    if v.pair is not None:  # failed by the representatives' proof
        assert v.blocks[0] == 16


def test_interleaved_schedule_is_covered():
    single, plan = pair(Parallelism(dp=4, pp=2, nm=4), Policy(virtual_stages=2),
                        ModelConfig("mlp", layers=4, hidden=8))
    v = verify(single, plan)
    assert v.success and v.blocks[0] == 16


def test_zero1_and_zero3_are_proved_by_symmetry():
    """Owned shards, ZeRO-3's reduce-scatters and per-use gathers are checked
    on the whole plan (verdict/symmetry/owned.py)."""
    for zero in (1, 3):
        single, plan = pair(Parallelism(dp=4, nm=2), Policy(zero=zero))
        assert isinstance(find_symmetry(single, plan), Symmetry)
        v = verify(single, plan)
        assert v.success and v.blocks == (8, 4, 0), v.symmetry


def test_block_check_agrees_with_the_fold_uniformity():
    """The array check and verdict/symmetry/uniform.py's rules (shown = real) accept
    and reject the same plans."""
    single, plan = pair()
    w = plan.world
    whole = Fold(w["dp"], w["nm"], w["gbs"], w["dp"], w["nm"], w["gbs"])

    def accepts(cls, p: Plan) -> bool:
        try:
            cls(single, Columns.from_plan(p) if cls is BlockCheck else p, whole).run()
            return True
        except StructureError:
            return False

    assert accepts(BlockCheck, plan) and accepts(Uniformity, plan)
    for name in ("wrong_group", "other_microbatch", "drop_accumulation", "early_reducer",
                 "wrong_reducer_group", "stale_version", "wrong_peer", "reorder"):
        operator = mutations.MUTATIONS.get(name) or mutations.REWRITES[name]
        for k in range(2):
            made = operator(plan, random.Random(f"agree/{name}/{k}"))
            if made is None:
                break
            assert accepts(BlockCheck, made[0]) == accepts(Uniformity, made[0]), (name, made[1])


@pytest.mark.parametrize("suffix", [".pkl", ".npz"])
def test_cli_reports_checked_blocks(tmp_path, suffix):
    """A columnar file is checked on its columns (no Node per node)."""
    single, plan = pair()
    s = save_plan(single, tmp_path / "s.pkl")[0]
    p = save_plan(plan, tmp_path / f"p{suffix}")[0]
    run = subprocess.run([sys.executable, "main.py", "--sm", str(s), "--pm", str(p),
                          "--stats_dir", str(tmp_path), "--no_cache_nodes", "--no_cache_stages"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "symmetry: 4 x 4 blocks" in run.stdout
    assert "blocks='16 checked in 1 class of blocks, 4 proved, 0 assumed'" in run.stdout


def test_cut_holds_only_the_shown_replicas_tensors():
    """The reducers over the orbit read every replica's gradient; the cut
    makes objects of the shown replicas' only (its size does not grow with
    dp), from a Plan and from its columns alike."""
    sizes = []
    for dp in (4, 8):
        single, plan = pair(Parallelism(dp=dp, tp=2, nm=2))
        folded = [find_symmetry(single, p).folded for p in (plan, Columns.from_plan(plan))]
        assert folded[0].tensors == folded[1].tensors and folded[0].nodes == folded[1].nodes
        assert {t.rank for t in folded[0].tensors} == set(range(4))  # 2 replicas x tp 2
        sizes.append(len(folded[0].tensors))
    assert sizes[0] == sizes[1]


def test_columns_with_a_wrong_replica_fail(tmp_path):
    single, plan = pair(Parallelism(dp=4))
    bad = mutations.other_rows(plan, random.Random(1))[0]
    cols = Columns.from_plan(bad)
    v = verify(single, cols)
    assert not v.success and v.kind == "layout" and v.pair is None  # no Node made


def test_chain_end_read_by_no_step_node():
    """Without reducers (dp 1) nothing outside microbatches reads the chains'
    ends; the representatives keep their own chains."""
    single, plan = plan_pair(ModelConfig("llama3", layers=2, hidden=32, heads=4, kv_heads=2,
                                         ffn=48, vocab=64, seqlen=8), Parallelism(pp=2, nm=4), 8)
    v = verify(single, plan)
    assert v.success, v.message
    assert v.blocks == (4, 2, 0)


@pytest.mark.parametrize(("par", "policy"), [
    (Parallelism(cp=2, dp=4, nm=4), Policy()),
    (Parallelism(dp=4, tp=2, nm=4), Policy(sequence_parallel=True)),
    (Parallelism(cp=2, dp=4, nm=4), Policy(cp_balance=True)),
], ids=str)
def test_context_and_sequence_parallel_plans_are_folded(par, policy):
    """Partial sums over blocks numbered with the context or tensor index
    between replica and microbatch are moved to the shown blocks."""
    llama = ModelConfig("llama3", layers=1, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                        seqlen=4)
    single, plan = plan_pair(llama, par, GBS, policy)
    v = verify(single, plan)
    assert v.success, v.message
    assert v.blocks == (16, 4, 0)
