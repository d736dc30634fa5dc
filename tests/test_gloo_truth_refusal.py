"""``scripts/gloo_truth.py`` refuses a family the backend refuses in one
line, exit 2, like the backend itself (never a traceback)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


def test_a_refused_family_is_one_line(capsys) -> None:
    path = Path(__file__).resolve().parents[1] / "scripts" / "gloo_truth.py"
    spec = importlib.util.spec_from_file_location("gloo_truth_refusal", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--hf", "jetmoe", "--dp", "2", "--rtol", "1e-6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 'jetmoe' has no tensor-parallel plan") and "\n" not in err
