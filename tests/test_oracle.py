"""The checker of the checker: the oracle's evaluator agrees with the
verifier's numeric backend while sharing none of its code, the oracle
trusts none of the parallel plan's maps, the canaries are wrong by both,
and the solver weighs every open obligation of a stage."""

from __future__ import annotations

import ast
import json
import runpy
from pathlib import Path

import numpy as np
import pytest
from helpers import plan_pair

from gen_model.config import ModelConfig, Parallelism
from harness import evaluator
from harness.blindness import FLOORS, OFTEN_EQUIVALENT, above_ceilings, below_floors
from harness.bugs import BUGS, inject
from harness.canaries import CANARIES
from harness.mutations import CP_MUTATIONS, MUTATIONS
from harness.oracle import judge
from main import PROVER, verify
from verdict import numeric
from verdict.ops import OPS
from verdict.plan import Plan
from verdict.problem import LineageFact, Problem

ROOT = Path(__file__).resolve().parent.parent
HARNESS = runpy.run_path(str(ROOT / "scripts" / "mutate.py"))
MLP = ModelConfig("mlp", layers=2, hidden=8)


def _agree(plan: Plan) -> None:
    """Every tensor of the plan, run by both, on the same inputs; or both
    refuse to run it."""
    try:
        ours = numeric.execute(plan)
    except numeric.ExecutionError:
        with pytest.raises(evaluator.EvaluationError):
            evaluator.execute(plan, inputs=numeric.input_value)
        return
    theirs = evaluator.execute(plan, inputs=numeric.input_value)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert (a is None) == (b is None), i
        if a is None:
            continue
        finite = np.abs(a[np.isfinite(a)])
        scale = max(float(np.max(finite, initial=0.0)), 1e-9)
        with np.errstate(invalid="ignore"):
            same = (a == b) | (np.isnan(a) & np.isnan(b))
            diff = np.where(same, 0.0, np.abs(a - b))
        assert np.all(np.nan_to_num(diff, nan=np.inf) <= 1e-9 * scale), \
            (plan.logical[plan.tensors[i].tid].name, plan.tensors[i])


