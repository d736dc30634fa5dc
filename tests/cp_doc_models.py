"""cp: a tagger whose attention is causal inside each document of the
sequence (a document mask, as packed pretraining batches use), written
with SDPA and an explicit boolean ``attn_mask``. Its context-parallel
recipes are in tests/cp_doc_recipes.py.

The documents are fixed by the sequence length (``document_lengths``).
Under context parallelism a recipe lays the sequence out in the order of
PyTorch's per-document head-tail load balancer
(``_PerDocumentHeadTailLoadBalancer``), a rank holds its chunk of the
queries in that order and all-gathers the keys and values over "cp"; its
mask is the document mask at the positions its query rows and the
gathered keys hold (``query_positions``, ``key_positions``: single-device
positions, in the order the rank holds them). That is the step
``context_parallel``'s flex path computes (``_create_cp_block_mask``
rewrites the mask's query and key indices the same way), written with
SDPA because flex_attention has no backward on the CPU
(docs/torch-backend.md, "Limits", Context parallelism)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def document_lengths(seqlen: int) -> list[int]:
    """Two documents of unequal lengths: a quarter and three quarters."""
    return [seqlen // 4, seqlen - seqlen // 4]


def document_mask(lengths: list[int], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The causal document mask [len(rows), len(cols)]: True where the key
    at position ``cols[j]`` is in the query's document and not after it."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    same = doc[rows][:, None] == doc[cols][None, :]
    return same & (rows[:, None] >= cols[None, :])


class DocTagger(nn.Module):
    """Embedding, one document-masked attention layer (a residual), and a
    tagging head; the loss the mean over the whole step's tokens."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
        super().__init__()
        del layers, ffn
        self.global_tokens = 0
        self.heads = heads
        self.seqlen = seqlen
        self.lengths = document_lengths(seqlen)
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.head = nn.Linear(hidden, vocab)
        #: the context-parallel group the keys and values are all-gathered over
        self.kv_group = None
        #: the single-device positions of this rank's query rows and of the keys it reads
        self.query_positions: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(h).chunk(3, dim=-1))
        # keys and values sequence first, all-gathered along it under context
        # parallelism, back to [b, h, s, d]; on one device the same views
        k, v = (t.permute(2, 0, 1, 3).contiguous() for t in (k, v))
        if self.kv_group is not None:
            import torch.distributed._functional_collectives as funcol
            k, v = (funcol.all_gather_single_autograd(t, 0, self.kv_group) for t in (k, v))
        k, v = (t.permute(1, 2, 0, 3) for t in (k, v))
        rows = torch.arange(s) if self.query_positions is None else self.query_positions
        cols = torch.arange(k.shape[2]) if self.key_positions is None else self.key_positions
        mask = document_mask(self.lengths, rows, cols)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(b, s, d)
        logits = self.head(h + y).flatten(0, 1)
        total = F.cross_entropy(logits, labels.flatten(), reduction="sum")
        return total / (self.global_tokens or labels.numel())


def doc_tagger(**kw) -> DocTagger:
    return DocTagger(**kw)
