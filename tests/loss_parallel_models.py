"""Losses written on the log-probabilities themselves, as used under DTensor's
``loss_parallel()`` (the logits sharded along the vocabulary): the
log-softmax of the 3-D logits, flattened, then ``F.nll_loss``; and label
smoothing as a second reader of the same log-probabilities (pytorch issue
190746's mechanism), ``(1 - eps) * nll - eps * mean(logp)`` per token. A
``backends.torch.models.Llama`` with another ``loss``; the loss is summed
and divided by the step's token count (``global_tokens``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.torch.zoo.models import Llama, LlamaArgs

EPS = 0.1


class LogProbLlama(Llama):
    def __init__(self, args: LlamaArgs, smoothing: float = 0.0):
        super().__init__(args)
        self.smoothing = smoothing

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=-1)
        flat = logp.flatten(0, 1)
        total = F.nll_loss(flat, labels.flatten(), reduction="sum")
        if self.smoothing:
            uniform = -flat.mean(dim=-1).sum()
            total = (1 - self.smoothing) * total + self.smoothing * uniform
        return total / (self.global_tokens or labels.numel())


def log_softmax_nll(**kw) -> LogProbLlama:
    """``log_softmax`` of ``[B, S, V]`` logits, ``flatten(0, 1)``, ``nll_loss``."""
    return LogProbLlama(LlamaArgs(**kw))


def log_softmax_smoothed(**kw) -> LogProbLlama:
    """The same with label smoothing 0.1 read off the log-probabilities."""
    return LogProbLlama(LlamaArgs(**kw), smoothing=EPS)