def test_evaluator_imports_nothing_of_the_verifier_but_the_plan_model():
    for module in ("evaluator.py", "oracle.py"):
        tree = ast.parse((ROOT / "harness" / module).read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert {m for m in names if m and m.split(".")[0] in ("verdict", "backends")} \
            == {"verdict.plan"}, module


def test_evaluator_defines_every_operator_of_the_rule_table():
    assert set(OPS) <= evaluator.known_ops()


@pytest.mark.parametrize("base", list(HARNESS["BASES"]))
def test_evaluators_agree_on_every_base_plan(base):
    cfg, par, policy = HARNESS["BASES"][base]
    single, plan = plan_pair(cfg, par, HARNESS["GBS"], policy)
    _agree(single)
    _agree(plan)


def test_evaluators_agree_on_the_bug_suite():
    """br1..br14 (harness/bugs.py) on the small llama3 dp2 pp2 tp2 nm2 plan."""
    cfg, par, _ = HARNESS["BASES"]["llama3_dp2_pp2_tp2_nm2"]
    _, plan = plan_pair(cfg, par, HARNESS["GBS"])
    for bug in BUGS:
        _agree(inject(plan, bug))


def test_oracle_reads_the_single_device_maps_only():
    """The audit's case: one entry gone from the parallel plan's gradient
    map and that gradient doubled. The old oracle compared the plan's own
    map, and said right."""
    single, plan = plan_pair(MLP, Parallelism(dp=2, tp=2), 8)
    assert judge(single, plan).right
    wrong = CANARIES["gradient_left_out_of_the_map"](plan)
    assert not judge(single, wrong).right
    same_map = CANARIES["gradient_doubled"](plan)
    assert "wrong gradient" in judge(single, same_map).why
    lost = CANARIES["loss_halved"](plan)
    assert "loss" in judge(single, lost).why


@pytest.mark.parametrize("name", list(CANARIES))
def test_canaries_are_wrong_by_the_oracle_and_fail(name):
    single, plan = plan_pair(MLP, Parallelism(dp=2, tp=2, nm=2), 8)
    canary = CANARIES[name](plan)
    assert canary is not None
    assert not judge(single, canary).right
    if canary.grads == single.grads:
        assert not verify(single, canary).success


def test_quick_floors_cover_every_quick_base_and_operator():
    floors = json.loads(FLOORS.read_text())
    bases = {key.split("/")[0] for key in floors}
    assert bases == set(HARNESS["QUICK_BASES"])
    ops = {key.split("/")[1] for key in floors}
    assert {"scale_one_rank", "drop_collective", "stale_version", "wrong_peer"} <= ops
    assert ops <= set(MUTATIONS) | set(HARNESS["FOLD_MUTATIONS"]) | set(CP_MUTATIONS)
    assert sum(floors.values()) >= 200


def test_floors_of_a_part_of_the_quick_bases_are_theirs_only():
    """A run of some ``--quick`` bases is held to their floors; a base of
    that part with no caught mutant is still under its floor."""
    row = HARNESS["Row"]
    caught = [row("a", "mutation", "scale_one_rank", "", "wrong", "FAIL:stage", 0.0)] * 2
    floors = {"a/scale_one_rank": 2, "b/scale_one_rank": 1, "c/drop_collective": 1}
    assert below_floors(caught, floors, ["a"]) == []
    assert below_floors(caught, floors, ["a", "b"]) == [
        "b/scale_one_rank: 0 caught, the floor is 1"]
    assert len(below_floors(caught, floors)) == 2
    assert below_floors(caught[:1], floors, ["a"]) == ["a/scale_one_rank: 1 caught, the floor is 2"]


def test_quick_takes_only_its_own_bases(capsys):
    assert HARNESS["main"](["--quick", "--bases", "llama3_tp2_vocab"]) == 2
    assert "unknown base llama3_tp2_vocab (--quick bases: mlp_dp2_pp2_tp2_nm2" in \
        capsys.readouterr().err


def test_equivalent_ceiling_flags_a_blind_run():
    """The audit's blind oracle turned caught into "equivalent, failed"."""
    row = HARNESS["Row"]
    seeing = [row("b", "mutation", "scale_one_rank", "", "wrong", "FAIL:stage", 0.0)] * 13
    blind = [row("b", "mutation", "scale_one_rank", "", "right", "FAIL:stage", 0.0)] * 10
    assert above_ceilings(seeing) == []
    assert above_ceilings(seeing[:10] + blind[:3]) == []  # a scale that shifts a maximum
    assert above_ceilings(seeing[:6] + blind[:4])
    assert "scale_one_rank" not in OFTEN_EQUIVALENT


def test_solver_finds_a_wrong_claim_behind_a_right_one():
    """Two claims on one stage, both open (neither simplifies to 0): the
    first is right only under an assumption (Ts0 = Ts1, both given as the
    same Tp), the second is wrong. A solver that weighed only the first open
    obligation would prove the stage."""
    whole = ((0, 2),)
    problem = Problem(
        ts_shapes=[(2,), (2,), (2,)], tp_shapes=[(2,), (2,), (2,)],
        gs=("exp", "fw", {}, [1], [2]),
        gp=[("exp", "fw", {}, [0], [1]), ("mul_scalar", "fw", {"value": 2.0}, [1], [2])],
        given=[LineageFact(0, [(whole, (0,))], []), LineageFact(1, [(whole, (0,))], [])],
        claims=[LineageFact(2, [(whole, (1,))], []), LineageFact(2, [(whole, (2,))], [])])
    out = PROVER(problem)
    assert out.status == "counterexample" and out.solver and out.bad == [(1, 0)]
    problem.claims = problem.claims[:1]
    right = PROVER(problem)
    assert right.status == "proved" and right.solver


def test_an_input_stage_with_no_loaded_piece_is_decided():
    """An input stage whose pieces are all computed (fresh zeros claimed as
    a loaded constant, the input read as any value) has no given lineage:
    its input is still a free value, so the claim is refuted, never left
    without a verdict (docs/soundness.md, "Plans traced from PyTorch", 40)."""
    whole = ((0, 2),)
    problem = Problem(
        ts_shapes=[(2,)], tp_shapes=[(2,)], gs=None,
        gp=[("zeros", "none", {"shape": [2]}, [], [0])],
        given=[], claims=[LineageFact(0, [(whole, (0,))], [])])
    out = PROVER(problem)
    assert out.status == "counterexample", out
