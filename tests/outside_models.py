"""Small models written the way other code bases write them, kept outside the
backend's own model zoo (``backends/torch/zoo/stock_models.py``) and loaded as a
user loads theirs: ``--model tests.outside_models:NAME``.

Each factory takes the size keywords ``layers, hidden, heads, ffn, vocab,
seqlen`` and returns a module whose ``forward(tokens, labels)`` returns a
scalar loss. Two loss conventions occur, as in user code: a *share* of the
step's loss (a sum divided by ``global_tokens``, which the backend sets to
the step's label count; its gradients are summed over data-parallel
replicas) and the ordinary per-rank *mean* (averaged over replicas:
``ddp_avg``, FSDP2's default divide factor). The blocks are named ``h``,
``blocks`` or ``layers`` and the projections ``attn.q_proj``/``k_proj``/
``v_proj``/``o_proj``, ``mlp.c_fc``/``c_proj`` or ``gate``/``up``/``down``
where the stock tensor-parallel recipes should apply to them.

The last factories are models the backend must refuse in one line (dropout
with p > 0, control flow on a tensor's value).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _share(total: torch.Tensor, model: nn.Module, count: int) -> torch.Tensor:
    """A sum over the rank's items divided by the step's item count."""
    return total / (model.global_tokens or count)


def _causal_bool(seqlen: int) -> torch.Tensor:
    """True where a position may not attend (above the diagonal)."""
    return torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool), diagonal=1)


# -- nn.MultiheadAttention used directly ---------------------------------------------------


class MHABlock(nn.Module):
    """Post-norm block around ``nn.MultiheadAttention`` in the sequence-first
    layout (``batch_first=False``) with a boolean causal ``attn_mask`` and
    ``need_weights=False``; ``nn.Sequential`` MLP with ``nn.GELU(tanh)``;
    ``nn.LayerNorm(bias=False)``."""

    def __init__(self, hidden: int, heads: int, ffn: int, seqlen: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads)
        self.norm1 = nn.LayerNorm(hidden, bias=False)
        self.ffn = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(approximate="tanh"),
                                 nn.Linear(ffn, hidden))
        self.norm2 = nn.LayerNorm(hidden, bias=False)
        self.register_buffer("mask", _causal_bool(seqlen), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[0]
        a, _ = self.attn(x, x, x, attn_mask=self.mask[:s, :s], need_weights=False)
        x = self.norm1(x + a)
        return self.norm2(x + self.ffn(x))


class MHASeqFirstLM(nn.Module):
    """Language model over ``[S, B, H]`` activations, summed cross-entropy
    shared out over the step, an untied head."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seqlen, 1, hidden) * 0.02)
        self.blocks = nn.ModuleList(MHABlock(hidden, heads, ffn, seqlen) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.t()) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(x).transpose(0, 1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        return _share(loss, self, labels.numel())


class MHACausalBlock(nn.Module):
    """Pre-norm block: ``nn.MultiheadAttention(batch_first=True, bias=False)``
    with ``is_causal=True`` and its mask, ``need_weights=False``; a
    ``nn.LayerNorm(elementwise_affine=False)``; the MLP as ``mlp.c_fc``,
    ``mlp.c_proj`` with ``nn.SiLU``; scaled residuals."""

    def __init__(self, hidden: int, heads: int, ffn: int, seqlen: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(hidden, heads, bias=False, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(hidden, ffn), "act": nn.SiLU(),
                                  "c_proj": nn.Linear(ffn, hidden)})
        self.register_buffer("mask", _causal_bool(seqlen), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        h = self.ln(x)
        a, _ = self.attn(h, h, h, attn_mask=self.mask[:s, :s], is_causal=True, need_weights=False)
        x = x + 0.5 * a
        m = self.mlp
        return x + m["c_proj"](m["act"](m["c_fc"](self.ln2(x))))


class MHACausalLM(nn.Module):
    """Token and position embeddings, ``MHACausalBlock``s, the head's weight
    tied to the embedding (``self.head.weight = self.embed.weight``), the
    per-rank mean cross-entropy."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seqlen, hidden)
        self.h = nn.ModuleList(MHACausalBlock(hidden, heads, ffn, seqlen) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, tokens.size(1), dtype=torch.long, device=tokens.device).unsqueeze(0)
        x = self.embed(tokens) + self.pos(pos)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


# -- stock encoder and decoder layers -------------------------------------------------------


class SentenceClassifier(nn.Module):
    """BERT-like: token, position and token-type embeddings summed, a
    ``nn.LayerNorm(elementwise_affine=False)``, ``nn.TransformerEncoderLayer``
    (``norm_first=True``, ``activation="gelu"``, ``bias=False``) layers
    called with a causal mask and ``is_causal``, mean pooling over the
    sequence and a classification head, ``F.cross_entropy`` against
    ``labels[:, 0]`` (a mean over the rank's rows)."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 classes: int = 3):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(seqlen, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.emb_norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True, bias=False)
            for _ in range(layers))
        self.classifier = nn.Linear(hidden, classes)
        self.classes = classes

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        types = torch.zeros_like(tokens)
        types[:, s // 2:] = 1
        x = self.word(tokens) + self.position(torch.arange(s, device=tokens.device)) + self.token_type(types)
        x = self.emb_norm(x)
        mask = nn.Transformer.generate_square_subsequent_mask(s, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        pooled = x.mean(dim=1)
        return F.cross_entropy(self.classifier(pooled), labels[:, 0] % self.classes)


class DecoderRegressor(nn.Module):
    """``nn.TransformerDecoderLayer`` (pre-norm, GELU) attending to a memory
    made of the same ids' second embedding, a causal ``tgt_mask``; a
    regression head fitted with ``F.huber_loss`` (sum, shared out) to a
    fixed target table looked up by the labels."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.memory = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(hidden, heads, ffn, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.out = nn.Linear(hidden, 1)
        self.register_buffer("targets", torch.linspace(-2.0, 2.0, vocab), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x, mem = self.embed(tokens), self.memory(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, mem, tgt_mask=mask, tgt_is_causal=True)
        pred = self.out(x).squeeze(-1)
        return _share(F.huber_loss(pred, self.targets[labels], reduction="sum", delta=0.5), self,
                      labels.numel())


# -- attention by hand ---------------------------------------------------------------------


class HandRMSNorm(nn.Module):
    """``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight``,
    computed in float and cast back with ``type_as``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class EinsumAttention(nn.Module):
    """Separate q, k, v, o projections without bias, heads from the local
    width (``view(B, S, -1, D).transpose(1, 2)``), scores with
    ``torch.einsum``, a ``tril`` causal mask filled with -inf and
    ``F.softmax(dim=-1)``."""

    def __init__(self, hidden: int, heads: int, seqlen: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.register_buffer("tril", torch.tril(torch.ones(seqlen, seqlen)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.tril[:s, :s] == 0, float("-inf"))
        out = torch.einsum("bhqk,bhkd->bhqd", F.softmax(scores, dim=-1), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class EinsumBlock(nn.Module):
    """Hand RMSNorm, einsum attention, a SwiGLU MLP (``gate``, ``up``, ``down``)."""

    def __init__(self, hidden: int, heads: int, ffn: int, seqlen: int):
        super().__init__()
        self.attn_norm = HandRMSNorm(hidden)
        self.attn = EinsumAttention(hidden, heads, seqlen)
        self.mlp_norm = HandRMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class EinsumLM(nn.Module):
    """Llama-like decoder written by hand; the loss is
    ``F.nll_loss(F.log_softmax(logits))`` summed and shared out."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.global_tokens = 0
        self.tok = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(EinsumBlock(hidden, heads, ffn, seqlen) for _ in range(layers))
        self.norm = HandRMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        logp = F.log_softmax(self.lm_head(self.norm(x)).float(), dim=-1)
        loss = F.nll_loss(logp.flatten(0, 1), labels.flatten(), reduction="sum")
        return _share(loss, self, labels.numel())


class BaddbmmAttention(nn.Module):
    """Fused biased QKV split with ``torch.split``, heads by
    ``reshape``/``permute``, scores by ``torch.baddbmm`` onto an additive
    causal mask (0 / -inf, ``alpha`` the scale), ``.contiguous()``, the
    output projection ``c_proj``."""

    def __init__(self, hidden: int, heads: int, seqlen: int):
        super().__init__()
        self.heads, self.hidden = heads, hidden
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.hidden // self.heads
        q, k, v = self.qkv(x).split(self.hidden, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d).permute(0, 2, 1, 3).reshape(b * self.heads, s, d)
                   for t in (q, k, v))
        bias = self.mask[:s, :s].expand(b * self.heads, s, s)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=1.0 / math.sqrt(d))
        out = torch.bmm(scores.softmax(dim=-1), v)
        out = out.view(b, self.heads, s, d).permute(0, 2, 1, 3).contiguous().view(b, s, -1)
        return self.c_proj(out)


class BaddbmmBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, seqlen: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = BaddbmmAttention(hidden, heads, seqlen)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(hidden, ffn)
        self.mlp.c_proj = nn.Linear(ffn, hidden)
        self.act = nn.Mish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(self.act(self.mlp.c_fc(self.ln_2(x))))


class BaddbmmLM(nn.Module):
    """Blocks of ``BaddbmmAttention`` with an ``nn.Mish`` MLP; the
    cross-entropy written out with ``torch.logsumexp`` and ``gather``, a
    per-rank mean."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seqlen, hidden)
        self.h = nn.ModuleList(BaddbmmBlock(hidden, heads, ffn, seqlen) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return (torch.logsumexp(logits, dim=-1) - picked).mean()


# -- towers: activations, losses ------------------------------------------------------------


class ActivationTower(nn.Module):
    """An ``nn.Sequential`` of linear layers with ``nn.Hardtanh``,
    ``nn.LeakyReLU``, ``nn.ELU``, ``nn.Softplus`` and ``nn.Identity``,
    scaled residuals, fitted with ``F.huber_loss`` (mean) and
    ``F.mse_loss`` (sum), the two losses added, times 0.5."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn), nn.LeakyReLU(0.1), nn.Linear(ffn, hidden),
                          nn.Hardtanh(-2.0, 2.0), nn.Identity())
            for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ELU(), nn.Linear(hidden, hidden),
                                  nn.Softplus(), nn.Linear(hidden, 2))
        self.register_buffer("targets", torch.linspace(-1.0, 1.0, vocab * 2).view(vocab, 2),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + 0.5 * block(x)
        pred = self.head(x)
        target = self.targets[labels]
        return 0.5 * (F.huber_loss(pred, target, delta=0.3) + F.mse_loss(pred, target))


class GLUBlock(nn.Module):
    """``F.glu`` over one projection to ``2 * ffn``, then ``torch.addcmul``
    of the residual with a learned gate."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.proj = nn.Linear(hidden, 2 * ffn)
        self.out = nn.Linear(ffn, hidden)
        self.gain = nn.Parameter(torch.full((hidden,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x, self.gain, self.out(F.glu(self.proj(self.norm(x)), dim=-1)))


class GLUTagger(nn.Module):
    """Per-token binary tagging: GLU blocks, a one-logit head, and
    ``F.binary_cross_entropy_with_logits`` against ``labels % 2`` (sum,
    shared out over the step)."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(GLUBlock(hidden, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, 1)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logit = self.head(x).squeeze(-1)
        target = (labels % 2).to(logit.dtype)
        loss = F.binary_cross_entropy_with_logits(logit, target, reduction="sum")
        return _share(loss, self, labels.numel())


class Distiller(nn.Module):
    """A student tower fitted to a fixed teacher distribution (a softmax of
    a buffer table looked up by the labels) with
    ``F.kl_div(F.log_softmax(student), teacher, reduction="batchmean")``
    plus the hard-label cross-entropy, each weighted 0.5; ``gate``/``up``/
    ``down`` blocks with ``nn.GELU()``."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_GatedMLP(hidden, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("teacher", torch.linspace(-1.0, 1.0, vocab * vocab).view(vocab, vocab).sin(),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).flatten(0, 1)
        teacher = F.softmax(self.teacher[labels.flatten()], dim=-1)
        soft = F.kl_div(F.log_softmax(logits, dim=-1), teacher, reduction="batchmean")
        hard = F.cross_entropy(logits, labels.flatten())
        return 0.5 * soft + 0.5 * hard


class _GatedMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.gate = nn.Linear(hidden, ffn)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(self.act(self.gate(h)) * self.up(h))


class SigmoidTower(nn.Module):
    """``nn.Sequential`` tower with ``nn.Sigmoid``/``nn.Tanh``, an
    ``nn.ModuleDict`` of two heads whose losses are summed: a cross-entropy
    over the vocabulary (sum) and an L1 regression, both shared out."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_SigmoidBlock(hidden, ffn) for _ in range(layers))
        self.heads = nn.ModuleDict({"cls": nn.Linear(hidden, vocab), "reg": nn.Linear(hidden, 1)})

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.heads["cls"](x)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        reg = F.l1_loss(self.heads["reg"](x).squeeze(-1), labels.to(x.dtype) / 8.0, reduction="sum")
        return _share(ce + reg, self, labels.numel())


class _SigmoidBlock(nn.Module):
    """``mlp.c_fc`` / ``mlp.c_proj`` with a sigmoid-gated tanh."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(hidden, ffn)
        self.mlp.c_proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp.c_fc(x)
        return x + self.mlp.c_proj(torch.sigmoid(h) * torch.tanh(h))


# -- rotary embeddings with cos/sin, token mixing ----------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryAttention(nn.Module):
    """Hugging Face style: q, k, v, o projections, rotary embedding with
    ``cos``/``sin`` tables (``rotate_half`` by slicing and ``torch.cat``),
    SDPA with ``is_causal``."""

    def __init__(self, hidden: int, heads: int, seqlen: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(seqlen).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class RotaryBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, seqlen: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.attn = RotaryAttention(hidden, heads, seqlen)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(hidden, ffn)
        self.mlp.c_proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.post_attention_layernorm(x)),
                                          approximate="tanh"))


class RotaryLM(nn.Module):
    """Rotary decoder with a biased GELU MLP; the head tied through
    ``self.lm_head.weight = self.embed_tokens.weight``; the loss is the
    mean over the rank's tokens of two cross-entropies (plain, and with
    label smoothing written out as the mean negative log-probability), summed."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(RotaryBlock(hidden, heads, ffn, seqlen) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x)).flatten(0, 1)
        logp = torch.log_softmax(logits, dim=-1)
        return F.nll_loss(logp, labels.flatten()) + 0.1 * (-logp.mean(dim=-1)).mean()


class MixerBlock(nn.Module):
    """MLP-Mixer: a token-mixing ``nn.Linear(seqlen, seqlen)`` on
    ``x.transpose(1, 2)`` and a channel MLP (``mlp.c_fc``, ``mlp.c_proj``)
    with ``nn.GELU``, both pre-norm."""

    def __init__(self, hidden: int, ffn: int, seqlen: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.token_mix = nn.Linear(seqlen, seqlen)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(hidden, ffn))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(ffn, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(self.norm2(x))


class Mixer(nn.Module):
    """MLP-Mixer language model (the token mixing is not causal: each position
    sees the row), summed cross-entropy shared out over the step."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads
        self.global_tokens = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MixerBlock(hidden, ffn, seqlen) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), reduction="sum")
        return _share(loss, self, labels.numel())


class LSTMTagger(nn.Module):
    """``nn.LSTM`` (two layers, batch first) over the embedded ids, a
    per-token head, the mean cross-entropy over the rank's tokens; the
    blocks are the LSTM and the head (an ``nn.ModuleList`` named ``blocks``)."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, ffn, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([nn.LSTM(hidden, hidden, num_layers=layers + 1, batch_first=True),
                                     nn.Linear(hidden, vocab)])

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out, _ = self.blocks[0](self.embed(tokens))
        return F.cross_entropy(self.blocks[1](out).flatten(0, 1), labels.flatten())


class BatchNormRegressor(nn.Module):
    """A tower of ``nn.Linear`` -> ``nn.BatchNorm1d`` (over the flattened
    tokens) -> ``nn.ReLU`` blocks and a regression head, ``F.mse_loss``
    (mean) against a target table looked up by the labels. Under data
    parallelism each replica normalizes with its own rows' statistics
    (DDP without SyncBatchNorm), so its gradients are not the
    single-device step's: a real difference, not a false alarm."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn), nn.BatchNorm1d(ffn), nn.ReLU(), nn.Linear(ffn, hidden))
            for _ in range(layers))
        self.head = nn.Linear(hidden, 2)
        self.register_buffer("targets", torch.linspace(-1.0, 1.0, vocab * 2).view(vocab, 2),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(0, 1)
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(self.head(x), self.targets[labels.flatten()])


class _ConvBlock(nn.Module):
    """A causal depthwise ``nn.Conv1d`` over the sequence (padded by
    kernel - 1, the tail cut off, as Mamba-style and ConvNeXt-style blocks
    write it), a leaky ReLU written ``torch.maximum(h, 0.1 * h)``, a
    pointwise ``nn.Conv1d`` mixing channels, and an MLP
    (``mlp.c_fc``/``c_proj``, GELU), each a residual branch."""

    def __init__(self, hidden: int, ffn: int, kernel: int = 3):
        super().__init__()
        self.depthwise = nn.Conv1d(hidden, hidden, kernel, padding=kernel - 1, groups=hidden)
        self.pointwise = nn.Conv1d(hidden, hidden, 1)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(hidden, ffn), "c_proj": nn.Linear(ffn, hidden)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seqlen = x.shape[1]
        h = self.depthwise(x.transpose(1, 2))[..., :seqlen]
        h = torch.maximum(h, 0.1 * h)  # a leaky ReLU written by hand
        x = x + self.pointwise(F.silu(h)).transpose(1, 2)
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](x)))


class ConvTagger(nn.Module):
    """Token embedding, a tower of ``_ConvBlock``s, the features standardized
    by hand (``x.std``), a per-token head; the cross-entropy summed over the
    rank's tokens, its share of the step's."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_ConvBlock(hidden, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.global_tokens = 0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), reduction="sum")
        return _share(loss, self, labels.numel())


class ConvPoolClassifier(nn.Module):
    """A text CNN: embeddings, ``nn.Conv1d`` filters of widths 2 and 3 over
    the sequence, ReLU, max pooling over time written ``torch.amax``, a
    classification head on the concatenated pools, ``F.cross_entropy``
    against ``labels[:, 0] % 3`` (a mean over the rank's rows). The convs
    sit in ``blocks`` for the stock recipes."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 classes: int = 3):
        super().__init__()
        del layers, heads, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Conv1d(hidden, ffn, width, padding=width - 1) for width in (2, 3))
        self.classifier = nn.Linear(2 * ffn, classes)
        self.classes = classes

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(1, 2)
        pooled = torch.cat([torch.amax(F.relu(conv(x)), dim=-1) for conv in self.blocks], dim=-1)
        return F.cross_entropy(self.classifier(pooled), labels[:, 0] % self.classes)


class _UNetBlock(nn.Module):
    """A 1-d U-Net step over the sequence: an ``nn.Conv1d`` with
    ``padding_mode="reflect"``, GELU, a strided ``nn.Conv1d`` halving the
    length, ReLU, an ``nn.ConvTranspose1d`` doubling it back (with
    ``output_padding`` for an odd length), and a replicate-padded
    ``nn.Conv1d`` on the skip connection's sum."""

    def __init__(self, hidden: int, seqlen: int):
        super().__init__()
        self.smooth = nn.Conv1d(hidden, hidden, 3, padding=1, padding_mode="reflect")
        self.down = nn.Conv1d(hidden, hidden, 2, stride=2)
        self.up = nn.ConvTranspose1d(hidden, hidden, 2, stride=2, output_padding=seqlen % 2)
        self.mix = nn.Conv1d(hidden, hidden, 3, padding=1, padding_mode="replicate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        skip = F.gelu(self.smooth(h))
        h = self.up(F.relu(self.down(skip)))
        return x + self.mix(h + skip).transpose(1, 2)


class UNetTagger(nn.Module):
    """Token embedding, ``_UNetBlock``s, a per-token head; the cross-entropy
    summed over the rank's tokens, its share of the step's."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, ffn
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_UNetBlock(hidden, seqlen) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.global_tokens = 0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), reduction="sum")
        return _share(loss, self, labels.numel())


class MaxPoolClassifier(nn.Module):
    """A small CNN over the embedded sequence seen as a one-channel image:
    ``nn.Conv2d`` (3x3, padded), ReLU, ``nn.MaxPool2d(2, stride=1)``, then
    ``nn.MaxPool1d(2)`` over the features and the strongest position kept
    with ``h.max(dim=...).values`` (the gradient goes to the first maximum),
    a classification head whose logits are held above a learned floor
    (``torch.maximum`` of ``[batch, classes]`` and ``[classes]``, broadcast),
    ``F.cross_entropy`` against ``labels[:, 0] % 3``
    (a mean over the rank's rows). The convolution sits in ``blocks`` for
    the stock recipes."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 classes: int = 3, channels: int = 4):
        super().__init__()
        del layers, heads, ffn, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([nn.Conv2d(1, channels, 3, padding=1)])
        self.pool = nn.MaxPool2d(2, stride=1)
        self.feature_pool = nn.MaxPool1d(2)
        self.classifier = nn.Linear(channels * ((hidden - 1) // 2), classes)
        self.floor = nn.Parameter(torch.linspace(-0.3, 0.1, classes))
        self.classes = classes

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        image = self.embed(tokens).unsqueeze(1)  # (batch, 1, seqlen, hidden)
        h = self.pool(F.relu(self.blocks[0](image)))  # (batch, channels, seqlen - 1, hidden - 1)
        h = self.feature_pool(h.flatten(1, 2))  # (batch, channels * (seqlen - 1), (hidden - 1) // 2)
        h = h.unflatten(1, (-1, tokens.shape[1] - 1)).max(dim=2).values  # strongest position
        logits = torch.maximum(self.classifier(h.flatten(1)), self.floor)
        return F.cross_entropy(logits, labels[:, 0] % self.classes)


# -- refused: not exact arithmetic -----------------------------------------------------------


class DropoutMLP(nn.Module):
    """A tower with ``nn.Dropout(0.1)``: random, refused."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen, layers
        self.embed = nn.Embedding(vocab, hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, ffn), nn.ReLU(), nn.Dropout(0.1), nn.Linear(ffn, vocab))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.ff(self.embed(tokens)).flatten(0, 1), labels.flatten())


class PartialWrite(nn.Module):
    """A tensor written in place through a view of part of it
    (``y[:, 0] = 0``): the tensor with that column replaced."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen, layers, ffn
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        y = self.embed(tokens).clone()
        y[:, 0] = 0.0
        return F.cross_entropy(self.head(y).flatten(0, 1), labels.flatten())


class StridedWrite(PartialWrite):
    """A write through a strided view (every other token): the tensor with
    those tokens replaced."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        y = self.embed(tokens).clone()
        y[:, ::2] = 0.0
        return F.cross_entropy(self.head(y).flatten(0, 1), labels.flatten())


class BranchOnList(nn.Module):
    """Control flow on a value read with ``.tolist()``: refused."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen, layers, ffn
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if max(h.sum(-1).flatten().tolist()) > 1.0:
            h = h * 0.5
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class ScaleFromNumpy(nn.Module):
    """A scale computed with NumPy from the activations (``.numpy()``):
    a constant of this trace only, refused."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen, layers, ffn
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h / float(np.abs(h.detach().numpy()).max())
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class IdsReadAsList(nn.Module):
    """The batch's ids read with ``.tolist()`` (a fact of the batch, not of
    the parameters): the label count read from the list divides the loss."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen, layers, ffn
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count = len(labels.flatten().tolist())
        loss = F.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), labels.flatten(),
                               reduction="sum")
        return loss / count


class BranchOnValue(nn.Module):
    """Control flow on a tensor's value (``if h.sum() > 0``): refused."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen, layers, ffn
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if h.sum() > 0:
            h = h * 2.0
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class _SegmentBlock(nn.Module):
    """Attention over the tokens of the same segment (scores masked with
    -inf where two tokens' segments differ), each row weighted by whether
    its position lies below the row's length, then a GPT-2 style MLP."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(hidden, ffn), "c_proj": nn.Linear(ffn, hidden)})

    def forward(self, x: torch.Tensor, same: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = (self.query(h) @ h.transpose(1, 2)).masked_fill(~same, float("-inf"))
        x = x + (scores.softmax(-1) @ h) * weight[..., None]
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](x)))


class SegmentLengthLM(nn.Module):
    """Masks computed from counts of the ids, as CPM-Ant builds them: each
    row's length (its ids other than 0, counted), positions compared with it
    from the start (``arange(S) < length``) and from the end (a reversed
    range made from a Python list, ``<= length``), and segments (2 for an id
    other than 0, else 0, as int32) compared with each other as an attention
    mask; a tower of ``_SegmentBlock``s and a per-token head, the
    cross-entropy summed over the rank's tokens, its share of the step's."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del heads, seqlen
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_SegmentBlock(hidden, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.global_tokens = 0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, seqlen = tokens.shape
        ids = tokens.to(torch.int32)
        length = (ids != 0).sum(-1).to(torch.int32)
        ahead = torch.arange(seqlen)[None, :] < length[:, None]
        behind = torch.tensor(list(range(seqlen))[::-1])[None, :].repeat(batch, 1) <= length[:, None]
        segment = torch.where(ids != 0, 2, 0).to(torch.int32)
        same = segment[:, :, None] == segment[:, None, :]
        weight = ahead.to(torch.float64) + 0.5 * behind.to(torch.float64)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, same, weight)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), reduction="sum")
        return _share(loss, self, labels.numel())


def mha_seq_first(**kw) -> MHASeqFirstLM:
    return MHASeqFirstLM(**kw)


def mha_causal(**kw) -> MHACausalLM:
    return MHACausalLM(**kw)


def sentence_classifier(**kw) -> SentenceClassifier:
    return SentenceClassifier(**kw)


def decoder_regressor(**kw) -> DecoderRegressor:
    return DecoderRegressor(**kw)


def einsum_lm(**kw) -> EinsumLM:
    return EinsumLM(**kw)


def baddbmm_lm(**kw) -> BaddbmmLM:
    return BaddbmmLM(**kw)


def activation_tower(**kw) -> ActivationTower:
    return ActivationTower(**kw)


def glu_tagger(**kw) -> GLUTagger:
    return GLUTagger(**kw)


def distiller(**kw) -> Distiller:
    return Distiller(**kw)


def sigmoid_tower(**kw) -> SigmoidTower:
    return SigmoidTower(**kw)


def rotary_lm(**kw) -> RotaryLM:
    return RotaryLM(**kw)


def mixer(**kw) -> Mixer:
    return Mixer(**kw)


def lstm_tagger(**kw) -> LSTMTagger:
    return LSTMTagger(**kw)


def batchnorm_regressor(**kw) -> BatchNormRegressor:
    return BatchNormRegressor(**kw)


def conv_tagger(**kw) -> ConvTagger:
    return ConvTagger(**kw)


def conv_pool_classifier(**kw) -> ConvPoolClassifier:
    return ConvPoolClassifier(**kw)


def unet_tagger(**kw) -> UNetTagger:
    return UNetTagger(**kw)


def max_pool_classifier(**kw) -> MaxPoolClassifier:
    return MaxPoolClassifier(**kw)


def branch_on_list(**kw) -> BranchOnList:
    return BranchOnList(**kw)


def scale_from_numpy(**kw) -> ScaleFromNumpy:
    return ScaleFromNumpy(**kw)


def ids_read_as_list(**kw) -> IdsReadAsList:
    return IdsReadAsList(**kw)


def partial_write(**kw) -> PartialWrite:
    return PartialWrite(**kw)


def strided_write(**kw) -> StridedWrite:
    return StridedWrite(**kw)


def dropout_mlp(**kw) -> DropoutMLP:
    return DropoutMLP(**kw)


def branch_on_value(**kw) -> BranchOnValue:
    return BranchOnValue(**kw)



def segment_length_lm(**kw) -> SegmentLengthLM:
    return SegmentLengthLM(**kw)
