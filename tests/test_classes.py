"""Replica classes of materialized plans (verdict/symmetry/classes.py; docs/soundness.md
"When the blocks differ: classes")."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from backends.columnar import load_columns_file
from backends.planfile import save_plan
from gen_model.config import ModelConfig, Parallelism
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge
from main import verify
from tests.helpers import MLP, plan_pair
from verdict.plan import Plan
from verdict.symmetry.find import Refusal, Symmetry, find_symmetry

GBS = 32
ROOT = Path(__file__).resolve().parent.parent


def rewritten(plan: Plan, replicas: set[int], op: str, kwargs: dict) -> Plan:
    """Every ``div`` node (forward and backward, every microbatch) of the
    ranks of ``replicas`` made ``op`` with ``kwargs``."""
    inner = int(plan.world.get("tp", 1)) * int(plan.world.get("cp", 1))
    dp = int(plan.world["dp"])
    p = mutations.copy_plan(plan)
    hits = 0
    for i, n in enumerate(p.nodes):
        if n.op == "div" and (n.rank // inner) % dp in replicas:
            p.nodes[i] = n._replace(op=op, kwargs=dict(kwargs))
            hits += 1
    assert hits
    return p


def test_equal_program_on_one_replica_is_its_own_class():
    single, plan = plan_pair(MLP, Parallelism(dp=4, tp=2, pp=2, nm=4), GBS)
    equal = rewritten(plan, {2}, "mul_scalar", {"value": 1 / 32})
    assert judge(single, equal).right
    found = find_symmetry(single, equal)
    assert isinstance(found, Symmetry) and len(found.classes) == 1
    assert found.classes[0].replicas == (2,)
    v = verify(single, equal)
    assert v.success, v.message
    assert "2 classes of blocks" in v.symmetry
    assert "replica 2 x microbatches 0, 1, 2, 3 run another program" in v.symmetry
    assert v.blocks == (16, 8, 0)


def test_wrong_program_on_one_replica_fails_in_its_class():
    single, plan = plan_pair(MLP, Parallelism(dp=4, tp=2, pp=2, nm=4), GBS)
    wrong = rewritten(plan, {3}, "mul_scalar", {"value": 32.0})
    assert not judge(single, wrong).right
    v = verify(single, wrong)
    assert not v.success and v.kind == "stage", v.message
    assert ("FAILED in its own cut: replica 3 x microbatches 0, 1, 2, 3 run another program "
            "(replica 3, microbatch") in v.symmetry
    assert "another operator" in v.symmetry and v.pair is not None


def test_odd_replica_zero_is_the_class_proved_against_the_others():
    """Replica 0 differs: the base class is the larger one, replicas 1-3."""
    single, plan = plan_pair(MLP, Parallelism(dp=4, nm=2), GBS)
    wrong = rewritten(plan, {0}, "div", {"value": 16.0})
    assert not judge(single, wrong).right
    found = find_symmetry(single, wrong)
    assert isinstance(found, Symmetry) and found.base == (1, 2)
    assert found.classes[0].replicas == (0,)
    assert not verify(single, wrong).success


def test_classes_that_cancel_each_other_fail():
    """Two classes whose losses cancel in a cut of one replica of each
    (1/24 + 1/48 = 2/32): the base class is proved alone first."""
    single, plan = plan_pair(MLP, Parallelism(dp=4, nm=2), GBS)
    half = rewritten(plan, {0, 1}, "div", {"value": 24.0})
    wrong = rewritten(half, {2, 3}, "div", {"value": 48.0})
    assert not judge(single, wrong).right
    assert not verify(single, wrong).success


def test_equal_program_in_one_block_is_its_own_class():
    """Microbatch 2 of replica 1 only: replica classes {0, 2, 3} and {1},
    microbatch classes {0, 1, 3} and {2}; one cut per pair."""
    single, plan = plan_pair(MLP, Parallelism(dp=4, nm=4), GBS)
    p = mutations.copy_plan(plan)
    i = next(i for i, n in enumerate(p.nodes) if n.op == "div" and n.mb == 2 and n.rank == 1)
    p.nodes[i] = p.nodes[i]._replace(op="mul_scalar", kwargs={"value": 1 / 32})
    assert judge(single, p).right
    found = find_symmetry(single, p)
    assert isinstance(found, Symmetry)
    assert ((1,), (2,)) in [(c.replicas, c.microbatches) for c in found.classes]
    v = verify(single, p)
    assert v.success and v.classes == 4, v.message


def test_every_replica_wrong_in_the_last_microbatch_fails_in_its_class():
    single, plan = plan_pair(MLP, Parallelism(dp=4, nm=4), GBS)
    wrong = mutations.copy_plan(plan)
    for i, n in enumerate(wrong.nodes):
        if n.op == "div" and n.mb == 3:
            wrong.nodes[i] = n._replace(op="mul_scalar")
    assert not judge(single, wrong).right
    found = find_symmetry(single, wrong)
    assert isinstance(found, Symmetry)
    assert [(c.replicas, c.microbatches) for c in found.classes] == [((0, 1, 2, 3), (3,))]
    v = verify(single, wrong)
    assert not v.success and "FAILED in its own cut: replicas 0, 1, 2, 3 x microbatch 3" \
        in v.symmetry


def test_wrong_replica_of_a_balanced_context_plan_fails():
    """cp_balance plans are proved by symmetry (their partial sums number
    the blocks with the chunk index split around the microbatch), one
    replica running another operator by its own class."""
    llama = ModelConfig("llama3", layers=1, hidden=8, heads=2, kv_heads=1, ffn=8, vocab=8,
                        seqlen=4)
    single, plan = plan_pair(llama, Parallelism(cp=2, dp=4, nm=2), 16, Policy(cp_balance=True))
    made = mutations.replica_op(plan, random.Random(0))
    assert made is not None
    assert not judge(single, made[0]).right
    v = verify(single, made[0])
    assert not v.success and "FAILED in its own cut" in v.symmetry, made[1]


def test_zero_replica_owning_another_shard_fails():
    """One replica owning replica j's shard (shard j twice, its own by
    nobody), with and without keeping j's gradient chunk, FAILs: the owned
    shards do not tile the parameter, so the plan is verified in full
    (docs/soundness.md, "ZeRO-1: owned shards")."""
    single, plan = plan_pair(MLP, Parallelism(dp=4, nm=2), GBS, Policy(zero=1))
    assert isinstance(find_symmetry(single, plan), Symmetry)
    kinds = set()
    for k in range(4):
        made = mutations.owned_shard(plan, random.Random(f"owned/{k}"))
        assert made is not None
        kinds.add("keeps" in made[1])
        assert not judge(single, made[0]).right, made[1]
        assert isinstance(find_symmetry(single, made[0]), Refusal), made[1]
        v = verify(single, made[0])
        assert not v.success, made[1]
    assert kinds == {True, False}


def test_wrong_replica_script_fails_in_its_class(tmp_path):
    """scripts/wrong_replica.py --op (the dp512 benchmark's changed-op
    replica) on the columns of a small plan: FAIL in the replica's cut."""
    single, plan = plan_pair(MLP, Parallelism(dp=4, nm=2), GBS)
    source = save_plan(plan, tmp_path / "p.npz")[0]
    target = tmp_path / "wrong.npz"
    run = subprocess.run([sys.executable, "scripts/wrong_replica.py", str(source), str(target),
                          "--replica", "2", "--op"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    v = verify(single, load_columns_file(target))
    assert not v.success and "FAILED in its own cut: replica 2 x microbatches 0, 1" in v.symmetry
