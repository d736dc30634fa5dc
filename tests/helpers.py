"""Pieces several test modules share."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

from backends.planfile import save_plan
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from harness import mutations
from harness.oracle import judge
from main import verify
from verdict.plan import Plan

MLP = ModelConfig("mlp", layers=2, hidden=8)


@cache
def plan_pair(cfg: ModelConfig, par: Parallelism, gbs: int,
              policy: Policy = Policy()) -> tuple[Plan, Plan]:  # noqa: B008 (frozen)
    """The single-device plan and the plan of ``par``, made once per test run
    (callers must not change them)."""
    return make_plan(cfg, Parallelism(), gbs), make_plan(cfg, par, gbs, policy=policy)


def mlp_plan_files(folder: Path, parallel: Parallelism) -> dict[str, Path]:
    """A small mlp pair on disk: single, parallel, and a wrong plan (dp2 tp2)
    whose first forward all_reduce keeps only the rank's own piece."""
    wrong = make_plan(MLP, Parallelism(dp=2, tp=2), 8)
    i = next(i for i, n in enumerate(wrong.nodes) if n.op == "all_reduce" and n.dir == "fw")
    n = wrong.nodes[i]
    own = next(t for t in n.inputs if wrong.tensors[t].rank == n.rank)
    wrong.nodes[i] = n._replace(op="split", inputs=(own,), kwargs={"dim": 0, "parts": 1, "index": 0})
    return {
        "single": save_plan(make_plan(MLP, Parallelism(), 8), folder / "s.pkl")[0],
        "parallel": save_plan(make_plan(MLP, parallel, 8), folder / "p.pkl")[0],
        "wrong": save_plan(wrong, folder / "w.pkl")[0],
    }


def caught(single: Plan, plan: Plan, operator: str, tag: str, tries: int = 3) -> int:
    """How many of ``tries`` mutants of ``operator`` the oracle finds wrong;
    each of them must FAIL."""
    memo: dict = {}
    count = 0
    for k in range(tries):
        made = mutations.MUTATIONS[operator](plan, random.Random(f"{tag}/{operator}/{k}"))
        assert made is not None
        mutant, where = made
        if judge(single, mutant).right:
            continue
        assert not verify(single, mutant, memo=memo).success, where
        count += 1
    return count
