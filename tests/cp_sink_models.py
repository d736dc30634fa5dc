"""cp: a causal attention tagger with attention sinks, as gpt-oss has them
(transformers' ``gpt_oss`` eager attention): each head has a learnable
"sink" logit; the softmax runs over a query row's scores and the sink, and
the sink's column is dropped before the values are read, so a row's
weights sum to less than one. Its context-parallel recipes are in
tests/cp_sink_recipes.py.

The attention is written out in torch ops (matmul, the causal mask, the
sink column, the softmax, the sink column dropped, matmul). Under context
parallelism a rank holds its chunk of the queries and all-gathers the
keys and values (``kv_group``, set by a recipe); its mask is the rows of
the causal mask at its positions (``cp_rank``). ``fault`` names a
shipped mistake: ``"no_sinks"`` (prime-rl PR 3397's mechanism: the
attention of a context-parallel rank drops the sinks) or ``"sink_per_chunk"``
(the sink appended to the scores of each gathered chunk, so that it enters
the normalizer once per rank of the ring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   offset: int = 0, chunks: int = 1, fault: str = "") -> torch.Tensor:
    """Causal attention with one sink logit per head: q [b, h, sq, d] (the
    query rows at positions ``offset``..), k and v [b, h, sk, d]. With
    ``chunks`` > 1 the keys are that many equal chunks (the members'
    pieces an all-gather joined), which ``fault`` may treat apart."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) / d ** 0.5
    rows = torch.arange(offset, offset + sq)[:, None]
    cols = torch.arange(sk)[None, :]
    # an additive mask of the lowest finite value, as transformers' eager masks write it
    mask = torch.zeros(sq, sk, dtype=scores.dtype).masked_fill(cols > rows,
                                                               torch.finfo(scores.dtype).min)
    scores = scores + mask
    sink = sinks.reshape(1, h, 1, 1).expand(b, h, sq, 1)
    if fault == "no_sinks":
        return torch.matmul(F.softmax(scores, dim=-1), v)
    if fault == "sink_per_chunk":
        pieces = scores.chunk(chunks, dim=-1)
        logits = torch.cat([t for p in pieces for t in (p, sink)], dim=-1)
        keep = torch.cat([torch.ones(p.shape[-1], dtype=torch.bool) if i % 2 == 0 else
                          torch.zeros(1, dtype=torch.bool)
                          for p in pieces for i in range(2)])
        probs = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)
        return torch.matmul(probs[..., keep], v)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1)
    return torch.matmul(probs[..., :-1], v)


class SinkTagger(nn.Module):
    """Embedding, one causal attention layer with sinks (a residual), and a
    tagging head; the loss the sum of the token losses over the whole
    step's token count."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del layers, ffn, seqlen
        self.global_tokens = 0
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.sinks = nn.Parameter(torch.randn(heads))
        self.head = nn.Linear(hidden, vocab)
        #: the context-parallel group the keys and values are all-gathered over
        self.kv_group = None
        #: this rank's index over cp: its query rows start at cp_rank * its length
        self.cp_rank = 0
        self.fault = ""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(h).chunk(3, dim=-1))
        # keys and values sequence first (as Megatron lays them out), all-gathered
        # along it under context parallelism; on one device the same views
        k, v = (t.permute(2, 0, 1, 3).contiguous() for t in (k, v))
        if self.kv_group is not None:
            import torch.distributed._functional_collectives as funcol
            k, v = (funcol.all_gather_single_autograd(t, 0, self.kv_group) for t in (k, v))
        k, v = (t.permute(1, 2, 0, 3) for t in (k, v))
        chunks = k.shape[2] // s
        y = sink_attention(q, k, v, self.sinks, self.cp_rank * s, chunks, self.fault)
        y = y.transpose(1, 2).reshape(b, s, d)
        logits = self.head(h + y).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def sink_tagger(**kw) -> SinkTagger:
    return SinkTagger(**kw)


FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def fold_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention's (out, lse) merged with the sink as one more block (a
    block of one key, its score the head's sink, its value 0), in the
    sigmoid form PyTorch's ring merges with: ``out - sigmoid(sink - lse)
    (out - 0)``, ``lse - logsigmoid(lse - sink)``."""
    sink = sinks.view(1, -1, 1)
    out = out * torch.sigmoid(lse - sink).unsqueeze(-1)
    return out, lse - F.logsigmoid(lse - sink)


class SinkFlashAttention(torch.autograd.Function):
    """Causal attention with sinks as kernels with an ``s_aux`` compute it:
    the flash kernel's (out, lse), the sink folded into them once
    (``fold_sink``); the backward is the flash kernel's at the folded out
    and lse (the gradient of the sink attention's scores: the sink's column
    has value 0) and the sink's own, ``-exp(sink - lse) (dout . out)``
    summed over the rows. With ``mesh`` (a one-dim "cp" mesh) q, k and v
    are its ranks' chunks of the sequence, wrapped as DTensors cut along
    it, so that context parallelism's ring computes the kernel and its
    backward. ``fold_once`` False: the sink left out (its gradient none)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mesh, fold_once: bool):
        wrap, unwrap = _wrappers(mesh)
        out, lse = FLASH(*(wrap(t) for t in (q, k, v)), 0.0, True)[:2]
        out, lse = unwrap(out), unwrap(lse)
        if fold_once:
            out, lse = fold_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mesh, ctx.folded = mesh, fold_once
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        wrap, unwrap = _wrappers(ctx.mesh)
        dq, dk, dv = (unwrap(t) for t in FLASH_BACKWARD(
            *(wrap(t) for t in (g.contiguous(), q, k, v, out, lse)), 0.0, True)[:3])
        weight = torch.exp(sinks.view(1, -1, 1) - lse)
        dsinks = -(weight * (g * out).sum(-1)).sum((0, 2)) if ctx.folded else None
        return dq, dk, dv, dsinks, None, None


def _wrappers(mesh):
    """To and from DTensors cut along the sequence (dim 2) over ``mesh``;
    identities without one."""
    if mesh is None:
        return (lambda t: t), (lambda t: t)
    from torch.distributed.tensor import DTensor, Shard
    return (lambda t: DTensor.from_local(t, mesh, [Shard(2)], run_check=False)), \
        (lambda t: t.to_local())


class SinkFlashTagger(SinkTagger):
    """The sink tagger whose attention is ``SinkFlashAttention`` (the
    flash kernel and the sink folded once); under context parallelism
    (``cp_mesh``, set by a recipe) the kernel is PyTorch's ring.
    ``fold_once`` False: the sink is not folded after the kernel (a
    recipe's merge folds it, or nothing does)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.cp_mesh = None
        self.fold_once = True

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2).contiguous()
                   for t in self.qkv(h).chunk(3, dim=-1))
        y = SinkFlashAttention.apply(q, k, v, self.sinks, self.cp_mesh, self.fold_once)
        y = y.transpose(1, 2).reshape(b, s, d)
        logits = self.head(h + y).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def sink_flash_tagger(**kw) -> SinkFlashTagger:
    return SinkFlashTagger(**kw)
