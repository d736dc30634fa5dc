"""A constant of the model's dtype built in torch's default dtype: the
factories that would raise on it build it in the model's dtype.

The backend builds every model in float64 (the exact counterpart of the
family's float32 run) and leaves torch's default dtype at float32. A
family may build a constant without a dtype and fill it with a number of
its model's dtype: XGLM's attention clamps its scores at
``torch.full((), torch.finfo(scores.dtype).min)``. In its float32 run that
is float32's smallest number in a float32 tensor; in the float64 model it
is float64's smallest number, which float32 cannot hold, and
``torch.full`` raises ("value cannot be converted to type float without
overflow"). Under ``WideFill`` such a call, and only such a call (one
that would raise), builds the constant in the model's dtype: the float64
model then does what its float32 run does, its own dtype's bound in a
tensor of its own dtype (docs/soundness.md, "Plans traced from PyTorch",
117). Every call that runs without it runs unchanged, so no other
family's plan changes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: the factories that build a tensor of torch's default dtype from a number
#: and raise when the number overflows it: ``torch.full(size, value)``,
#: ``torch.scalar_tensor(value)`` (``torch.tensor`` makes such a number
#: infinite instead of raising, and is left as it is)
FILLS = {torch.full: 1, torch.scalar_tensor: 0}


def overflows_default(value: Any) -> bool:
    """Whether ``value`` is a finite float that torch's default dtype cannot
    hold (``torch.full`` of it raises)."""
    if not isinstance(value, float) or not math.isfinite(value):
        return False
    return abs(value) > torch.finfo(torch.get_default_dtype()).max


class WideFill(TorchFunctionMode):
    """``torch.full`` and ``torch.scalar_tensor`` called without a dtype on a
    finite float the default dtype cannot hold build it in ``dtype``.
    Nothing else changes."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = FILLS.get(func)
        if at is not None and kwargs.get("dtype") is None and self._wider(_fill(at, args, kwargs)):
            kwargs = {**kwargs, "dtype": self.dtype}
        return func(*args, **kwargs)

    def _wider(self, value: Any) -> bool:
        """The model's dtype holds ``value`` where the default dtype cannot."""
        return overflows_default(value) and abs(value) <= torch.finfo(self.dtype).max


def _fill(at: int, args: tuple, kwargs: dict) -> Any:
    """The number a factory fills with: positional ``at`` or its keyword."""
    if len(args) > at:
        return args[at]
    return kwargs.get("fill_value", kwargs.get("s"))
