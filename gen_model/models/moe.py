"""A DeepSeek-V3-style MoE transformer: Llama 3 attention, then a top-k router
over routed SwiGLU experts in the static capacity formulation, one shared
expert, and a weighted combine. The first ``first_dense`` layers are dense.
Each MoE layer also returns its load-balancing loss, which the model adds to
the cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gen_model import leaf
from gen_model.config import ModelConfig
from gen_model.models.llama3 import FeedForward, Llama3
from gen_model.models.loss import load_balancing_loss


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, f = cfg.experts, cfg.hidden, cfg.moe_ffn
        self.topk, self.capacity = cfg.topk, cfg.capacity
        self.experts, self.seqlen = cfg.experts, cfg.seqlen
        self.gate = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w3 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        self.shared = FeedForward(h, f)
        #: the real batch rows of a folded plan (gen_model/generate.py)
        self.loss_rows: int | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x)
        probs = torch.softmax(scores, dim=-1)
        dispatch = leaf.route(scores, self.topk, self.capacity)
        combine = torch.einsum("bsec,bse->bsec", dispatch, probs)
        xe = torch.einsum("bsec,bsh->bech", dispatch, x)
        h1 = torch.einsum("bech,efh->becf", xe, self.w1)
        h3 = torch.einsum("bech,efh->becf", xe, self.w3)
        ye = torch.einsum("becf,ehf->bech", F.silu(h1) * h3, self.w2)
        out = torch.einsum("bsec,bech->bsh", combine, ye) + self.shared(x)
        return out, load_balancing_loss(probs, dispatch, self.topk, self.experts, self.seqlen,
                                        self.loss_rows)


class MoETransformer(Llama3):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if layer < cfg.first_dense:
            return FeedForward(cfg.hidden, cfg.ffn)
        return MoE(cfg)
