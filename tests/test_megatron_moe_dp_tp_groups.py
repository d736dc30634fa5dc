"""Megatron's MoE at dp 2 x tp 2 with sequence parallelism, where its own
groups are not one mesh axis: PR 5916's fix (ep 1, etp 1: the
expert-data-parallel group is all four ranks, read from its members as the
product of dp and tp) verifies, and the dispatcher sorting the received
rows into the wrong local experts (its window of moved rows at another
rank's copies) FAILs naming a rank and a local expert (docs/soundness.md,
"Plans traced from PyTorch", 113; suite cases ``moe megatron dp2 tp2 ...``)."""

from __future__ import annotations

import pytest

from tests.cli_pair import traced_and_verified

pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")

MESH = ("--dp", "2", "--tp", "2", "--seqlen", "8", "--batch", "8")


def _run(tmp_path, recipe: str):
    return traced_and_verified(tmp_path, "--model", "backends.torch.megatron:moe_gpt",
                               "--recipe", f"backends.torch.megatron:{recipe}", *MESH)


def test_expert_data_parallel_group_of_every_rank_verifies(tmp_path):
    run = _run(tmp_path, "moe_tp_sp_etp1_fixed")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_rows_sorted_to_the_other_local_expert_fail_at_dp_tp(tmp_path):
    run = _run(tmp_path, "moe_tp_sp_ep2_sorted_wrong")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    lead = "\n".join(run.stdout.splitlines()[:4])
    assert "not equivalent" in lead and "on rank" in lead and "local_experts" in lead, lead
