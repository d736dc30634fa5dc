"""Labels masked the usual ways before the cross-entropy ignores them: the
pad id (``vocab // 2``, an id the batch draws) replaced by -100 with
``masked_fill``, ``torch.where`` or an in-place write at the mask, and the
loss ``F.cross_entropy(..., ignore_index=-100)`` summed and shared out over
the step's tokens (``share``) or averaged over the rank's kept labels
(``mean``). A GPT-2 style decoder (backends/torch/loss_models.MaskedLM)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.torch.zoo.loss_models import MaskedLM


class LabelMaskedLM(MaskedLM):
    def __init__(self, how: str, loss: str = "share", **kw):
        super().__init__(**kw)
        self.how, self.loss, self.label_pad = how, loss, kw["vocab"] // 2

    def masked(self, labels: torch.Tensor) -> torch.Tensor:
        pad = labels == self.label_pad
        if self.how == "masked_fill":
            return labels.masked_fill(pad, -100)
        if self.how == "where":
            return torch.where(pad, -100, labels)
        out = labels.clone()
        out[pad] = -100
        return out

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.how == "doubled":  # ids read as numbers: refused, naming the op and the ids
            labels = (labels * 2) % self.wte.num_embeddings
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x, None)
        logits = self.lm_head(self.ln_f(x)).flatten(0, 1)
        target = self.masked(labels).flatten()
        if self.loss == "mean":
            return F.cross_entropy(logits, target, ignore_index=-100)
        total = F.cross_entropy(logits, target, reduction="sum", ignore_index=-100)
        return total / (self.global_tokens or target.numel())


def masked_fill(**kw) -> LabelMaskedLM:
    return LabelMaskedLM("masked_fill", **kw)


def where(**kw) -> LabelMaskedLM:
    return LabelMaskedLM("where", **kw)


def index_put(**kw) -> LabelMaskedLM:
    return LabelMaskedLM("index_put", **kw)


def masked_fill_mean(**kw) -> LabelMaskedLM:
    return LabelMaskedLM("masked_fill", loss="mean", **kw)


def doubled(**kw) -> LabelMaskedLM:
    """Labels doubled as numbers (``(labels * 2) % vocab``): no lowering reads ids so."""
    return LabelMaskedLM("doubled", **kw)
