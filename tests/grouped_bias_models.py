"""A token tagger whose experts run as torchtitan's gpt_oss runs them: the
(token, slot) pairs sorted by expert (``x[order // K]``), one grouped GEMM
per projection (``torch._grouped_mm``, in float32: the CPU kernel takes no
float64), each expert's bias picked per row as
``cat([b, zeros]).repeat_interleave(counts)``, the interleaved gate and up
columns clamped at a small limit (so the clamps bind), the rows weighted
by their gates and added back at their tokens (``scatter_add``). The rest
of the model is float64."""

from __future__ import annotations

import torch
from torch import nn

from tests.routed_models import ClampedMoeTagger


def _bias_rows(b: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert's bias, with a row of zeros for rows past the
    experts (torchtitan's tail slack)."""
    tail = torch.tensor([rows], dtype=counts.dtype) - counts.sum()
    padded = torch.cat([b, b.new_zeros(1, b.shape[-1])])
    return padded.repeat_interleave(torch.cat([counts, tail]), dim=0, output_size=rows)


class BiasedGroupedExperts(nn.Module):
    #: the down bias divided by this before it is added (None: added as it is)
    down_bias_scale: float | None = None

    def __init__(self, experts: int, hidden: int, ffn: int, limit: float) -> None:
        super().__init__()
        self.experts = experts
        self.limit = limit
        self.w1 = nn.Parameter(torch.randn(experts, hidden, 2 * ffn) / hidden ** 0.5)
        self.b1 = nn.Parameter(torch.randn(experts, 2 * ffn) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden) / ffn ** 0.5)
        self.b2 = nn.Parameter(torch.randn(experts, hidden) * 0.1)

    def forward(self, x: torch.Tensor, index: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        k = index.shape[1]
        rows = index.numel()
        with torch.no_grad():
            order = torch.argsort(index.reshape(-1), stable=True)
            counts = torch.bincount(index.reshape(-1), minlength=self.experts)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
        picked = x[order // k]
        h = torch._grouped_mm(picked.float(), self.w1.float(), offs=offs).double()
        h = h + _bias_rows(self.b1, counts, rows)
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(1.702 * gate)
        act = torch.addcmul(glu, glu, up)
        y = torch._grouped_mm(act.float(), self.w2.float(), offs=offs).double()
        down_bias = _bias_rows(self.b2, counts, rows)
        if self.down_bias_scale is not None:
            down_bias = down_bias / self.down_bias_scale
        y = y + down_bias
        y = y * gates.reshape(-1)[order][:, None]
        at = (order // k)[:, None].expand(-1, x.shape[-1])
        return self.combine(x, at, y)

    def combine(self, x: torch.Tensor, at: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The weighted rows added back at their tokens."""
        return torch.zeros_like(x).scatter_add(0, at, y)


def biased_grouped_tagger(**kw) -> ClampedMoeTagger:
    """The routed tagger of ``tests.routed_models`` on these experts."""
    return ClampedMoeTagger(**kw, experts=BiasedGroupedExperts)
