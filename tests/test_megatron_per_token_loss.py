"""Megatron-LM issue 7452's fix (``calculate_per_token_loss=True``,
``backends.torch.megatron:gpt_mtp_per_token``): the losses summed, the
microbatches' token counts added up by the schedule, all-reduced over the
data-parallel group in ``finalize_model_grads``, which branches on the
total (``if num_tokens > 0``) and scales every gradient by its reciprocal
(``backends/torch/lowering/count_scales.py``; docs/soundness.md, "Plans
traced from PyTorch", 85)."""

from __future__ import annotations

import pytest

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import check_no_value_reads
from backends.torch.lowering.count_scales import CountTest, decided
from tests.cli_pair import suite_cases


def test_the_per_token_fix_verifies_and_its_count_over_the_wrong_group_fails():
    """dp 2 (2 ranks), SUCCESS; the count all-reduced over the
    tensor-parallel group (each rank's own count at tp 1) FAILs. The same
    fix at dp 2 tp 2 and at tp 2 with 2 microbatches, and the wrong group at
    dp 2 pp 2, are suite cases only (scripts/torch_suite.py -k "per-token
    loss", run before each merge; docs/workflow.md, "Set up and the test
    suite")."""
    run = suite_cases("megatron mtp per-token loss, the token count all-reduced (7452's fix)",
                      "megatron bug mtp per-token loss, the token count all-reduced over the tp group")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "torch suite: 2 of 2 as expected" in run.stdout, run.stdout[-2000:]


class _Lowerer:
    def __init__(self, env: dict):
        self.env = env


def test_a_branch_on_an_all_reduced_count_must_be_the_real_steps():
    """The traced run compared the rank's own count (the fake group's
    all-reduce leaves it); the real step compares the group's total."""
    decided(_Lowerer({7: CountTest(holds=True, taken=True, unsummed=False)}), 7, "step")
    decided(_Lowerer({7: CountTest(holds=True, taken=False, unsummed=True)}), 7, "step")
    with pytest.raises(LoweringError, match="this rank's own count"):
        decided(_Lowerer({7: CountTest(holds=True, taken=False, unsummed=False)}), 7, "step")
    with pytest.raises(LoweringError, match="other than a comparison of a count"):
        decided(_Lowerer({7: 12}), 7, "step")


def _trace(events: list) -> dict:
    return {"params": {"w": (0, (2,), [[]])}, "events": events, "constants": set()}


def test_only_reads_of_values_reduced_from_untainted_ones_are_deferred():
    """A value read of an all-reduce of batch facts is handed to the lowering;
    one of a value computed from a parameter is refused as before."""
    reduced = [("c10d.allreduce_.default", [[[("v", 1)], ("pg", [0, 1])], {}], [2], [()], "", None, 0),
               ("aten.gt.Scalar", [[("v", 2), 0], {}], [3], [()], "", None, 0),
               ("aten._local_scalar_dense.default", [[("v", 3)], {}], [], [], "", None, 0)]
    reads: list = []
    check_no_value_reads(_trace(reduced), [], reads)
    assert reads == [(3, "")]
    tainted = [("aten.sum.default", [[("v", 0)], {}], [1], [()], "", None, 0), *reduced]
    with pytest.raises(LoweringError, match="Python reads the value"):
        check_no_value_reads(_trace(tainted), [], [])
