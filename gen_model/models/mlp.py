"""The demo model: a stack of bias-free linear layers, loss = sum of the output."""

from __future__ import annotations

import torch
from torch import nn

from gen_model.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(cfg.hidden, cfg.hidden, bias=False) for _ in range(cfg.layers)
        )

    @staticmethod
    def inputs(cfg: ModelConfig, gbs: int) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"x": ((gbs, cfg.hidden), "data")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()
