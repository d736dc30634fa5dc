"""A step traced with ``python -m backends.torch`` and its plan pair checked
with ``main.py``, each in a process of its own, as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository, with only the repository on the path."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={"PYTHONPATH": str(ROOT), "PATH": ""})


def traced_and_verified(out: Path, *trace_args: str) -> subprocess.CompletedProcess:
    """Trace with ``trace_args`` into ``out`` and verify the pair written
    there; a trace that does not exit 0 (a refusal) is returned as it is."""
    traced = run("-m", "backends.torch", *trace_args, "-o", str(out))
    if traced.returncode != 0:
        return traced
    single = next(out.glob("*_single.pkl"))
    parallel = next(out.glob("*_parallel.pkl"))
    return run("main.py", "--sm", str(single), "--pm", str(parallel))


def suite_cases(*cases: str) -> subprocess.CompletedProcess:
    """``scripts/torch_suite.py -k CASE ...``: the named suite cases, each
    traced and verified against its expected exit."""
    return run("scripts/torch_suite.py", *[a for case in cases for a in ("-k", case)])
