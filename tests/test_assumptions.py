"""What a SUCCESS may assume (docs/soundness.md, "What a SUCCESS assumes",
"A load's factor: refused, never assumed", "Scaled claims under a fold or a
cut"): a load that claims a factor is refused in both modes and both plan
forms; the report says what was assumed; the per-rank mean convention and
an equal round trip in one block verify folded and materialized, as a Plan
and as columns; a mean over the shown count is still a FAIL."""

from __future__ import annotations

import json
import random

import pytest

from backends.planfile import save_plan
from gen_model.config import Parallelism
from gen_model.generate import fold_sizes, make_plan, make_plan_at
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge, judge_folded
from main import main, verify
from tests.helpers import MLP, plan_pair
from verdict.columns import Columns
from verdict.plan import InputError, Plan, pair_problem
from verdict.symmetry.fold import fold_pair

MATERIALIZED = Parallelism(dp=4, tp=2, pp=2, nm=4)
GBS = 32


def _scaled_load(plan: Plan, k: int = 0) -> Plan:
    made = mutations.scaled_load(plan, random.Random(f"assume/{k}"))
    assert made is not None
    return made[0]


def _materialized() -> tuple[Plan, Plan]:
    return plan_pair(MLP, MATERIALIZED, GBS)


def test_scaled_load_is_wrong_by_the_oracle_and_refused() -> None:
    single, plan = plan_pair(MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), 8)
    for k in range(3):
        mutant = _scaled_load(plan, k)
        assert not judge(single, mutant).right
        problem = pair_problem(single, mutant)
        assert problem and "is loaded (no node writes it) but claims 2 x its slice" in problem
        with pytest.raises(InputError, match="claims 2 x its slice"):
            verify(single, mutant)


def test_scaled_load_refused_as_columns() -> None:
    single, plan = _materialized()
    mutant = Columns.from_plan(_scaled_load(plan))
    assert "claims 2 x its slice" in (pair_problem(single, mutant) or "")
    with pytest.raises(InputError):
        verify(single, mutant)


@pytest.mark.parametrize("suffix", [".pkl", ".npz"])
@pytest.mark.parametrize("numeric", [False, True])
def test_scaled_load_exits_2_in_both_modes(tmp_path, capsys, suffix: str, numeric: bool) -> None:
    single, plan = plan_pair(MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), 8)
    sm = save_plan(single, tmp_path / "s.pkl")[0]
    pm = save_plan(_scaled_load(plan), tmp_path / f"p{suffix}")[0]
    argv = ["--sm", str(sm), "--pm", str(pm), "--stats_dir", str(tmp_path),
            "--cache_dir", str(tmp_path / "cache"), "--no_cache_stages"]
    assert main(argv + (["--numeric"] if numeric else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "claims 2 x its slice" in err[0], err


def test_single_device_plan_with_a_factor_is_refused() -> None:
    single, plan = plan_pair(MLP, Parallelism(dp=2), 8)
    odd = mutations.copy_plan(single)
    odd.tensors[0] = odd.tensors[0]._replace(scale=(3, 1))
    assert "--sm: tensor 0 claims a factor" in (pair_problem(odd, plan) or "")


def test_success_says_what_it_assumed(tmp_path, capsys) -> None:
    single, plan = plan_pair(MLP, Parallelism(dp=2, tp=2), 8)
    sm = save_plan(single, tmp_path / "s.pkl")[0]
    pm = save_plan(plan, tmp_path / "p.pkl")[0]
    out_json = tmp_path / "v.json"
    argv = ["--sm", str(sm), "--pm", str(pm), "--stats_dir", str(tmp_path),
            "--cache_dir", str(tmp_path / "cache"), "--json", str(out_json)]
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("assumed"))
    loads = sum(1 for i, t in enumerate(plan.tensors)
                if i not in {o for n in plan.nodes for o in n.outputs})
    assert f"the {loads} loaded tensors on 4 ranks are the slices they claim, factor 1" in line
    assert "the plan's nodes are what the ranks ran" in line
    assert "proof cache" not in line
    assert json.loads(out_json.read_text())["assumed"] == line
    assert main(argv) == 0  # the second run takes its stages from the cache, and says so
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("assumed"))
    assert "proved by an earlier run (the proof cache)" in line


def test_per_rank_mean_verifies_materialized_in_both_forms() -> None:
    single, plan = _materialized()
    made = mutations.per_rank_mean(plan, random.Random(0))
    assert made is not None
    mutant = made[0]
    assert judge(single, mutant).right
    for form in (mutant, Columns.from_plan(mutant)):
        v = verify(single, form)
        assert v.success, v.message
        assert "checked against the representatives" in v.symmetry


def test_mean_over_the_shown_count_fails_in_a_fold() -> None:
    """A folded plan's loss pieces that are means over the shown blocks'
    count (4 x a part of 16 blocks) are no per-rank mean of the real run."""
    par, policy = Parallelism(dp=4, tp=2, pp=2, nm=4), Policy()
    single = make_plan(MLP, Parallelism(), GBS)
    shown = make_plan_at(MLP, Parallelism(), fold_sizes(par, GBS, policy)[1], "default", None,
                         loss_rows=GBS)
    folded = make_plan(MLP, par, GBS, policy=policy, fold=True)
    right = mutations.per_rank_mean(folded, random.Random(0))[0]
    assert judge_folded(single, shown, right).right
    restricted, _ = fold_pair(single, right)
    assert verify(restricted, right).success
    wrong = mutations.copy_plan(right)
    for i, t in enumerate(wrong.tensors):  # every factor of 16 claimed as 4
        if t.scale == (16, 1):
            wrong.tensors[i] = t._replace(scale=(4, 1))
        elif t.scale == (1, 16):
            wrong.tensors[i] = t._replace(scale=(1, 4))
    for i, n in enumerate(wrong.nodes):
        if n.name in ("mean_seed", "mean_loss"):
            wrong.nodes[i] = n._replace(kwargs={"value": 4.0})
        elif n.name == "mean_correction":
            wrong.nodes[i] = n._replace(kwargs={"value": 0.25})
    assert not judge_folded(single, shown, wrong).right
    v = verify(restricted, wrong)
    assert not v.success and "scaled neither as shares of the loss nor as means" in v.message


def test_round_trip_in_one_block_verifies_as_columns() -> None:
    """One block scales a value and scales it back: another class of blocks,
    proved by its own cut, which keeps the factors a columnar plan holds."""
    single, plan = _materialized()
    for k in range(3):
        mutant, where = mutations.rescale(plan, random.Random(f"0/mat/rescale/{k}"))
        v = verify(single, Columns.from_plan(mutant))
        assert v.success, (where, v.message, v.symmetry)
        assert "classes of blocks" in v.symmetry, v.symmetry
