"""scripts/compare_verdicts.py: two checkouts' verdicts over a folder of plan
pairs compared once timings and the process id are blanked out; a case is a
folder with one single and one parallel plan file; bad arguments exit 2."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compare_verdicts.py"


def load():
    spec = importlib.util.spec_from_file_location("compare_verdicts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timings_and_the_process_id_are_blanked_out(tmp_path: Path) -> None:
    cv = load()
    line = "PID: 31319 - ✅ SUCCESS\nStats(success=True, t_graph=0.041, t_total=1.5, fold='')"
    assert cv.blank(line) == "PID: _ - ✅ SUCCESS\nStats(success=True, t_graph=_, t_total=_, fold='')"
    (tmp_path / "s.json").write_text(json.dumps({"stats": {"t_vrf": 0.3, "stages": 4}}))
    assert json.loads(cv.summary(tmp_path / "s.json")) == {"stats": {"stages": 4, "t_vrf": "_"}}
    assert cv.summary(tmp_path / "none.json") == ""


def test_a_case_is_a_folder_of_one_single_and_one_parallel_plan(tmp_path: Path) -> None:
    cv = load()
    for name, files in (("a", ["single.pkl", "single.json", "parallel.npz"]),
                        ("b", ["single.pkl"]), ("c", ["single.pkl", "parallel.pkl"])):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("")
    found = cv.cases(tmp_path, [])
    assert sorted(found) == ["a", "c"] and found["a"][1].name == "parallel.npz"
    assert sorted(cv.cases(tmp_path, ["c"])) == ["c"]


def test_a_code_or_an_output_of_difference_is_reported(tmp_path: Path) -> None:
    cv = load()
    for side in ("before", "after"):
        (tmp_path / side / "case").mkdir(parents=True)
        for part in ("code", "stdout", "stderr", "json"):
            (tmp_path / side / "case" / part).write_text("0\n" if part == "code" else "")
    assert cv.differences(tmp_path / "before", tmp_path / "after", ["case"]) == []
    (tmp_path / "after" / "case" / "code").write_text("1\n")
    (tmp_path / "after" / "case" / "stdout").write_text("❌")
    assert cv.differences(tmp_path / "before", tmp_path / "after", ["case"]) == [
        "case (code, stdout)"]


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--before", str(ROOT), "--after",
                          str(ROOT), "--plans", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("error: no case folder")
    run = subprocess.run([sys.executable, str(SCRIPT), "--before", str(tmp_path), "--after",
                          str(ROOT), "--plans", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and "is not a checkout" in run.stderr
