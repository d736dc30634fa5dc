"""Circular padding (``F.pad(x, pad, mode="circular")``, and so
``nn.Conv*d(padding_mode="circular")``, which pads its input that way) run
as the concatenation of x's wrapped-around slices.

Torch's own circular padding writes x and its wrapped edges into slices of
an empty tensor (``copy_`` into views), which the lowering refuses as a
write into part of a tensor. Every padded position is a copy of one input
position (before: the last ``before`` positions of the dim, after: the
first ``after``), so along each padded dim the result is

    cat([x.narrow(d, n - before, before), x, x.narrow(d, 0, after)], d)

the same values, with the adjoint of those copies as its backward
(docs/soundness.md, "Plans traced from PyTorch", 27). The recorder runs
this form in place of torch's whenever every padding is between 0 and the
dim's size; other paddings (negative ones, which crop) reach torch's kernel
and are refused as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def circular_pad(x: torch.Tensor, pad: Sequence[int]) -> torch.Tensor | None:
    """x padded circularly by ``pad`` (F.pad's list, last dim first) as a
    concatenation of slices, or None where torch's kernel is left to run:
    a padding outside ``[0, size]``, or a pad list of a length torch does
    not take for x's dims (1, 2 or 3 padded dims of an input with one or
    two more: torch raises)."""
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 not in (1, 2, 3) or x.dim() - len(pad) // 2 not in (1, 2):
        return None
    dims = [(x.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]
    if any(not (0 <= b <= x.shape[d] and 0 <= a <= x.shape[d]) for d, b, a in dims):
        return None
    for d, before, after in dims:
        n = x.shape[d]
        pieces = [x.narrow(d, n - before, before)] if before else []
        pieces.append(x)
        if after:
            pieces.append(x.narrow(d, 0, after))
        x = torch.cat(pieces, d) if len(pieces) > 1 else x
    return x


class CircularPad(TorchFunctionMode):
    """Runs ``F.pad(..., mode="circular")`` as ``circular_pad``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.pad and args:
            mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
            pad = args[1] if len(args) > 1 else kwargs.get("pad")
            if mode == "circular" and isinstance(args[0], torch.Tensor) and pad is not None:
                out = circular_pad(args[0], pad)
                if out is not None:
                    return out
        return func(*args, **kwargs)
