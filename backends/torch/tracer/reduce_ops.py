"""A recorded collective's reduce op, with the factor of a pre-multiplied sum.

The dispatcher hands the recorder c10d's reduce op as a TorchScript object
whose one method is ``op()``: ``ReduceOp.PREMUL_SUM(f)`` (FSDP2's
float32 reduce-scatter under a divide factor, ``_get_gradient_divide_factors``)
arrives as op 8 without its factor ``f``. The factor is read from the
Python ``ReduceOp`` the collective was called with: the caller's ``op``
argument, or the ``reduceOp`` of its options (``ReduceScatterOptions``,
``AllreduceOptions``), in the nearest Python frame holding one
(docs/soundness.md, "Plans traced from PyTorch", 120 (d)).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch.distributed as dist

#: c10d's number of ``ReduceOp.PREMUL_SUM``
PREMUL_SUM = 8
#: how many Python frames above the dispatch mode are searched
_DEPTH = 32


def recorded_reduce_op(code: int) -> tuple:
    """``("redop", code)``; for PREMUL_SUM ``("redop", 8, factor)`` when the
    caller's Python reduce op holds a number (else without it: refused by the
    lowering)."""
    if code != PREMUL_SUM:
        return ("redop", code)
    factor = _premul_factor(sys._getframe(1))
    return ("redop", code) if factor is None else ("redop", code, factor)


def _premul_factor(frame: FrameType | None) -> float | None:
    for _ in range(_DEPTH):
        if frame is None:
            return None
        for name in ("opts", "op"):
            op = _reduce_op(frame.f_locals.get(name))
            if op is not None:
                factor = op.factor
                return float(factor) if isinstance(factor, (int, float)) else None
        frame = frame.f_back
    return None


def _reduce_op(x: Any) -> Any:
    """``x`` (or its options' ``reduceOp``) when it is a PREMUL_SUM reduce op."""
    op = getattr(x, "reduceOp", x)
    if isinstance(op, dist.ReduceOp) and op.op == dist.ReduceOp.PREMUL_SUM:
        return op
    return None
