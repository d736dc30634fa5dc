"""Models written the way most PyTorch code is, from stock ``torch.nn`` layers
and ``torch.nn.functional`` calls: a GPT-2 style language model and a
SwiGLU regression tower.

Both follow the backend's model contract (docs/torch-backend.md): the
factory takes the size keywords ``layers, hidden, heads, ffn, vocab,
seqlen``; ``forward(tokens, labels)`` takes integer ids ``[B, S]`` and
returns a scalar loss. With ``loss="share"`` (the default) the loss is
summed and divided by ``global_tokens`` (which the backend sets to the
label count of the whole step), so each rank's loss is its share of the
step's mean; ``loss="mean"`` is the ordinary per-rank mean
(``F.cross_entropy``'s and ``F.mse_loss``'s default reduction).

``llama_titan`` is the default Llama with torchtitan's attention (complex
rotary embedding, SDPA).

Heads are taken from the local width (``view(b, s, -1, head_dim)``), so
tensor parallelism of the projections needs no change to the module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.zoo.models import Llama, LlamaArgs


class CausalSelfAttention(nn.Module):
    """Fused QKV projection cut with ``chunk(3)``; causal attention through
    ``F.scaled_dot_product_attention`` (``attention="sdpa"``) or written out
    with an explicit lower-triangular mask (``attention="mask"``). With
    ``attention="split"``, separate ``q_proj``, ``k_proj``, ``v_proj``
    projections (the form tensor parallelism splits by heads) and SDPA."""

    def __init__(self, hidden: int, heads: int, seqlen: int, attention: str, dropout: float):
        super().__init__()
        self.head_dim = hidden // heads
        self.attention = attention
        if attention == "split":
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        else:
            self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.resid_dropout = nn.Dropout(dropout)
        if attention == "mask":
            self.register_buffer("bias", torch.tril(torch.ones(seqlen, seqlen)).view(1, 1, seqlen, seqlen),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.attention == "split":
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.attention in ("sdpa", "split"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / self.head_dim ** 0.5)
            att = att.masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(b, s, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, gelu: str, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(hidden, ffn)
        self.act = nn.GELU(approximate=gelu)
        self.c_proj = nn.Linear(ffn, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, seqlen: int, attention: str, gelu: str,
                 dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, seqlen, attention, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn, gelu, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Token and learned position embeddings, pre-LN blocks, a final
    LayerNorm and an output projection tied to the token embedding,
    cross-entropy against the labels."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 attention: str = "sdpa", gelu: str = "tanh", dropout: float = 0.0,
                 loss: str = "share", shift: bool = False):
        super().__init__()
        self.global_tokens = 0  # set by the backend: the labels of the whole step
        self.reduction, self.shift = loss, shift
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seqlen, hidden)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPT2Block(hidden, heads, ffn, seqlen, attention, gelu, dropout)
                               for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if self.shift:  # each position predicts the next label; the last one none (-100)
            labels = F.pad(labels[:, 1:], (0, 1), value=-100)
        flat, target = logits.view(-1, logits.size(-1)), labels.reshape(-1)
        if self.reduction == "mean":
            return F.cross_entropy(flat, target)
        return F.cross_entropy(flat, target, reduction="sum") / (self.global_tokens or target.numel())


class GQAttention(nn.Module):
    """Grouped-query attention as a user writes it: separate biased q, k, v
    projections with half as many key-value heads, and either SDPA with
    ``enable_gqa=True`` (``kind="gqa"``), or the keys and values repeated
    with ``repeat_interleave`` and the scores masked with
    ``torch.finfo(dtype).min`` by hand (``kind="finfo"``), or SDPA with an
    additive float mask built with ``torch.full(-inf).triu(1)``
    (``kind="additive"``)."""

    def __init__(self, hidden: int, heads: int, seqlen: int, kind: str):
        super().__init__()
        self.head_dim, self.kind, self.groups = hidden // heads, kind, 2
        kv = hidden // self.groups
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, kv)
        self.v_proj, self.o_proj = nn.Linear(hidden, kv), nn.Linear(hidden, hidden)
        self.register_buffer("future", torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)
                   for t in (self.q_proj(x), self.k_proj(x), self.v_proj(x)))
        if self.kind == "gqa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
            if self.kind == "finfo":
                att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
                att = att.masked_fill(self.future[:s, :s], torch.finfo(att.dtype).min)
                y = att.softmax(dim=-1) @ v
            else:
                mask = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class GQABlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, seqlen: int, kind: str):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden)
        self.attn = GQAttention(hidden, heads, seqlen, kind)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class GQALM(nn.Module):
    """A decoder with grouped-query attention (``GQAttention``), RMSNorm,
    SwiGLU, learned positions and an untied head. The cross-entropy ignores
    ``pad`` (``ignore_index``; -100 by default, which no label is), and is
    taken on ``[B, vocab, S]`` logits (``nll_loss2d``) when ``classes_second``;
    ``loss="share"`` sums and divides by ``global_tokens``, ``loss="mean"`` is
    ``F.cross_entropy``'s mean over the rank's kept labels."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 kind: str = "gqa", loss: str = "share", pad: int = -100,
                 classes_second: bool = False):
        super().__init__()
        self.global_tokens = 0  # set by the backend: the labels of the whole step
        self.reduction, self.pad, self.classes_second = loss, pad, classes_second
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seqlen, hidden)
        self.layers = nn.ModuleList(GQABlock(hidden, heads, ffn, seqlen, kind) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        if self.classes_second:
            logits, target = logits.transpose(1, 2), labels
        else:
            logits, target = logits.flatten(0, 1), labels.flatten()
        if self.reduction == "mean":
            return F.cross_entropy(logits, target, ignore_index=self.pad)
        return F.cross_entropy(logits, target, ignore_index=self.pad,
                               reduction="sum") / (self.global_tokens or labels.numel())


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class RegressionTower(nn.Module):
    """Embedded ids through residual SwiGLU blocks (pre-norm ``nn.RMSNorm``)
    and a head of ``outputs`` values per position, fitted with
    ``F.mse_loss`` to a fixed target table looked up by the labels. With
    ``loss="l1"`` or ``"smooth_l1"`` the embeddings are first scaled to unit
    length (``x / x.norm(dim=-1, keepdim=True)``) and the loss is
    ``F.l1_loss`` or ``F.smooth_l1_loss`` (beta 0.05), a mean over the rank's
    own values."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 outputs: int = 2, loss: str = "share"):
        super().__init__()
        del heads, seqlen  # the tower has no attention
        self.global_tokens = 0
        self.reduction = loss
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(SwiGLU(hidden, ffn) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs))
        self.register_buffer("targets", torch.linspace(-1.0, 1.0, vocab * outputs).view(vocab, outputs),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.reduction in ("l1", "smooth_l1"):
            x = x / x.norm(dim=-1, keepdim=True)
        for block in self.blocks:
            x = block(x)
        pred = self.head(x)
        target = F.embedding(labels, self.targets)
        if self.reduction == "l1":
            return F.l1_loss(pred, target)
        if self.reduction == "smooth_l1":
            return F.smooth_l1_loss(pred, target, beta=0.05)
        if self.reduction == "mean":
            return F.mse_loss(pred, target)
        return F.mse_loss(pred, target, reduction="sum") / (self.global_tokens or labels.numel())


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (its ``MultiheadAttention``, post-norm ReLU
    layers by default) over embedded ids and learned positions, a linear
    head of ``outputs`` values per position, ``F.mse_loss`` against a fixed
    target table looked up by the labels."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 outputs: int = 2, activation: str = "relu", norm_first: bool = False,
                 loss: str = "share"):
        super().__init__()
        self.global_tokens = 0
        self.reduction = loss
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seqlen, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, activation=activation,
                                           batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, outputs)
        self.register_buffer("targets", torch.linspace(-1.0, 1.0, vocab * outputs).view(vocab, outputs),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        pred = self.head(self.encoder(x))
        target = F.embedding(labels, self.targets)
        if self.reduction == "mean":
            return F.mse_loss(pred, target)
        return F.mse_loss(pred, target, reduction="sum") / (self.global_tokens or labels.numel())


def gpt2(**kw) -> GPT2:
    """GPT-2 style: SDPA causal attention, tanh GELU, tied embeddings."""
    return GPT2(**kw)


def gpt2_masked(**kw) -> GPT2:
    """GPT-2 style with the attention written out (explicit causal mask) and erf GELU."""
    return GPT2(**{"attention": "mask", "gelu": "none", **kw})


def gpt2_mean(**kw) -> GPT2:
    """gpt2 with F.cross_entropy's default mean over the rank's own tokens."""
    return GPT2(**{"loss": "mean", **kw})


def gpt2_shifted(**kw) -> GPT2:
    """gpt2_mean with the labels shifted inside the model (``F.pad(labels[:, 1:],
    (0, 1), value=-100)``): the mean over the rank's kept labels."""
    return GPT2(**{"loss": "mean", "shift": True, **kw})


def gpt2_split(**kw) -> GPT2:
    """gpt2 with separate q, k, v projections (``q_proj``, ``k_proj``, ``v_proj``)."""
    return GPT2(**{"attention": "split", **kw})


def gqa(**kw) -> GQALM:
    """The grouped-query decoder with SDPA's ``enable_gqa``."""
    return GQALM(**kw)


def gqa_finfo(**kw) -> GQALM:
    """The grouped-query decoder with ``repeat_interleave`` and a ``finfo.min`` fill."""
    return GQALM(**{"kind": "finfo", **kw})


def gqa_additive(**kw) -> GQALM:
    """The grouped-query decoder with an additive -inf mask, the loss on [B, vocab, S] logits."""
    return GQALM(**{"kind": "additive", "classes_second": True, **kw})


def gqa_pad(**kw) -> GQALM:
    """gqa whose cross-entropy ignores the pad id ``vocab // 2`` (a label that occurs)."""
    return GQALM(**{"pad": kw["vocab"] // 2, **kw})


def gqa_pad_mean(**kw) -> GQALM:
    """gqa_pad with the mean over the rank's kept labels (their count differs between ranks)."""
    return GQALM(**{"pad": kw["vocab"] // 2, "loss": "mean", **kw})


def encoder(**kw) -> Encoder:
    """nn.TransformerEncoder (post-norm, ReLU) with a regression head and F.mse_loss."""
    return Encoder(**kw)


def encoder_prenorm(**kw) -> Encoder:
    """The encoder with pre-norm GELU layers."""
    return Encoder(**{"activation": "gelu", "norm_first": True, **kw})


def mlp(**kw) -> RegressionTower:
    """The SwiGLU regression tower, F.mse_loss summed and shared out."""
    return RegressionTower(**kw)


def swiglu_regression(**kw) -> RegressionTower:
    """The tower with a one-value head ``nn.Linear(h, 1)``, F.mse_loss summed
    and shared out: under FSDP2 over two or more ranks the head's weight
    ``[1, h]`` and bias ``[1]`` live on the first rank, padded elsewhere."""
    return RegressionTower(**{"outputs": 1, **kw})


def swiglu_regression_mean(**kw) -> RegressionTower:
    """The one-value tower with F.mse_loss's default mean over the rank's own values."""
    return RegressionTower(**{"outputs": 1, "loss": "mean", **kw})


def mlp_mean(**kw) -> RegressionTower:
    """The regression tower with F.mse_loss's default mean over the rank's own values."""
    return RegressionTower(**{"loss": "mean", **kw})


def mlp_l1(**kw) -> RegressionTower:
    """The tower on unit-length embeddings with F.l1_loss (mean over the rank's values)."""
    return RegressionTower(**{"loss": "l1", **kw})


def mlp_smooth_l1(**kw) -> RegressionTower:
    """The tower on unit-length embeddings with F.smooth_l1_loss (beta 0.05, mean)."""
    return RegressionTower(**{"loss": "smooth_l1", **kw})


def rotary_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """torchtitan's rotary embedding of ``x`` [b, s, heads, head_dim]: pairs
    as complex numbers times unit complex numbers (``freqs_cis`` [s, head_dim/2])."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, x.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


class TitanAttention(nn.Module):
    """The Llama attention as torchtitan writes it: complex rotary embedding
    (a ``torch.polar`` buffer) and SDPA. Same parameters as
    ``backends.torch.models.Attention``, same call (the real rotary tables
    and the mask it is handed are not used), so the Llama recipes apply."""

    def __init__(self, args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.hidden, args.hidden, bias=False)
        self.wk = nn.Linear(args.hidden, args.hidden, bias=False)
        self.wv = nn.Linear(args.hidden, args.hidden, bias=False)
        self.wo = nn.Linear(args.hidden, args.hidden, bias=False)
        freqs = 1.0 / 10000.0 ** (torch.arange(0, args.head_dim, 2).double() / args.head_dim)
        angles = torch.outer(torch.arange(args.seqlen).double(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def forward(self, x, cos, sin, rot, mask):
        bs, seqlen, _ = x.shape
        q = rotary_complex(self.wq(x).view(bs, seqlen, -1, self.head_dim), self.freqs_cis[:seqlen])
        k = rotary_complex(self.wk(x).view(bs, seqlen, -1, self.head_dim), self.freqs_cis[:seqlen])
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def llama_titan(**kw) -> Llama:
    """The default Llama with torchtitan's attention (complex rotary, SDPA)."""
    model = Llama(LlamaArgs(**kw))
    for block in model.layers.values():
        block.attention = TitanAttention(model.args)
    return model
