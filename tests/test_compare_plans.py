"""scripts/compare_plans.py: two checkouts' plan files compared byte for byte;
a file missing on one side or differing in one byte is a difference; bad
arguments are one line and exit 2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compare_plans.py"


def load():
    spec = importlib.util.spec_from_file_location("compare_plans", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_byte_or_a_file_of_difference_is_reported(tmp_path: Path) -> None:
    cp = load()
    for side in ("before", "after"):
        (tmp_path / side / "case").mkdir(parents=True)
        (tmp_path / side / "case" / "single.pkl").write_bytes(b"\x00\x01")
        (tmp_path / side / "handlers.txt").write_text("aten.add\n")
    assert cp.differences(tmp_path / "before", tmp_path / "after") == []
    (tmp_path / "after" / "case" / "single.pkl").write_bytes(b"\x00\x02")
    (tmp_path / "before" / "case" / "status.txt").write_text("2 LoweringError: no\n")
    assert cp.differences(tmp_path / "before", tmp_path / "after") == [
        "case/single.pkl", "case/status.txt"]


def test_a_case_name_is_a_file_name() -> None:
    assert load().slug("moe titan dp2 (ep 2): bug/x") == "moe_titan_dp2_ep_2_bug_x"


def test_bad_arguments_are_one_line_and_exit_2(tmp_path: Path) -> None:
    for args in (["--before", str(tmp_path), "--after", str(ROOT)],
                 ["--before", str(ROOT), "--after", str(ROOT), "--reuse"],
                 ["--before", str(ROOT), "--after", str(ROOT), "--every", "0"]):
        run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 2, run
        assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("error: ")
