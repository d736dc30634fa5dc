"""cp: Ulysses-style context parallelism written with PyTorch's collectives,
in the two ways it ships.

Each rank holds a chunk of the sequence with every head. Before attention an
all-to-all turns that into the whole sequence with a group of the heads
(scatter the heads, gather the sequence); attention runs on the rank's heads
over the whole sequence; a second all-to-all turns it back (scatter the
sequence, gather the heads). On one device (no group) both are the identity.

- ``exchange="single"``: DeepSpeed's way, one ``all_to_all_single`` on a
  tensor reshaped so that dim 0 numbers the destination, then the received
  blocks moved back into place (``_single_seq_to_heads``,
  ``_single_heads_to_seq``).
- ``exchange="functional"``: DeepSpeed's layout moves around PyTorch's
  differentiable ``all_to_all_single_autograd`` (autograd runs the inverse
  exchange in the backward itself).
- ``exchange="list"``: VeOmni's way, ``torch.distributed.all_to_all`` of the
  pieces ``tensor_split`` cuts along the scattered dim, concatenated along
  the gathered one (``_list_all_to_all``).

``layout`` is the order of the activations around attention: "bshd" ([batch,
seq, heads, dim]) or "sbhd" ([seq, batch, heads, dim], Megatron's order).
The positions are a learned embedding at ``position_offset`` + 0..s-1 (the
recipe sets the offset to the rank's chunk). ``fault`` names a mistake as
it ships (tests/cp_ulysses_recipes.py): "swapped" (the first all-to-all
scatters the sequence and gathers the heads, the second the reverse),
"order" (the second all-to-all's received head groups concatenated in
reverse order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _list_all_to_all(x: torch.Tensor, scatter: int, gather: int, group, reverse: bool = False
                     ) -> torch.Tensor:
    """VeOmni's all-to-all: ``x`` cut in ``n`` pieces along ``scatter``,
    piece j sent to member j; what is received concatenated along
    ``gather`` in member order (reversed with ``reverse``: a mistake)."""
    n = dist.get_world_size(group)
    send = [p.contiguous() for p in torch.tensor_split(x, n, scatter)]
    recv = [torch.empty_like(send[0]) for _ in range(n)]
    dist.all_to_all(recv, send, group=group)
    return torch.cat(recv[::-1] if reverse else recv, dim=gather).contiguous()


def _exchange_rows(t: torch.Tensor, group, differentiable: bool) -> torch.Tensor:
    """Block j of t's rows to member j: ``dist.all_to_all_single`` into a new
    tensor (inside an autograd function), or the functional collective that
    autograd differentiates itself (``differentiable``)."""
    if differentiable:
        import torch.distributed._functional_collectives as funcol
        return funcol.all_to_all_single_autograd(t, None, None, group)
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group)
    return out


def _single_seq_to_heads(x: torch.Tensor, seq: int, group, differentiable: bool = False
                         ) -> torch.Tensor:
    """DeepSpeed's all-to-all scattering the heads (dim 2) and gathering the
    sequence (``seq``: 1 for [b, s, h, d], 0 for [s, b, h, d])."""
    n = dist.get_world_size(group)
    shape = list(x.shape)
    h = shape[2] // n
    # [..., n, h/n, d] with the destination moved to dim 0
    t = x.reshape(*shape[:2], n, h, shape[3]).movedim(2, 0).contiguous()
    out = _exchange_rows(t, group, differentiable)
    # out[j] is member j's chunk of the sequence: put it before the local positions
    out = out.movedim(0, seq)
    full = list(shape)
    full[seq] *= n
    full[2] = h
    return out.reshape(full).contiguous()


def _single_heads_to_seq(x: torch.Tensor, seq: int, group, reverse: bool = False,
                         differentiable: bool = False) -> torch.Tensor:
    """The inverse of ``_single_seq_to_heads``: scatter the sequence, gather
    the heads (reversed with ``reverse``: a mistake)."""
    n = dist.get_world_size(group)
    shape = list(x.shape)
    s = shape[seq] // n
    split = shape[:seq] + [n, s] + shape[seq + 1:]
    t = x.reshape(split).movedim(seq, 0).contiguous()
    out = _exchange_rows(t, group, differentiable)
    if reverse:
        out = out.flip(0)
    # out[j] holds member j's heads of this rank's chunk: heads j*h .. (j+1)*h
    out = out.movedim(0, 2)  # [.., n, h, d] at dims 2, 3
    full = list(shape)
    full[seq] = s
    full[2] *= n
    return out.reshape(full).contiguous()


class _Exchange(torch.autograd.Function):
    """An all-to-all as DeepSpeed's ``_SeqAllToAll`` wraps it: the backward
    is the inverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, model: UlyssesTagger, to_heads: bool) -> torch.Tensor:
        ctx.model, ctx.to_heads = model, to_heads
        return model.seq_to_heads(x) if to_heads else model.heads_to_seq(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        m = ctx.model
        return (m.heads_to_seq(g) if ctx.to_heads else m.seq_to_heads(g)), None, None


class UlyssesTagger(nn.Module):
    """One attention layer (learned positions, q, k, v, an output projection,
    a residual) and a per-position head, the cross-entropy summed over the
    step's tokens divided by all of them."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del layers, ffn
        self.global_tokens = 0
        self.position_offset = 0
        self.head_dim = hidden // heads
        self.group = None
        self.exchange = "single"
        self.layout = "bshd"
        self.causal = True
        self.fault = ""
        self.embed = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seqlen, hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab)

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[.., s/n, .., h, d] -> [.., s, .., h/n, d] over ``group``."""
        seq = self.layout.index("s")
        if self.exchange == "list":
            if self.fault == "swapped":
                return _list_all_to_all(x, seq, 2, self.group)
            return _list_all_to_all(x, 2, seq, self.group)
        return _single_seq_to_heads(x, seq, self.group, self.exchange == "functional")

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``seq_to_heads``."""
        seq = self.layout.index("s")
        reverse = self.fault == "order"
        if self.exchange == "list":
            if self.fault == "swapped":
                return _list_all_to_all(x, 2, seq, self.group)
            return _list_all_to_all(x, seq, 2, self.group, reverse)
        return _single_heads_to_seq(x, seq, self.group, reverse, self.exchange == "functional")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of [batch, heads, seq, dim] queries, keys, values."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        start = self.position_offset
        ids = torch.arange(start, start + tokens.shape[1])
        h = self.embed(tokens) + self.positions(ids)
        if self.layout == "sbhd":
            h = h.transpose(0, 1)
        a, b = h.shape[:2]
        q, k, v = (f(h).view(a, b, -1, self.head_dim) for f in (self.q, self.k, self.v))
        if self.group is not None and self.exchange == "functional":
            q, k, v = (self.seq_to_heads(t) for t in (q, k, v))
        elif self.group is not None:
            q, k, v = (_Exchange.apply(t, self, True) for t in (q, k, v))
        # SDPA's [batch, heads, seq, dim]
        order = (0, 2, 1, 3) if self.layout == "bshd" else (1, 2, 0, 3)
        y = self.attend(*(t.permute(order) for t in (q, k, v)))
        y = y.permute(0, 2, 1, 3) if self.layout == "bshd" else y.permute(2, 0, 1, 3)
        if self.group is not None and self.exchange == "functional":
            y = self.heads_to_seq(y)
        elif self.group is not None:
            y = _Exchange.apply(y, self, False)
        h = h + self.proj(y.reshape(a, b, -1))
        if self.layout == "sbhd":
            h = h.transpose(0, 1)
        logits = self.head(torch.tanh(h)).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def ulysses_tagger(**kw) -> UlyssesTagger:
    """Causal attention, [batch, seq, heads, dim] around it."""
    return UlyssesTagger(**kw)


def ulysses_tagger_sbhd(**kw) -> UlyssesTagger:
    """Causal attention, [seq, batch, heads, dim] around it."""
    model = UlyssesTagger(**kw)
    model.layout = "sbhd"
    return model


def ulysses_tagger_full(**kw) -> UlyssesTagger:
    """Attention over every position (no causal mask), [batch, seq, heads, dim]."""
    model = UlyssesTagger(**kw)
    model.causal = False
    return model


class UlyssesBlock(nn.Module):
    """A residual attention block with Ulysses' all-to-alls (a stage of
    ``UlyssesStack``): the attention and exchanges of ``UlyssesTagger``."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.group = None
        self.exchange = "single"
        self.layout = "bshd"
        self.fault = ""
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    seq_to_heads = UlyssesTagger.seq_to_heads
    heads_to_seq = UlyssesTagger.heads_to_seq

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a, b = h.shape[:2]
        q, k, v = (f(h).view(a, b, -1, self.head_dim) for f in (self.q, self.k, self.v))
        if self.group is not None:
            q, k, v = (_Exchange.apply(t, self, True) for t in (q, k, v))
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                           is_causal=True).transpose(1, 2)
        if self.group is not None:
            y = _Exchange.apply(y, self, False)
        return h + self.proj(y.reshape(a, b, -1))


