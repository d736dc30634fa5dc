"""main.py: exit codes, the last lines, Stats row, JSON, dumps and caches."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

import main
from backends.planfile import save_plan
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from verdict.report import append_rows

ROOT = Path(__file__).resolve().parent.parent
MLP = ModelConfig("mlp", layers=2, hidden=8)
LLAMA = ModelConfig("llama3", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12,
                    seqlen=4)


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("plans")
    out = {}
    out["single"], _ = save_plan(make_plan(MLP, Parallelism(), 8), d / "s.pkl")
    out["parallel"], _ = save_plan(make_plan(MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), 8),
                                   d / "p.pkl")
    wrong = make_plan(MLP, Parallelism(dp=2, tp=2), 8)
    i = next(i for i, n in enumerate(wrong.nodes) if n.op == "all_reduce" and n.dir == "fw")
    n = wrong.nodes[i]
    own = next(t for t in n.inputs if wrong.tensors[t].rank == n.rank)
    wrong.nodes[i] = n._replace(op="split", inputs=(own,), kwargs={"dim": 0, "parts": 1, "index": 0})
    out["wrong"], _ = save_plan(wrong, d / "w.pkl")
    out["other"], _ = save_plan(make_plan(ModelConfig("mlp", layers=2, hidden=16),
                                          Parallelism(dp=2), 8), d / "o.pkl")
    return out


def run(args: list[str], tmp_path: Path, capsys) -> tuple[int, str, str]:
    code = main.main([*args, "--stats_dir", str(tmp_path / "stats"),
                      "--cache_dir", str(tmp_path / "cache"), "--log_dir", str(tmp_path / "logs")])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_equivalent_plans_exit_0_with_evidence_and_stats(plans, tmp_path, capsys):
    code, out, _ = run(["--sm", str(plans["single"]), "--pm", str(plans["parallel"])],
                       tmp_path, capsys)
    assert code == 0
    lines = out.strip().splitlines()
    assert "✅ SUCCESS" in lines[-2] and lines[-1].startswith("Stats(success=True")
    assert "stages proved" in out and "final coverage" in out and "lineages verified" in out
    rows = list(csv.DictReader((tmp_path / "stats" / "stats.csv").open()))
    assert rows[-1]["success"] == "True" and rows[-1]["num_dp"] == "2"


def test_stats_file_of_an_older_version_gains_the_new_columns(tmp_path):
    """A stats file without a newer column is rewritten with both sets of
    columns: old rows keep their values, no row lands under a wrong name."""
    path = tmp_path / "stats.csv"
    path.write_text("success,num_dp\nTrue,4\n")
    append_rows(path, [{"success": False, "num_dp": 2, "fold": "dp8 nm4 gbs32"}])
    append_rows(path, [{"success": True, "fold": ""}])
    rows = list(csv.DictReader(path.open()))
    assert [r["num_dp"] for r in rows] == ["4", "2", ""]
    assert [r["fold"] for r in rows] == ["", "dp8 nm4 gbs32", ""]
    assert [r["success"] for r in rows] == ["True", "False", "True"]


def test_stats_file_with_rows_longer_than_its_header_keeps_them(tmp_path):
    """Rows an older version appended under a shorter header: their extra
    values are kept in one column, nothing is lost or fails."""
    path = tmp_path / "stats.csv"
    path.write_text("success,num_dp\nTrue,4\nFalse,2,dp8 nm4\n")
    append_rows(path, [{"success": True, "num_dp": 1, "fold": ""}])
    rows = list(csv.DictReader(path.open()))
    assert [r["unlabelled"] for r in rows] == ["", "dp8 nm4", ""]
    assert [r["num_dp"] for r in rows] == ["4", "2", "1"]


def test_wrong_plan_exits_1_with_counterexample_and_json(plans, tmp_path, capsys):
    report = tmp_path / "r.json"
    code, out, _ = run(["--sm", str(plans["single"]), "--pm", str(plans["wrong"]),
                        "--json", str(report)], tmp_path, capsys)
    assert code == 1
    assert "❌ FAIL" in out and "🚨" in out and "OUTPUT LINEAGES" in out
    verdict = out[:out.index("❌ FAIL")]  # a FAIL reads as a verdict, not a crash
    assert "ERROR" not in verdict and "RuntimeError" not in verdict and "Traceback" not in verdict
    assert "not equivalent" in verdict and "does not compute what the single-device" in verdict
    data = json.loads(report.read_text())
    assert data["success"] is False and data["failing_stages"]
    assert data["failing_stages"][0]["parallel_nodes"]


@pytest.mark.parametrize("args", [
    ["--sm", "missing.pkl", "--pm", "missing.pkl"],
    ["--sm", "x.pkl"],
    ["--sm", "a", "--pm", "b", "--max_vrf_proc", "0"],
    ["--sm", "a", "--pm", "b", "--bogus"],
])
def test_bad_usage_exits_2_with_one_line(args, tmp_path, capsys):
    code, out, err = run(args, tmp_path, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and not out


def test_plans_of_different_models_exit_2(plans, tmp_path, capsys):
    code, _, err = run(["--sm", str(plans["single"]), "--pm", str(plans["other"])],
                       tmp_path, capsys)
    assert code == 2 and "different models" in err and len(err.strip().splitlines()) == 1
    assert "--sm is mlp (layers 2, hidden 8, gbs 8)" in err
    assert "--pm is mlp (layers 2, hidden 16, gbs 8)" in err


def test_single_device_plan_as_parallel_exits_2(plans, tmp_path, capsys):
    for numeric in ([], ["--numeric"]):
        code, out, err = run(["--sm", str(plans["single"]), "--pm", str(plans["single"]),
                              *numeric], tmp_path, capsys)
        assert code == 2 and not out and len(err.strip().splitlines()) == 1
        assert "--pm is a single-device plan" in err
    assert not (tmp_path / "stats").exists()


def test_help_explains_every_flag_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main.parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for action in main.parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
    for code in range(4):
        assert f"  {code}  " in text.split("exit codes:")[1]


def test_time_prints_the_stats_figures(plans, tmp_path, capsys):
    code, out, _ = run(["--sm", str(plans["single"]), "--pm", str(plans["parallel"]), "--time"],
                       tmp_path, capsys)
    assert code == 0
    stats = next(line for line in out.splitlines() if line.startswith("Stats("))
    times = next(line for line in out.splitlines() if line.startswith("times:"))
    for key in ("t_graph", "t_lineage", "t_schedule", "t_vrf", "t_total"):
        shown = stats.split(f"{key}=")[1].split(",")[0].rstrip(")")
        assert f"{key}={shown}s" in times, (key, stats, times)


def test_parallel_plan_as_single_exits_2(plans, tmp_path, capsys):
    code, _, err = run(["--sm", str(plans["parallel"]), "--pm", str(plans["parallel"])],
                       tmp_path, capsys)
    assert code == 2 and "single-device" in err


def test_dumps_and_caches(plans, tmp_path, capsys):
    args = ["--sm", str(plans["single"]), "--pm", str(plans["parallel"]), "--dump_nodes",
            "--dump_lineages", "--dump_stages"]
    assert run(args, tmp_path, capsys)[0] == 0
    folder = tmp_path / "logs" / "p"
    for name in ("nodes.txt", "lineages.txt", "stages.txt"):
        assert (folder / name).read_text().strip()
    assert (tmp_path / "cache" / "stages.json").exists()
    assert list((tmp_path / "cache" / "plans").glob("*.pkl"))
    code, out, _ = run(args, tmp_path, capsys)
    assert code == 0 and "0 needed the solver" in out
    stats = out.strip().splitlines()[-1]
    assert "memo_hits=" in stats and "memo_hits=0," not in stats
    (tmp_path / "cache" / "stages.json").write_text("{not json")
    assert run(args, tmp_path, capsys)[0] == 0


def test_stage_cache_of_other_verifier_code_is_not_trusted(tmp_path):
    """A proof cached by a verifier whose rules differ says nothing here."""
    from verdict.cache import STAGE_CACHE_VERSION, StageCache
    path = tmp_path / "stages.json"
    path.write_text(json.dumps({"version": STAGE_CACHE_VERSION, "code": "other", "proved": ["k"]}))
    assert StageCache(tmp_path).proved == set()
    StageCache(tmp_path).save({"k"})
    assert StageCache(tmp_path).proved == {"k"}


def test_numeric_mode(plans, tmp_path, capsys):
    code, out, _ = run(["--sm", str(plans["single"]), "--pm", str(plans["wrong"]), "--numeric"],
                       tmp_path, capsys)
    assert code == 1 and "DIFFERENT" in out
    code, out, _ = run(["--sm", str(plans["single"]), "--pm", str(plans["parallel"]), "--numeric"],
                       tmp_path, capsys)
    assert code == 0 and "EQUAL" in out


def test_command_line_process(plans, tmp_path):
    done = subprocess.run([sys.executable, "main.py", "--sm", str(plans["single"]), "--pm",
                           str(plans["wrong"]), "--stats_dir", str(tmp_path),
                           "--cache_dir", str(tmp_path / "cache")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr


def test_internal_error_exits_3_with_one_line(plans, tmp_path, capsys, monkeypatch):
    """An exception inside the verifier is neither a verdict nor a traceback."""
    def broken(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(main, "verify", broken)
    code, out, err = run(["--sm", str(plans["single"]), "--pm", str(plans["parallel"])],
                         tmp_path, capsys)
    assert code == 3 and "SUCCESS" not in out and "FAIL" not in out
    assert len(err.strip().splitlines()) == 1 and "RecursionError" in err


def test_stage_that_cannot_run_is_no_verdict(plans, tmp_path, capsys, monkeypatch):
    """A stage worker that raises leaves the run without a verdict: exit 3."""
    from verdict.executor import InlineExecutor

    def raising(problem, seed=0, timeout_ms=0):
        raise ValueError("cannot run")

    monkeypatch.setattr(main, "make_executor", lambda *args: InlineExecutor(raising))
    code, out, err = run(["--sm", str(plans["single"]), "--pm", str(plans["parallel"]),
                          "--no_cache_stages"], tmp_path, capsys)
    assert code == 3 and "SUCCESS" not in out and "FAIL" not in out
    assert "no verdict" in err and len(err.strip().splitlines()) == 1


def test_killed_stage_worker_is_no_verdict(plans, tmp_path, capsys, monkeypatch):
    """A worker the kernel kills (out of memory, say), again on the retry,
    ends the run with exit 3 and one line naming the stage, instead of
    hanging or reading as a verdict."""
    import os
    import signal

    from verdict.executor import ProcessExecutor

    parent = os.getpid()

    def killed(problem, seed=0, timeout_ms=0):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("stages must run in workers here")

    monkeypatch.setattr(main, "make_executor", lambda *args: ProcessExecutor(2, killed))
    code, out, err = run(["--sm", str(plans["single"]), "--pm", str(plans["parallel"]),
                          "--no_cache_stages", "--max_vrf_proc", "2"], tmp_path, capsys)
    assert code == 3 and "SUCCESS" not in out and "FAIL" not in out
    assert "worker died" in err and "signal 9" in err and len(err.strip().splitlines()) == 1
    assert "stage " in err


def test_memory_exhausted_is_no_verdict(plans, tmp_path, capsys, monkeypatch):
    import verdict.engine as engine

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(engine, "prepare", exhausted)
    code, out, err = run(["--sm", str(plans["single"]), "--pm", str(plans["parallel"])],
                         tmp_path, capsys)
    assert code == 3 and "SUCCESS" not in out and "FAIL" not in out
    assert "out of memory" in err and len(err.strip().splitlines()) == 1
