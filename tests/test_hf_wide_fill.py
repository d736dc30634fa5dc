"""A constant filled with a number of the model's dtype that the default
dtype cannot hold is built in the model's dtype
(``backends/torch/zoo/hf_wide_fill.py``; docs/soundness.md, "Plans traced
from PyTorch", 117), and only such a constant: XGLM's float64 bound.
gloo: ``--hf xglm --dp 2 --tp 1`` same, ``--recipe ddp_avg`` differs."""

from __future__ import annotations

import pytest
import torch

from backends.torch.zoo.hf_wide_fill import WideFill, overflows_default

LOW = torch.finfo(torch.float64).min


def test_full_of_float64_bound_raises_without_the_mode() -> None:
    with pytest.raises(RuntimeError, match="overflow"):
        torch.full((), LOW)


@pytest.mark.parametrize("make", [lambda: torch.full((), LOW), lambda: torch.full((2,), fill_value=LOW),
                                  lambda: torch.scalar_tensor(LOW)])
def test_the_raising_fills_take_the_model_dtype(make) -> None:
    with WideFill(torch.float64):
        out = make()
    assert out.dtype == torch.float64 and bool((out == LOW).all())


@pytest.mark.parametrize("make", [lambda: torch.full((), -1.0), lambda: torch.full((), float("-inf")),
                                  lambda: torch.full((), LOW, dtype=torch.float64),
                                  lambda: torch.tensor(LOW), lambda: torch.full((), 3),
                                  lambda: torch.scalar_tensor(torch.finfo(torch.float32).min)])
def test_every_call_that_runs_is_unchanged(make) -> None:
    plain = make()
    with WideFill(torch.float64):
        moded = make()
    assert moded.dtype == plain.dtype and torch.equal(moded, plain)


def test_a_number_the_model_dtype_cannot_hold_still_raises() -> None:
    with WideFill(torch.float32), pytest.raises(RuntimeError, match="overflow"):
        torch.full((), LOW)


def test_overflow_is_the_checked_conversion() -> None:
    big = float(torch.finfo(torch.float32).max)
    assert not overflows_default(big) and overflows_default(big * 2) and not overflows_default(float("inf"))
    assert not overflows_default(10 ** 40)  # an int: no float fill


def test_xglm_runs_in_float64() -> None:
    from backends.torch.zoo import hf
    model = hf.build("xglm", **_sizes()).to(torch.float64)
    tokens = torch.zeros((2, 8), dtype=torch.long)
    model.global_tokens = tokens.numel()
    loss = model(tokens, tokens)
    assert next(model.parameters()).dtype == torch.float64 and torch.isfinite(loss)


def _sizes() -> dict:
    from backends.torch.__main__ import model_kwargs, parser
    args = parser().parse_args(["--hf", "xglm", "--dp", "1", "--tp", "1"])
    return model_kwargs(args)
