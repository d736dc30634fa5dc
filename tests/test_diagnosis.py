"""A FAIL leads with a diagnosis in the model's names (verdict/diagnosis.py);
main.py --brief moves the full dump to a file."""

from __future__ import annotations

import json

import main
from gen_model.config import Parallelism
from tests.helpers import mlp_plan_files
from verdict.diagnosis import coordinate, factor


def test_a_wrong_plan_leads_with_the_diagnosis(tmp_path, capsys) -> None:
    files = mlp_plan_files(tmp_path, Parallelism(dp=2, tp=2))
    common = ["--sm", str(files["single"]), "--pm", str(files["wrong"]), "--stats_dir",
              str(tmp_path), "--cache_dir", str(tmp_path / "c"), "--log_dir", str(tmp_path / "l")]
    assert main.main([*common, "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("❌ Stage "))
    assert out[at + 1].startswith("   what: ") and " differs on rank" in out[at + 1]
    assert out[at + 2].startswith("   where: module ") and out[at + 3].startswith("   why: ")
    assert any("OUTPUT LINEAGES" in line for line in out[at:])  # the dump follows by default
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["diagnosis"] == out[at:at + len(report["diagnosis"])]
    assert main.main([*common, "--brief"]) == 1
    brief = capsys.readouterr().out
    assert "OUTPUT LINEAGES" not in brief and "Node(" not in brief
    dumped = next((tmp_path / "l").rglob("failure.txt")).read_text()
    assert "OUTPUT LINEAGES" in dumped and "🚨" in dumped


def test_ranks_read_as_coordinates_of_the_users_mesh() -> None:
    assert coordinate("dp_replicate=2,dp_shard=2,tp=2", 5) == "dp_replicate 1, dp_shard 0, tp 1"


def test_a_factor_is_named_only_when_it_is_one() -> None:
    import numpy as np
    assert str(factor(np.array([1.0, 2.0]), np.array([2.0, 4.0]))) == "1/2"
    assert factor(np.array([1.0, 3.0]), np.array([2.0, 4.0])) is None
    assert factor(np.array([0.0, 0.0]), np.array([2.0, 4.0])) is None
