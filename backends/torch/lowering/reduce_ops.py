"""c10d reduce ops as recorded (``tracer/reduce_ops.py``): ``("redop", n)``,
and ``("redop", 8, f)`` for ``ReduceOp.PREMUL_SUM(f)``, the sum of every
member's input times ``f`` (docs/soundness.md, "Plans traced from PyTorch",
120 (d))."""

from __future__ import annotations

from typing import Any

#: c10d's numbers of the reduce ops lowered: SUM, AVG, PREMUL_SUM
SUM, AVG, PREMUL_SUM = 0, 1, 8


def premul_factor(op: Any) -> float | None:
    """The factor ``f`` of a recorded ``PREMUL_SUM(f)`` (None for any other op,
    or a PREMUL_SUM whose factor was not recorded)."""
    if isinstance(op, (list, tuple)) and len(op) == 3 and op[0] == "redop" \
            and op[1] == PREMUL_SUM and isinstance(op[2], (int, float)):
        return float(op[2])
    return None
