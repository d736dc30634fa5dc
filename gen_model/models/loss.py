"""The zoo's training losses, written with the operators the tracer lowers.

``cross_entropy`` is the numerically stable form Megatron's vocab-parallel
cross-entropy computes: the row maximum (detached: it only shifts the
exponentials), the log of the sum of the shifted exponentials, and the target
logit picked by the one-hot labels. Split along the vocabulary, each of the
three becomes a local op plus one all-reduce (max, sum, sum), which is how
the parallelizer lays it out. Per-token normalization divides the summed
token losses by the global token count, a constant of the graph. A folded
plan (docs/soundness.md, "Folded plans") is traced at fewer rows than the
real batch: ``count`` and ``rows`` then give the real counts, so the
constants are the real run's.
"""

from __future__ import annotations

import torch

#: Weight of the MoE load-balancing loss in the total loss.
AUX_LOSS_COEFF = 0.01


def cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                  count: int | None = None) -> torch.Tensor:
    """Mean over tokens of -log softmax(logits)[label]; ``target`` is one-hot
    over the last dim (for one-hot rows this is F.cross_entropy). ``count``
    is the number of tokens to divide by (default: those of ``logits``)."""
    top = logits.detach().amax(-1, keepdim=True)
    sumexp = (logits - top).exp().sum(-1, keepdim=True)
    picked = (logits * target).sum(-1, keepdim=True)
    per_token = sumexp.log() + top - picked
    return per_token.sum() / (per_token.numel() if count is None else count)


def load_balancing_loss(probs: torch.Tensor, dispatch: torch.Tensor, topk: int,
                        experts: int, seqlen: int, rows: int | None = None) -> torch.Tensor:
    """Sequence-wise balance loss (DeepSeek-V3): per sequence, the sum over
    experts of (fraction of the sequence's top-k slots dispatched to the
    expert, times E) times (the expert's mean routing probability), averaged
    over sequences. ``probs`` [B, S, E]; ``dispatch`` [B, S, E, C] carries no
    gradient. ``rows`` is the number of sequences to divide by (default B)."""
    load = dispatch.sum((1, 3)) * (experts / (topk * seqlen))
    per_seq = (load * probs.mean(1)).sum(-1)
    return per_seq.sum() / (per_seq.numel() if rows is None else rows) * AUX_LOSS_COEFF