class UlyssesStack(nn.Module):
    """Learned positions, ``layers`` Ulysses blocks and a per-position head,
    laid out for pipelining: ``forward(x)`` runs the modules this rank
    keeps (the token table and positions on the first stage, the head on
    the last; ``keep``), ``forward(tokens, labels)`` the whole step's loss;
    ``loss`` is a schedule's loss function (the summed cross-entropy over
    the step's token count)."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del ffn
        self.global_tokens = 0
        self.position_offset = 0
        self.embed = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seqlen, hidden)
        self.blocks = nn.ModuleDict({str(i): UlyssesBlock(hidden, heads) for i in range(layers)})
        self.head = nn.Linear(hidden, vocab)
        self.first, self.last = True, True

    def keep(self, stage: int, stages: int) -> None:
        """Keep, in place, the modules of pipeline stage ``stage`` of ``stages``."""
        n = len(self.blocks)
        mine = range(stage * n // stages, (stage + 1) * n // stages)
        self.blocks = nn.ModuleDict({str(i): self.blocks[str(i)] for i in mine})
        self.first, self.last = stage == 0, stage == stages - 1
        if not self.first:
            self.embed = self.positions = None
        if not self.last:
            self.head = None

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            start = self.position_offset
            x = self.embed(x) + self.positions(torch.arange(start, start + x.shape[1]))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(torch.tanh(x))
        return x if labels is None else self.loss(x, labels)


def ulysses_stack(**kw) -> UlyssesStack:
    return UlyssesStack(**kw)


class UlyssesSinkTagger(UlyssesTagger):
    """The Ulysses tagger with attention sinks (gpt-oss's per-head sink
    logits, tests/cp_sink_models.py): after the all-to-all a rank holds a
    group of the heads over the whole sequence, and reads the sinks of
    those heads (its narrow of the parameter at its cp index, ``cp_rank``,
    set by a recipe). ``fault`` "no_sinks": the rank's attention drops
    the sinks (prime-rl PR 3397's mechanism under Ulysses)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sinks = nn.Parameter(torch.randn(kw["heads"]))
        self.cp_rank = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from tests.cp_sink_models import sink_attention
        heads = q.shape[1]
        sinks = self.sinks.narrow(0, self.cp_rank * heads, heads)
        fault = "no_sinks" if self.fault == "no_sinks" else ""
        return sink_attention(q, k, v, sinks, fault=fault)


def ulysses_sink_tagger(**kw) -> UlyssesSinkTagger:
    """Causal attention with sinks, [batch, seq, heads, dim] around it."""
    return UlyssesSinkTagger(**kw)
