"""The ``verdict`` command (verdict_cli.py): check, torch and gen, with
main.py's exit codes."""

from __future__ import annotations

import verdict_cli
from gen_model.config import Parallelism
from tests.helpers import mlp_plan_files


def test_help_lists_the_commands(capsys) -> None:
    assert verdict_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"verdict {c}" in out for c in ("check", "torch", "gen"))
    assert verdict_cli.main([]) == 2
    assert verdict_cli.main(["prove"]) == 2
    assert "unknown command 'prove'" in capsys.readouterr().err


def test_check_is_main(tmp_path, capsys) -> None:
    files = mlp_plan_files(tmp_path, Parallelism(dp=2, tp=2))
    common = ["--stats_dir", str(tmp_path), "--cache_dir", str(tmp_path / "c")]
    assert verdict_cli.main(["check", "--sm", str(files["single"]), "--pm",
                             str(files["parallel"]), *common]) == 0
    assert "✅ SUCCESS" in capsys.readouterr().out
    assert verdict_cli.main(["check", "--sm", str(files["single"]), "--pm",
                             str(files["wrong"]), *common]) == 1
    assert verdict_cli.main(["check", "--sm", str(tmp_path / "none.pkl"), "--pm",
                             str(files["wrong"]), *common]) == 2


def test_gen_writes_plans(tmp_path) -> None:
    assert verdict_cli.main(["gen", "--model", "mlp", "--layers", "2", "--hidden", "8",
                             "--gbs", "8", "--dp", "2", "--out", str(tmp_path)]) == 0
    assert list(tmp_path.glob("mlp_default_dp2*.pkl"))


def test_torch_traces_and_proves(tmp_path, capsys) -> None:
    common = ["--model", "mlp", "--layers", "1", "--hidden", "8", "--batch", "4"]
    right = ["torch", "--recipe", "tp_mlp", "--dp", "2", "--tp", "2", *common]
    assert verdict_cli.main([*right, "-o", str(tmp_path)]) == 0
    assert "✅ SUCCESS" in capsys.readouterr().out
    assert len(list(tmp_path.glob("*.pkl"))) == 2  # kept with -o
    wrong = ["torch", "--recipe", "ddp_weights_only", "--dp", "2", "--tp", "1", *common]
    assert verdict_cli.main(wrong) == 1
    out = capsys.readouterr().out
    assert "❌ FAIL" in out and "wrote " not in out  # the plans went to a removed directory


def test_references_import_from_the_current_directory(tmp_path) -> None:
    """A user's ``mymodule:recipe`` is found in the folder the command runs
    in, as ``python -m`` finds it: the console script's own path starts at
    the virtual environment's bin folder."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "my_recipes_here.py").write_text("X = 1\n")
    script = Path(sys.executable).parent / "verdict"
    if not script.exists():
        import pytest

        pytest.skip("the console script is installed by make")
    done = subprocess.run([str(script), "torch", "--model", "mlp", "--recipe",
                           "my_recipes_here:absent"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "has no attribute 'absent'" in done.stderr, done.stderr
