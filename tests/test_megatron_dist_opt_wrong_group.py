"""Megatron's distributed optimizer with its buckets reduce-scattered over the
tensor-parallel group (``dist_opt_wrong_group``, dp 2 tp 2): the collective
writes another range than the one the step reads, so a parameter's final
gradient block holds elements of other gradients. Lowered as those elements
and claimed as the block (docs/soundness.md, "Plans traced from PyTorch",
91 (b)), the plan FAILs, where it was refused; the correct neighbour still
verifies (suite case ``megatron dp2 tp2 distributed optimizer``)."""

from __future__ import annotations

import pytest

from tests.cli_pair import traced_and_verified

pytest.importorskip("megatron.core", reason="needs the [megatron] extra (megatron-core)")


def test_reduce_scatter_over_the_tp_group_fails_naming_a_rank(tmp_path):
    run = traced_and_verified(tmp_path, "--model", "backends.torch.megatron:gpt", "--recipe",
                              "backends.torch.megatron:dist_opt_wrong_group", "--dp", "2", "--tp", "2",
                              "--batch", "8", "--hidden", "24")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert "not equivalent" in lines[0], lines[0]
    # the first stage refuted names the ranks and the module: a counterexample
    # at a gradient the wrong group leaves unequal on the dp replicas (the
    # engine reports a refuted stage before a later structural finding,
    # docs/soundness.md, "Plans traced from PyTorch", 94 (c))
    lead = "\n".join(lines[:4])
    assert "rank" in lead and "MegatronModel.model" in lead, lead
