"""main.py --json: the file a run writes matches docs/verify-output.schema.json."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helpers import mlp_plan_files

import main
from gen_model.config import Parallelism

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "docs" / "verify-output.schema.json").read_text())


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    return mlp_plan_files(tmp_path_factory.mktemp("json_plans"), Parallelism(dp=2, tp=2))


def test_the_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize(("pm", "extra", "code"), [
    ("parallel", [], 0),
    ("wrong", [], 1),
    ("wrong", ["--keep-going"], 1),
    ("parallel", ["--numeric"], 0),
    ("wrong", ["--numeric"], 1),
])
def test_the_json_a_run_writes_matches_the_schema(plans, tmp_path, capsys, pm, extra, code):
    out = tmp_path / "run.json"
    got = main.main(["--sm", str(plans["single"]), "--pm", str(plans[pm]), "--json", str(out),
                     "--stats_dir", str(tmp_path), "--cache_dir", str(tmp_path / "cache"), *extra])
    capsys.readouterr()
    assert got == code
    data = json.loads(out.read_text())
    jsonschema.validate(data, SCHEMA)
    ok = data["success"] if data["mode"] == "symbolic" else data["equal"]
    assert ok == (code == 0)
    if data["mode"] == "symbolic" and code == 1:
        assert data["kind"] and data["message"]


def test_the_schema_rejects_what_a_run_never_writes():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"mode": "symbolic", "success": True}, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"mode": "other"}, SCHEMA)
