"""The demo model: a stack of bias-free linear layers; the loss is the
cross-entropy of the last layer's output against labels over the hidden size
(or, with ``loss="sum"``, the plain sum of that output)."""

from __future__ import annotations

import torch
from torch import nn

from gen_model import leaf
from gen_model.config import ModelConfig
from gen_model.models.loss import cross_entropy


class MLP(nn.Module):
    @staticmethod
    def inputs(cfg: ModelConfig, gbs: int) -> dict[str, tuple[tuple[int, ...], str]]:
        if cfg.loss == "sum":
            return {"x": ((gbs, cfg.hidden), "data")}
        return {"x": ((gbs, cfg.hidden), "data"), "labels": ((gbs, cfg.hidden), "tokens")}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(cfg.hidden, cfg.hidden, bias=False) for _ in range(cfg.layers)
        )
        self.plain_sum = cfg.loss == "sum"
        #: the real batch rows of a folded plan (gen_model/generate.py)
        self.loss_rows: int | None = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if self.plain_sum:
            return x.sum()
        return cross_entropy(x, leaf.one_hot(labels, x), self.loss_rows)
