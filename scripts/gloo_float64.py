"""``scripts/gloo_truth.py`` with every step in float64, grouped experts too.

    .venv/bin/python scripts/gloo_float64.py --model titan:gpt_oss \\
        --recipe backends.torch.zoo.titan_scaled_bias:parallelize \\
        --dp 1 --tp 2 --vocab 2048 --batch 2 --rtol 1e-6

torchtitan's grouped experts cast their operands with ``.bfloat16()``
before ``torch._grouped_mm`` (whose CPU kernel takes no float64), so
gloo_truth compares such models at ``--rtol 2e-2``, too loose to tell a
gradient that misses a small term. Here, in every process (the spawned
ranks import this module as their main one), ``Tensor.bfloat16`` returns
its tensor unchanged and ``torch._grouped_mm`` of float64 operands is
computed group by group with ``@`` (rows ``offs[g-1]:offs[g]`` times
``B[g]``, the rows past the last offset zero, as the kernel leaves them);
autograd differentiates those ops. Other dtypes go to the kernel. What
remains rounds like the model's own float32 parts (a router's
``float()``): about 1e-7.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

_KERNEL = torch._grouped_mm


def _unchanged(self: torch.Tensor, memory_format=None) -> torch.Tensor:
    """``Tensor.bfloat16`` made the identity."""
    return self


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
               **kwargs) -> torch.Tensor:
    """A 2-D ``a`` times 3-D ``b`` by groups of rows, in a's float64; the
    kernel for any other case."""
    if a.dtype != torch.float64 or offs is None or a.dim() != 2 or b.dim() != 3 or kwargs:
        return _KERNEL(a, b, offs=offs, **kwargs)
    ends = [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    parts = [a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))]
    parts.append(a.new_zeros(a.shape[0] - (ends[-1] if ends else 0), b.shape[-1]))
    return torch.cat(parts)


torch.Tensor.bfloat16 = _unchanged
torch._grouped_mm = grouped_mm

import gloo_truth  # noqa: E402

if __name__ == "__main__":
    sys.exit(gloo_truth.main())
