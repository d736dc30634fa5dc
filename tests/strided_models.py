"""Models that read and write strided slices, written the way user code and
the libraries' attention layers write them, loaded as
``--model tests.strided_models:NAME``: interleaved (GPT-J, DeepSeek) rotary
embeddings that read ``x[..., ::2]`` and ``x[..., 1::2]`` and write them back
through the same views, a tensor written in place at every second position,
``copy_`` into a strided view, ``slice_scatter`` with a step, and a view made
by ``as_strided``.

Each factory takes the size keywords ``layers, hidden, heads, ffn, vocab,
seqlen``; the loss is the per-rank mean of the cross-entropy (averaged over
data-parallel replicas: ``ddp_avg``, FSDP2's default). The blocks are named
``blocks`` with ``gate``/``up``/``down`` projections, which the stock
tensor-parallel recipes shard (``stock_recipes.mlp_tp_plan``). A model made
with ``swapped=True`` is the bug: the halves written back swapped (the
rotation's sign lost), which ``tests/strided_mistakes.py`` applies on one
rank only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _angles(seqlen: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary angles, ``[seqlen, width // 2]``."""
    inv = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float64) / width))
    freqs = torch.outer(torch.arange(seqlen, dtype=torch.float64), inv)
    return freqs.cos().float(), freqs.sin().float()


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       swapped: bool = False) -> torch.Tensor:
    """The pairs ``(x[2i], x[2i + 1])`` of the last dim rotated, written into a
    fresh tensor through the strided views (GPT-J's layout)."""
    even, odd = x[..., ::2], x[..., 1::2]
    out = torch.empty_like(x)
    first, second = even * cos - odd * sin, odd * cos + even * sin
    if swapped:
        first, second = second, first
    out[..., ::2] = first
    out[..., 1::2] = second
    return out


def gate_pairs(h: torch.Tensor, swapped: bool = False) -> torch.Tensor:
    """Each pair ``(h[2i], h[2i + 1])`` of the last dim gated by the other,
    written back through the strided views into a fresh tensor: a function
    of each pair, so a rank holding whole pairs (an even piece of the dim)
    computes its piece."""
    even, odd = h[..., ::2], h[..., 1::2]
    out = torch.empty_like(h)
    first, second = even * torch.sigmoid(odd), odd * torch.tanh(even)
    if swapped:
        first, second = second, first
    out[..., ::2] = first
    out[..., 1::2] = second
    return out


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, pairs: bool = False):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.pairs = pairs
        self.swapped = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(x)
        if self.pairs:  # along the dim that column-wise tensor parallelism shards
            h = gate_pairs(h, self.swapped)
        return self.down(F.silu(h) * self.up(x))


class _LM(nn.Module):
    """An embedding, blocks that each apply ``mix`` then a SwiGLU MLP, a
    head, the mean cross-entropy; subclasses define ``mix``."""

    pairs = False

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int,
                 swapped: bool = False):
        super().__init__()
        del heads
        self.swapped = swapped
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_MLP(hidden, ffn, self.pairs) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.offset = 0  # where the rows' positions start in the angle tables
        cos, sin = _angles(2 * seqlen, hidden)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(self.mix(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class InterleavedRope(_LM):
    """Interleaved rotary embedding of the activations before each block."""

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        s, at = x.shape[1], self.offset
        return rotate_interleaved(x, self.cos[at:at + s], self.sin[at:at + s], self.swapped)


class EveryOtherZero(_LM):
    """``y[:, ::2] = 0`` (every other token zeroed) and ``y[..., 1::2] *= 2``
    (an in-place update through a strided view of the hidden dim)."""

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:, ::2] = 0.0
        y[..., 1::2] *= 2.0
        return y


class CopyIntoStrided(_LM):
    """``y[..., 1::2].copy_(z)``: the odd positions of a copy replaced by a
    computed tensor (the gradient flows to both)."""

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        z = torch.tanh(x[..., ::2])
        if self.swapped:
            y[..., ::2].copy_(z)
        else:
            y[..., 1::2].copy_(z)
        return y


class SliceScatter(_LM):
    """``torch.slice_scatter`` with a step: the positions ``1, 4, 7, ...`` of
    the hidden dim replaced by a function of themselves (SiLU)."""

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        picked = x[..., 1::3]
        src = torch.sigmoid(picked) * picked
        return torch.slice_scatter(x, src, dim=-1, start=1, step=3)


class AsStridedPairs(_LM):
    """``as_strided`` views of the even and odd positions (the strides of a
    strided slice, as code that builds views by hand writes them)."""

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        b, s, h = x.shape
        even = x.as_strided((b, s, h // 2), (s * h, h, 2), x.storage_offset())
        odd = x.as_strided((b, s, h // 2), (s * h, h, 2), x.storage_offset() + 1)
        return torch.cat((even * odd, even - odd), dim=-1)


class PairGated(_LM):
    """The pairs of the MLP's gate projection gated by each other
    (``gate_pairs``): strided slices and writes along the dim that
    ``ColwiseParallel`` shards."""

    pairs = True

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return x


def interleaved_rope(**kw) -> InterleavedRope:
    return InterleavedRope(**kw)


def interleaved_rope_swapped(**kw) -> InterleavedRope:
    return InterleavedRope(**kw, swapped=True)


def every_other_zero(**kw) -> EveryOtherZero:
    return EveryOtherZero(**kw)


def copy_into_strided(**kw) -> CopyIntoStrided:
    return CopyIntoStrided(**kw)


def copy_into_strided_swapped(**kw) -> CopyIntoStrided:
    return CopyIntoStrided(**kw, swapped=True)


def slice_scatter(**kw) -> SliceScatter:
    return SliceScatter(**kw)


def as_strided_pairs(**kw) -> AsStridedPairs:
    return AsStridedPairs(**kw)


def pair_gated(**kw) -> PairGated:
    return PairGated(**kw)
