"""Models with the losses and masks people write around a GPT-2 style
decoder: label smoothing, padding (a pad id ignored by the loss, masked out
of attention as a key, ``nn.Embedding(padding_idx=...)``), sliding-window
attention, and the token-weighted mean whose count is all-reduced.

The model contract is the backend's (docs/torch-backend.md): the factory
takes ``layers, hidden, heads, ffn, vocab, seqlen``; ``forward(tokens,
labels)`` returns a scalar loss. The pad id is ``vocab // 2``, an id the
batch draws, so some labels are ignored and some keys are masked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backends.torch.zoo.stock_models import MLP


class MaskedAttention(nn.Module):
    """A fused QKV projection and SDPA with a boolean ``attn_mask``:
    ``mask="window"`` a causal sliding window of ``window`` keys (a constant
    pattern, -inf where hidden), ``mask="padding"`` causal attention to the
    keys that are not pads (each query also sees itself, so no row is
    empty), ``mask="padding_fill"`` the same written out with
    ``masked_fill(-inf)`` and ``softmax``."""

    def __init__(self, hidden: int, heads: int, mask: str, window: int = 2):
        super().__init__()
        self.head_dim, self.mask, self.window = hidden // heads, mask, window
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def keep(self, s: int, keys: torch.Tensor | None, device) -> torch.Tensor:
        i = torch.arange(s, device=device)
        causal = i[None, :] <= i[:, None]
        if self.mask == "window":
            return causal & (i[:, None] - i[None, :] < self.window)
        if keys is None:
            return causal
        return (causal & keys[:, None, None, :]) | torch.eye(s, dtype=torch.bool, device=device)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).chunk(3, dim=-1))
        keep = self.keep(s, keys, x.device)
        if self.mask == "padding_fill":
            att = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
            y = att.masked_fill(~keep, float("-inf")).softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


class MaskedBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, mask: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = MaskedAttention(hidden, heads, mask)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn, "tanh", 0.0)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), keys)
        return x + self.mlp(self.ln_2(x))


class MaskedLM(nn.Module):
    """Token and learned position embeddings, pre-LN blocks of
    ``MaskedAttention``, a final LayerNorm and an output projection, and
    ``F.cross_entropy`` with ``label_smoothing`` and, when ``pad`` is set,
    ``ignore_index=pad``. The loss: ``"share"`` summed and divided by
    ``global_tokens`` (the step's label count, set by the backend);
    ``"mean"`` the cross-entropy's mean over the rank's kept labels;
    ``"token_weighted"`` summed and divided by the count of kept labels,
    all-reduced over ``count_group`` when a recipe sets it (each rank then
    divides by the step's count)."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 mask: str = "causal", smoothing: float = 0.0, loss: str = "share",
                 pad: int | None = None, padding_idx: bool = False):
        super().__init__()
        self.global_tokens = 0
        self.count_group = None
        self.label_smoothing, self.reduction, self.pad = smoothing, loss, pad
        self.key_pad = pad  # the id masked out as a key: the tokenizer's pad id
        self.wte = nn.Embedding(vocab, hidden, padding_idx=pad if padding_idx else None)
        self.wpe = nn.Embedding(seqlen, hidden)
        self.h = nn.ModuleList(MaskedBlock(hidden, heads, ffn, mask) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        keys = None if self.key_pad is None else tokens != self.key_pad
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x, keys)
        logits = self.lm_head(self.ln_f(x)).flatten(0, 1)
        target = labels.flatten()
        ignore = -100 if self.pad is None else self.pad
        if self.reduction == "mean":
            return F.cross_entropy(logits, target, ignore_index=ignore,
                                   label_smoothing=self.label_smoothing)
        total = F.cross_entropy(logits, target, reduction="sum", ignore_index=ignore,
                                label_smoothing=self.label_smoothing)
        if self.reduction == "token_weighted":
            count = (target != ignore).sum()
            if self.count_group is not None:
                dist.all_reduce(count, group=self.count_group)
            return total / count
        return total / (self.global_tokens or target.numel())


def smooth(**kw) -> MaskedLM:
    """Causal attention, the cross-entropy with label smoothing 0.1, shared out."""
    return MaskedLM(**{"smoothing": 0.1, **kw})


def smooth_mean(**kw) -> MaskedLM:
    """Label smoothing 0.1, the mean over the rank's own tokens."""
    return MaskedLM(**{"smoothing": 0.1, "loss": "mean", **kw})


def smooth_pad(**kw) -> MaskedLM:
    """Label smoothing 0.1 with the pad id ignored, shared out."""
    return MaskedLM(**{"smoothing": 0.1, "pad": kw["vocab"] // 2, **kw})


def smooth_pad_mean(**kw) -> MaskedLM:
    """Label smoothing 0.1 with the pad id ignored, the mean over the rank's
    kept labels (their count differs between ranks)."""
    return MaskedLM(**{"smoothing": 0.1, "pad": kw["vocab"] // 2, "loss": "mean", **kw})


def window(**kw) -> MaskedLM:
    """A causal sliding window of two keys as SDPA's boolean mask."""
    return MaskedLM(**{"mask": "window", **kw})


def padded(**kw) -> MaskedLM:
    """Pads masked out as keys (a mask from the ids), ignored by the loss,
    and the pad row of the embedding frozen by ``padding_idx``."""
    return MaskedLM(**{"mask": "padding", "pad": kw["vocab"] // 2, "padding_idx": True, **kw})


def padded_fill(**kw) -> MaskedLM:
    """``padded`` with the attention written out: ``masked_fill(-inf)``, softmax."""
    return MaskedLM(**{"mask": "padding_fill", "pad": kw["vocab"] // 2, "padding_idx": True,
                       **kw})


def token_weighted(**kw) -> MaskedLM:
    """``padded`` with label smoothing and the loss summed and divided by
    the count of kept labels (all-reduced when a recipe sets ``count_group``)."""
    return MaskedLM(**{"mask": "padding", "pad": kw["vocab"] // 2, "padding_idx": True,
                       "smoothing": 0.1, "loss": "token_weighted", **kw})
