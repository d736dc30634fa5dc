"""Folded plans (docs/soundness.md, "Folded plans"): 2 replicas and 2
microbatches shown, the others by symmetry."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from backends.planfile import PlanError, load_plan, save_plan, validate
from gen_model.__main__ import main as gen_main
from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.generate import make_plan, make_plan_at
from gen_model.parallelize import Policy
from harness.mutations import FOLD_MUTATIONS, MUTATIONS, _add_tensor, copy_plan
from harness.oracle import judge, judge_folded
from main import main as verify_main
from main import verify
from verdict.plan import Node, Plan
from verdict.symmetry.fold import FoldError, batch_dims, fold_pair

MLP = ModelConfig("mlp", layers=2, hidden=8)
LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=16,
                    seqlen=4)
GBS = 32  # 4 replicas x 4 microbatches x 2 rows; shown: 8 rows
REAL = Parallelism(dp=4, tp=2, pp=2, nm=4)


@pytest.fixture(scope="module")
def mlp() -> tuple[Plan, Plan, Plan]:
    """Real single-device plan, folded plan, and the generator's
    single-device plan at the shown rows with the real constants."""
    return (make_plan(MLP, Parallelism(), GBS), make_plan(MLP, REAL, GBS, fold=True),
            make_plan_at(MLP, Parallelism(), 8, "default", None, loss_rows=GBS))


@pytest.fixture(scope="module")
def llama() -> tuple[Plan, Plan, Plan]:
    return (make_plan(LLAMA, Parallelism(), GBS), make_plan(LLAMA, REAL, GBS, fold=True),
            make_plan_at(LLAMA, Parallelism(), 8, "default", None, loss_rows=GBS))


def check(single: Plan, parallel: Plan):
    restricted, _ = fold_pair(single, parallel)
    return verify(restricted, parallel)


def test_folded_plan_shows_two_of_each(mlp) -> None:
    _, folded, _ = mlp
    w = folded.world
    assert (w["dp"], w["nm"], w["gbs"]) == (2, 2, 8)
    assert (w["fold_dp"], w["fold_nm"], w["fold_gbs"]) == (4, 4, 32)
    assert folded.to_data()["version"] == 2
    assert make_plan(MLP, REAL, GBS).to_data()["version"] == 1
    assert {n.mb for n in folded.nodes} == {-1, 0, 1}


def test_restriction_is_the_plan_traced_at_the_shown_rows(mlp, llama) -> None:
    """The verifier's restriction and the generator's trace at the shown rows
    with the real constants are two paths to one plan."""
    for single, folded, shown in (mlp, llama):
        restricted, fold = fold_pair(single, folded)
        assert fold is not None and fold.real_dp == 4
        assert (restricted.logical, restricted.tensors, restricted.nodes, restricted.world) == (
            shown.logical, shown.tensors, shown.nodes, shown.world)


def test_folded_verdict_matches_the_unfolded_one(mlp, llama) -> None:
    for single, folded, shown in (mlp, llama):
        v = check(single, folded)
        assert v.success, v.message
        assert "2 of 4 replicas and 2 of 4 microbatches" in v.fold
        assert judge_folded(single, shown, folded).right
    assert verify(mlp[0], make_plan(MLP, REAL, GBS)).success


def test_verify_restricts_the_real_single_device_plan_itself(mlp) -> None:
    """The Python API given the real single-device plan: restricted inside
    verify(), the same verdict as main.py's path; a plan whose fold keys do
    not match the single-device plan is refused there too."""
    single, folded, _ = mlp
    assert verify(single, folded).success
    lied = copy_plan(folded)
    lied.world["fold_gbs"] = 64
    with pytest.raises(FoldError):
        verify(single, lied)


def test_constant_of_the_shown_batch_fails(llama) -> None:
    """The unfolded plan of the shown sizes divides by the shown token count:
    labelled as a fold of the real run, it is wrong, and both say so."""
    single, _, shown = llama
    small = make_plan(LLAMA, Parallelism(dp=2, tp=2, pp=2, nm=2), 8)
    small.world.update(fold_dp=4, fold_nm=4, fold_gbs=GBS)
    assert not judge_folded(single, shown, small).right
    v = check(single, small)
    assert not v.success and v.kind == "stage"


@pytest.mark.parametrize("operator", ["block_differs", "partial_orbit", "shown_constant"])
def test_fold_mutants_fail(llama, operator) -> None:
    single, folded, shown = llama
    for k in range(3):
        made = FOLD_MUTATIONS[operator](folded, random.Random(f"fold/{operator}/{k}"))
        assert made is not None
        mutant, where = made
        assert not judge_folded(single, shown, mutant).right, where
        assert not check(single, mutant).success, where


def test_one_replica_differing_is_a_fold_finding(mlp) -> None:
    single, folded, _ = mlp
    mutant, where = FOLD_MUTATIONS["block_differs"](folded, random.Random(1))
    v = check(single, mutant)
    assert not v.success and v.kind == "fold", (where, v.kind, v.message)
    assert "not uniform" in v.message


def compensated(folded: Plan, c: float) -> Plan:
    """Every block adds c to the gradient it accumulates, every rank
    subtracts (shown blocks) x c after the reducer: right at the shown
    size, wrong at the real one (16 blocks add 16 c)."""
    p = copy_plan(folded)
    blocks = folded.world["dp"] * folded.world["nm"]
    nodes = []
    for n in p.nodes:
        if n.op == "local_grad_accumulation" and n.mb >= 0:
            g = _add_tensor(p, n.inputs[1])
            nodes.append(Node(n.rank, n.mb, "add_scalar", "fw", (n.inputs[1],), (g,),
                              {"value": c}, n.name))
            n = n._replace(inputs=(n.inputs[0], g))
        nodes.append(n)
        if n.op == "reducer":
            out = _add_tensor(p, n.outputs[0])
            nodes.append(Node(n.rank, -1, "add_scalar", "fw", (n.outputs[0],), (out,),
                              {"value": -blocks * c}, n.name))
    p.nodes = nodes
    return p


def test_a_glue_that_compensates_at_two_is_a_fold_finding(mlp) -> None:
    """Uniform, and right at the shown size; the glue after the blocks is not
    a plain sum, so it is not the same at 16 blocks: both refuse it."""
    single, folded, shown = mlp
    bad = compensated(folded, 0.5)
    validate(bad.to_data())
    assert judge(shown, bad).right  # at the shown rows it computes the right values
    assert not judge_folded(single, shown, bad).right
    v = check(single, bad)
    assert not v.success and v.kind == "fold", v.message
    assert "gradient buffer a rank ends with" in v.message


def test_one_rank_mutants_of_a_folded_plan_fail(mlp) -> None:
    single, folded, shown = mlp
    for operator in ("change_constant", "scale_one_rank", "drop_collective", "other_microbatch"):
        for k in range(2):
            made = MUTATIONS[operator](folded, random.Random(f"{operator}/{k}"))
            if made is None:
                continue
            mutant, where = made
            if judge_folded(single, shown, mutant).right:
                continue
            assert not check(single, mutant).success, (operator, where)


@pytest.mark.parametrize(("key", "value"), [("fold_gbs", 64), ("fold_dp", 8), ("fold_nm", 2),
                                            ("dp", 3)])
def test_fold_keys_that_do_not_add_up_are_refused(mlp, key, value) -> None:
    single, folded, _ = mlp
    lie = replace(folded, world={**folded.world, key: value})
    with pytest.raises(FoldError):
        fold_pair(single, lie)


def test_a_mean_over_the_batch_refuses_the_fold(mlp) -> None:
    single = mlp[0]
    nodes = [n._replace(op="mean") if n.op == "sum" and n.kwargs.get("dim") is None else n
             for n in single.nodes]
    assert any(n.op == "mean" for n in nodes)
    with pytest.raises(FoldError, match="along the batch dim"):
        batch_dims(replace(single, nodes=nodes))


def test_fold_keys_need_version_2(mlp) -> None:
    data = mlp[1].to_data()
    validate(data)
    data["version"] = 1
    with pytest.raises(PlanError, match="need plan version 2"):
        validate(data)
    del data["world"]["fold_nm"]
    data["version"] = 2
    with pytest.raises(PlanError, match="needs all of"):
        validate(data)


def test_generator_refuses_what_does_not_fold() -> None:
    for par, policy in ((Parallelism(dp=4, ep=2, nm=2), Policy()),
                        (Parallelism(dp=4, nm=2), Policy(zero=1)),
                        (Parallelism(), Policy())):
        cfg = replace(LLAMA, model="moe", experts=4, topk=2, moe_ffn=8) if par.ep > 1 else MLP
        with pytest.raises(ConfigError, match="--fold"):
            make_plan(cfg, par, GBS, policy=policy, fold=True)


def test_command_lines(tmp_path: Path, capsys) -> None:
    out = str(tmp_path)
    assert gen_main(["--model", "mlp", "--layers", "2", "--hidden", "8", "--gbs", "32",
                     "--dp", "4", "--nm", "4", "--fold", "-o", out]) == 0
    assert gen_main(["--model", "mlp", "--layers", "2", "--hidden", "8", "--gbs", "32",
                     "-o", out]) == 0
    folded = tmp_path / "mlp_default_dp4_pp1_tp1_nm4_gbs32_ly2_h0_hi8_sq0_fold.pkl"
    single = tmp_path / "mlp_default_dp1_pp1_tp1_nm1_gbs32_ly2_h0_hi8_sq0.pkl"
    assert load_plan(folded).world["fold_dp"] == 4
    capsys.readouterr()
    common = ["--cache_dir", str(tmp_path / "c"), "--stats_dir", str(tmp_path / "s")]
    assert verify_main(["--sm", str(single), "--pm", str(folded), *common]) == 0
    got = capsys.readouterr().out
    assert "folded plan: 2 of 4 replicas and 2 of 4 microbatches shown" in got
    assert "num_dp=4" in got and "num_nm=4" in got and "gbs=32" in got  # the real sizes
    assert "fold='shown dp2 nm2 gbs8'" in got
    lie = load_plan(folded)
    lie.world["fold_gbs"] = 64
    bad = save_plan(lie, tmp_path / "lie.pkl")[0]
    assert verify_main(["--sm", str(single), "--pm", str(bad), *common]) == 2
    err = capsys.readouterr().err
    assert "global batch of 64 (--gbs 64)" in err and "make the single-device plan with --gbs 64" in err
    assert "fold_gbs" not in err


def test_uniform_mutants_judged_at_the_real_size() -> None:
    """scripts/mutate_fold.py: programs wrong alike on every replica and
    microbatch, verified folded, judged by the oracle at the real size."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "scripts/mutate_fold.py", "--bases",
                           "mlp_fold_dp4_pp2_tp2_nm4", "--per-operator", "2"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "0 wrong SUCCESS, 0 fold false alarms, 0 without a verdict" in done.stdout
    assert " caught" in done.stdout.splitlines()[0]
