"""Every rank's loaded values are the claimed pieces of the single-device
tensors (``backends.torch.check.check_loaded``, docs/soundness.md, "Plans
traced from PyTorch", 28): a shard loaded at the wrong offset, the same
shard on two ranks, a checkpoint loaded into the wrong rank or a rank fed
another rank's batch rows is a finding (exit 1) naming the rank and the
input; the stock recipes, uneven FSDP2 shards and norms of ones verify."""

from __future__ import annotations

import numpy as np
import pytest

import backends.torch.__main__ as backend
from backends.torch.__main__ import parser, resolve, trace_and_build
from backends.torch.tracer.check import LoadedValueMismatch, check_loaded
from main import verify
from verdict.plan import Logical, Plan, Tensor

MODELS = "backends.torch.stock_models:"
STOCK = "backends.torch.stock_recipes:"
BUGS = "tests.loaded_values_recipes:"


def _trace(recipe: str, *extra: str, model: str = "mlp"):
    args = resolve(parser().parse_args(["--model", MODELS + model, "--recipe", recipe,
                                        "--hidden", "8", "--ffn", "8", *extra]))
    return trace_and_build(args)[0]


def _finding(recipe: str, *extra: str) -> str:
    with pytest.raises(LoadedValueMismatch) as caught:
        _trace(recipe, *extra)
    return str(caught.value)


def test_from_local_of_the_next_rows_fails() -> None:
    """up is [8, 8]: tp rank 1 holds rows 0:4, rank 0 rows 4:8."""
    line = _finding(BUGS + "tp_up_next_rows", "--dp", "1", "--tp", "2")
    assert line.startswith("rank 0 holds rows 4:8 of blocks.0.up.weight, not its claimed rows 0:4")


def test_two_ranks_with_the_same_shard_fail() -> None:
    line = _finding(BUGS + "tp_up_same_rows", "--dp", "1", "--tp", "2")
    assert line.startswith("rank 1 holds rows 0:4 of blocks.0.up.weight, not its claimed rows 4:8")


def test_checkpoint_loaded_into_the_wrong_rank_fails() -> None:
    """embed is [16, 8] sharded over dp 2 by FSDP2."""
    line = _finding(BUGS + "fsdp_swapped_checkpoint", "--dp", "2", "--tp", "1")
    assert line.startswith("rank 0 holds rows 8:16 of embed.weight, not its claimed rows 0:8")


def test_a_rank_fed_another_ranks_rows_fails(monkeypatch) -> None:
    """Rank 1 given rank 0's rows of the batch (its tokens and labels)."""
    traced = backend.trace_ranks

    def fed_wrong(*args, **kwargs):
        traces = traced(*args, **kwargs)
        traces[1]["batch_ids"] = {k: v.copy() for k, v in traces[0]["batch_ids"].items()}
        return traces

    monkeypatch.setattr(backend, "trace_ranks", fed_wrong)
    line = _finding(STOCK + "ddp", "--dp", "2", "--tp", "1")
    assert line.startswith("rank 1 holds rows 0:2 of tokens, not its claimed rows 2:4")


@pytest.mark.parametrize("recipe, extra, model", [
    ("fsdp", ("--dp", "2", "--tp", "1"), "mlp"),
    ("tp_mlp", ("--dp", "2", "--tp", "2"), "mlp"),
    ("fsdp_tp_mlp", ("--dp", "2", "--tp", "2"), "mlp"),
    ("fsdp", ("--dp", "2", "--tp", "1", "--vocab", "15"), "mlp"),  # embed's rows 8 and 7
    ("fsdp", ("--dp", "2", "--tp", "1"), "swiglu_regression"),  # the head's [1, h]: one rank's
])
def test_stock_recipes_still_verify(recipe: str, extra: tuple[str, ...], model: str) -> None:
    """Norm weights of ones match every piece; only the claimed one counts."""
    plan_s, plan_p = _trace(STOCK + recipe, *extra, model=model)
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message


def test_the_check_reads_the_values_before_the_step() -> None:
    """With an optimizer step the parameters change in place: what is
    compared is what was loaded."""
    plan_s, plan_p = _trace(STOCK + "fsdp", "--dp", "2", "--tp", "1", "--optimizer", "sgd")
    verdict = verify(plan_s, plan_p)
    assert verdict.success, verdict.message


def _two_ranks(full: np.ndarray, held: list[np.ndarray | None]):
    """A parameter ``w`` cut in two row blocks, rank r claiming block r and
    holding ``held[r]``."""
    n = full.shape[0] // 2
    plan = Plan(world={}, logical=[Logical("w", full.shape, "param")])
    for r in range(2):
        plan.tensors.append(Tensor(r, -1, 0, 0, (n, *full.shape[1:]), 0,
                                   ((r * n, (r + 1) * n), (0, full.shape[1])), (0, 1, 1)))
    single = {"loaded": {"params": {"w": full}, "buffers": {}}, "batch_ids": {}}
    traces = [{"loaded": {"params": {"w": h}, "buffers": {}}, "batch_ids": {}} for h in held]
    return single, traces, plan


def test_equal_pieces_are_no_finding() -> None:
    """A norm's ones match every piece: the claimed one is all that counts."""
    full = np.ones((4, 2))
    check_loaded(*_two_ranks(full, [full[:2].copy(), full[:2].copy()]))


def test_collective_values_are_not_compared() -> None:
    full = np.arange(8.0).reshape(4, 2)
    check_loaded(*_two_ranks(full, [full[:2].copy(), None]))


def test_values_of_no_piece_are_named_as_such() -> None:
    full = np.arange(8.0).reshape(4, 2)
    with pytest.raises(LoadedValueMismatch, match="rank 1 holds values of w that are not its "
                                                  "claimed rows 2:4"):
        check_loaded(*_two_ranks(full, [full[:2].copy(), -full[2:]]))
