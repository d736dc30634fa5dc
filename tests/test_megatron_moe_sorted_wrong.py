"""Megatron's all-to-all dispatcher sorting the received rows into the
wrong local experts (``moe_tp_sp_ep2_sorted_wrong``, tp 2 sp, ep 2): the
combine adds rows back at other copies than they were gathered at. Written
exactly, a lookup by the rank's own permutation standing in for the rows it
moves (docs/soundness.md, "Plans traced from PyTorch", 103), the plan FAILs
with a counterexample naming a rank and a module, where it was refused; the
correct recipe takes none of these paths (suite cases ``moe megatron ...``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={"PYTHONPATH": str(ROOT), "PATH": ""})


def test_rows_sorted_to_the_other_local_expert_fail_naming_a_rank(tmp_path):
    trace = _run("-m", "backends.torch", "--model", "backends.torch.megatron:moe_gpt",
                 "--recipe", "backends.torch.megatron:moe_tp_sp_ep2_sorted_wrong",
                 "--dp", "1", "--tp", "2", "-o", str(tmp_path))
    assert trace.returncode == 0, trace.stderr[-2000:]
    single = next(tmp_path.glob("*_single.pkl"))
    parallel = next(tmp_path.glob("*_parallel.pkl"))
    run = _run("main.py", "--sm", str(single), "--pm", str(parallel))
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert "not equivalent" in lines[0], lines[0]
    lead = "\n".join(lines[:4])
    assert "on rank" in lead and "local_experts" in lead, lead
