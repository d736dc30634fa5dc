"""Models whose rows are added back by torchtitan's
``deterministic_scatter_add`` (torchtitan/ops/scatter_add.py): the
gpt_oss-like grouped experts of ``tests.grouped_bias_models`` with the
combine torchtitan writes and the down bias scaled in the forward as its
``ScaleBiasForward`` scales it under TP, and a tagger that adds computed
rows at a fixed index that repeats rows (the plain scatter_add along dim
0). Float64 but for the grouped GEMMs (float32, the CPU kernel's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.ops.scatter_add import deterministic_scatter_add

from tests.grouped_bias_models import BiasedGroupedExperts
from tests.routed_models import ClampedMoeTagger


class TitanCombinedExperts(BiasedGroupedExperts):
    """The grouped experts, the down bias divided by 2 before it is added
    (torchtitan's ``bias / tp_degree``), the rows combined by
    ``deterministic_scatter_add``."""
    down_bias_scale = 2.0

    def combine(self, x: torch.Tensor, at: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return deterministic_scatter_add(torch.zeros_like(x), at, y)


def titan_combined_tagger(**kw) -> ClampedMoeTagger:
    """The routed tagger of ``tests.routed_models`` on these experts."""
    return ClampedMoeTagger(**kw, experts=TitanCombinedExperts)


class ScatteredTagger(nn.Module):
    """Each token's row, projected, added into zeros at a fixed row (several
    tokens at one row, some rows none) by ``deterministic_scatter_add``,
    then to the rows, then a tagging loss."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int,
                 seqlen: int) -> None:
        super().__init__()
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        flat = h.reshape(-1, h.shape[-1])
        n = flat.shape[0]
        at = torch.tensor([(3 * i) % max(n - 1, 1) for i in range(n)])  # repeats, misses the last
        added = flat + deterministic_scatter_add(
            torch.zeros_like(flat), at[:, None].expand(-1, flat.shape[-1]),
            torch.tanh(self.proj(flat)))
        logits = self.head(added)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def scattered_tagger(**kw) -> ScatteredTagger:
    return ScatteredTagger(**kw)
