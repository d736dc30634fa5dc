"""A transformers family whose code asks for float32 where its float64
model then does not run: its float32 casts read as float64 casts.

The backend builds every model in float64 (the tracer's ``in_float64``,
``gloo_truth``'s ``.to(torch.float64)``), the exact counterpart of the
family's float32 run. A family may cast to float32 itself, relying on a
weight it keeps in float32 under any precision (its
``_keep_in_fp32_modules_strict``): a router running ``F.linear(h.float(),
self.weight)``. In its float32 run that cast changes nothing; in the
float64 model it meets a float64 weight and fails ("expected m1 and m2 to
have the same dtype"), and keeping the weight in float32 instead is
refused by FSDP2 (one dtype per group). For such a family, and only when
its float64 model fails on a dtype and runs with them, the casts to
float32 in its forward are read as casts to float64 (``Float32Read``): the
float64 model then does what its float32 run does, a cast that changes
nothing (docs/soundness.md, "Plans traced from PyTorch", 109). A family
whose float64 model runs is left as it is, so no other family's plan
changes.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def _wide(value: Any) -> Any:
    """``value`` with float32 read as float64 (a dtype or its name)."""
    return torch.float64 if value is torch.float32 else value


class Float32Read(TorchFunctionMode):
    """Every call of the forward that names float32 as a dtype (an
    argument or a keyword: ``.to(torch.float32)``, ``dtype=torch.float32``,
    ``.type(torch.float32)``) names float64, and ``Tensor.float`` is
    ``Tensor.double``. Nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(_wide(a) for a in args)
        kwargs = {k: _wide(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def strict(hf: nn.Module) -> bool:
    """The family keeps some tensors in float32 under any precision."""
    return bool(getattr(hf, "_keep_in_fp32_modules_strict", None))


def _runs(hf: nn.Module, widened: bool, seqlen: int) -> str | None:
    """Run a float64 copy of ``hf`` on a row of zero ids without gradients
    (under ``Float32Read`` when ``widened``), the random state untouched:
    None when it runs, else the error's text."""
    with torch.random.fork_rng(), torch.no_grad():
        try:
            trial = copy.deepcopy(hf).to(torch.float64)
            with Float32Read() if widened else contextlib.nullcontext():
                trial(input_ids=torch.zeros((1, seqlen), dtype=torch.long), use_cache=False)
        except Exception as e:  # noqa: BLE001 - any failure: the text decides, the build goes on
            return f"{type(e).__name__}: {e}"
    return None


def reads_float32_wide(hf: nn.Module, seqlen: int) -> bool:
    """Whether the family's forward is to run under ``Float32Read``: it
    keeps tensors in float32 under any precision, its float64 model fails
    on a dtype, and runs under ``Float32Read``."""
    if not strict(hf):
        return False
    failed = _runs(hf, False, seqlen)
    return failed is not None and failed.startswith("RuntimeError") and "dtype" in failed \
        and _runs(hf, True, seqlen) is None
