"""Tensors of no entries, a stack of scalars read whole, and the line of a
rank that raises (docs/soundness.md, "Plans traced from PyTorch", 110).

``no_entries_lm`` joins its keys with a compression of no windows and an
empty slice (DeepSeek-V4's compressor over fewer tokens than its window)
and reads ``scale.unbind(0)`` (HY-V4's hyper-connections: the gradient of
``scale`` is a stack of two scalars). DDP, tensor-parallel attention and
FSDP2 verify; the data-parallel sum left out for ``scale`` (named no
``weight``) or for every parameter FAILs. gloo agrees on each
(scripts/gloo_truth.py: same, same, same, differs, differs). A plan that
does not run (the queries split by heads, the keys left whole) is refused
in one line naming the module and that a real run raises it too."""

from __future__ import annotations

import shlex

import pytest
import torch

from backends.torch.__main__ import _rank_failed, parser, resolve, trace_and_build
from backends.torch.errors import LoweringError
from backends.torch.tracer.failure import failing_module, failure_line
from main import verify
from verdict.diagnosis import diagnose

MODEL = "--model tests.no_entries_models:no_entries_lm"
STOCK = "backends.torch.stock_recipes:"


def _verdict(recipe: str, tp: int):
    argv = f"{MODEL} --recipe {recipe} --dp 2 --tp {tp}"
    (plan_s, plan_p), _ = trace_and_build(resolve(parser().parse_args(shlex.split(argv))))
    verdict = verify(plan_s, plan_p)
    return verdict, "\n".join(diagnose(verdict, plan_s, plan_p))


@pytest.mark.parametrize(("recipe", "tp"), [("ddp", 1), ("tp_attention", 2), ("fsdp", 1)])
def test_empty_keys_and_a_stacked_gradient_verify(recipe: str, tp: int) -> None:
    verdict, _ = _verdict(STOCK + recipe, tp)
    assert verdict.success, verdict.message


def test_the_stacked_gradient_left_unreduced_fails() -> None:
    verdict, _ = _verdict(STOCK + "ddp_weights_only", 1)
    assert not verdict.success
    assert "layers.0.scale" in verdict.message, verdict.message


def test_no_dp_sum_with_empty_keys_fails() -> None:
    verdict, _ = _verdict(STOCK + "tp_attention_no_dp_sum", 2)
    assert not verdict.success
    assert verdict.kind != "internal", verdict.message


def test_a_plan_that_does_not_run_is_refused_in_one_line() -> None:
    argv = f"{MODEL} --recipe tests.no_entries_recipes:queries_only_tp --dp 1 --tp 2"
    with pytest.raises(LoweringError) as e:
        trace_and_build(resolve(parser().parse_args(shlex.split(argv))))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("rank 0 did not run: NoEntriesLM.layers.0.attn: RuntimeError"), line
    assert "a real run raises it too" in line, line


class _Inner(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 2)  # a shape error for x of width 2


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if x.sum() > 0 else x


def _raised(model: torch.nn.Module, x: torch.Tensor) -> RuntimeError:
    try:
        model(x)
    except RuntimeError as e:
        return e
    raise AssertionError("no error")


def test_the_failing_module_is_the_innermost_one_running() -> None:
    model = _Outer()
    e = _raised(model, torch.ones(2, 2))
    assert failing_module(e.__traceback__, model) == "_Outer.inner"


def test_a_real_run_is_claimed_only_without_computed_value_reads() -> None:
    model = _Outer()
    e = _raised(model, torch.ones(2, 2))
    params = {"w": (0, (2,), [[]])}
    clean = failure_line(e, model, params, [], set())
    assert clean.startswith("_Outer.inner: RuntimeError: ") and "a real run raises" in clean
    read = [("aten._local_scalar_dense.default", [[("v", 0)], {}], [1], [()], "", None, 0)]
    tainted = failure_line(e, model, params, read, set())
    assert "a real run" not in tainted, tainted
    index = failure_line(IndexError("index 7 is out of bounds"), model, params, [], set())
    assert "a real run" not in index, index


def test_an_hf_rank_failure_names_the_family_plan() -> None:
    args = parser().parse_args(["--dp", "2", "--tp", "2"])
    args.hf, args.recipe = "doge", "backends.torch.hf:tp_fsdp"
    line = _rank_failed(args, "rank 0 did not run: X.attn: RuntimeError: size")
    assert line == ("rank 0 did not run under transformers' own tensor-parallel plan for 'doge' "
                    "(tp 2, recipe tp_fsdp): X.attn: RuntimeError: size")
    assert _rank_failed(args, "another line") == "another line"
