"""The demo model: a stack of bias-free linear layers; the loss is the
cross-entropy of the last layer's output against labels over the hidden size."""

from __future__ import annotations

import torch
from torch import nn

from gen_model import leaf
from gen_model.config import ModelConfig
from gen_model.models.loss import cross_entropy


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(cfg.hidden, cfg.hidden, bias=False) for _ in range(cfg.layers)
        )

    @staticmethod
    def inputs(cfg: ModelConfig, gbs: int) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"x": ((gbs, cfg.hidden), "data"), "labels": ((gbs, cfg.hidden), "tokens")}

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return cross_entropy(x, leaf.one_hot(labels, x))
