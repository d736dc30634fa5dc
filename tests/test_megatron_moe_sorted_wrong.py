"""Megatron's all-to-all dispatcher sorting the received rows into the
wrong local experts (``moe_tp_sp_ep2_sorted_wrong``, tp 2 sp, ep 2): the
combine adds rows back at other copies than they were gathered at. Written
exactly, a lookup by the rank's own permutation standing in for the rows it
moves (docs/soundness.md, "Plans traced from PyTorch", 103), the plan FAILs
with a counterexample naming a rank and a module, where it was refused; the
correct recipe takes none of these paths (suite cases ``moe megatron ...``)."""

from __future__ import annotations

import pytest

from tests.cli_pair import traced_and_verified

pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")


def test_rows_sorted_to_the_other_local_expert_fail_naming_a_rank(tmp_path):
    run = traced_and_verified(tmp_path, "--model", "backends.torch.megatron:moe_gpt",
                              "--recipe", "backends.torch.megatron:moe_tp_sp_ep2_sorted_wrong",
                              "--dp", "1", "--tp", "2")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert "not equivalent" in lines[0], lines[0]
    lead = "\n".join(lines[:4])
    assert "on rank" in lead and "local_experts" in lead, lead
