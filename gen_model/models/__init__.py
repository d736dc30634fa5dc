"""The model zoo: torch modules the tracer turns into plans."""

from __future__ import annotations

import torch
from torch import nn

from gen_model.config import ModelConfig
from gen_model.models.llama3 import Llama3
from gen_model.models.mlp import MLP
from gen_model.models.moe import MoETransformer

ZOO: dict[str, type[nn.Module]] = {"mlp": MLP, "llama3": Llama3, "moe": MoETransformer}


def build(cfg: ModelConfig, device: str = "meta", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Instantiate a model; on the meta device its parameters take no memory."""
    cfg.check()
    with torch.device(device):
        return ZOO[cfg.model](cfg).to(dtype)
