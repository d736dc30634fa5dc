"""The lowering's pending values: what a handler may return instead of nodes.

A handler that cannot yet know which nodes a value needs returns a small
record of it; the op that reads it decides (an all-gather seen along dim d
by a later split and cat becomes one all-gather along d). Every record that
an op may read as a tensor is a ``Pending``: ``Lowerer.materialize`` calls
its ``materialize``, which emits its nodes or refuses the read in one line.
A record that is not ``Pending`` is read only by the handlers named below;
any other op reading it (or a ``Pending`` without a reading of its own)
stops the run with one line naming the op and the value
(``refusals.refusal``).

- ``Ids``, ``IdRows``, ``IdsTest``, ``VocabMask``, ``Shifted``,
  ``MaskedLookup``: the batch's ids, in ``ir_ids`` (imported here).
- ``Gathered``: made by collectives, layout; read by layout (split, cat,
  view); ``all_gather`` along dim 0.
- ``GatheredAlong``: made by layout (split + cat); read by layout (slice);
  ``all_gather`` along ``dim``.
- ``ZeroPadded``: made by tokens (DTensor's pad); read by collectives (all-
  gather); the padded tensor (a ``narrow`` backward, ``emit.pad``).
- ``Piece``: made by layout (split, chunk); read by layout, slices; one
  ``split`` node, emitted once.
- ``Stacked``: made by layout (cat along 0); read by collectives (reduce-
  scatter); not Pending.
- ``Flat``: made by layout, arithmetic, shapes; read by layout, arithmetic;
  ``flatten``.
- ``As``: made by layout (views of buffers); read by layout; a reshape
  (``Lowerer.reshape``).
- ``Packed``: made by layout (FSDP copy-in); read by layout (all-gather, split
  copy); not Pending.
- ``ChunkCat``: made by layout (FSDP chunk_cat); read by layout, collectives,
  arithmetic; not Pending.
- ``Padding``: made by layout (FSDP padded shard); read by layout (copy-in);
  not Pending.
- ``Unpadded``: made by layout (FSDP all-gather); read by layout (as_strided,
  view); not Pending.
- ``NoShard``: made by walk, layout, arithmetic; read by walk, arithmetic,
  Lowerer.run; refused (an empty shard).
- ``Compare``: made by tokens (``ids_test``); read by arithmetic, compose
  (``where``); not Pending.
- ``Const``: made by Lowerer.run, walk; read by masks, tokens, vocab_parallel,
  const_lookup, norm_sums, ``as_flag``; its recorded value as a constant
  input, or its ops lowered.
- ``SdpaSaved``: made by nn, masks (attention); read by nn (its backward); not
  Pending (kept in ``lw.sdpa``).
- ``Complex``: made by nn, layout, arithmetic; read by nn, layout, arithmetic;
  not Pending: two real values.
- ``MaxHit``: made by max (``amax(x) == x``); read by max, max_all; refused
  (``refuse_max_read``).
- ``MaxCount``: made by max, max_all; read by max; refused.
- ``NewZeros``: made by ids (``new_zeros``); read by ids, argmax; ``zeros`` of
  its shape.
- ``RowMax``: made by vocab_parallel (``amax``); read by vocab_parallel, max;
  the local ``max``.
- ``NllGrad``: made by losses (``nll_loss_backward``); read by losses (the
  log-softmax backward's fusion), logprob_views; ``-labels * g``.
- ``Flag``: made by masks, label_masks, ``as_flag`` (a constant boolean
  mask); read by masks, label_masks; its 0/1 value.
- ``Zeros``: made by vocab_parallel (``zeros_like``); read by vocab_parallel
  (the label update), norm_sums (an exact zero); any other reader gets
  ``zeros``.
- ``Bucket``: made by buckets (``mem.cat``), layout, grad_buffers; read by
  buckets, layout, collectives, slices, grad_buffers; the pieces flattened
  and ``cat``.
- ``Norm``, ``NormStack``, ``NormIsZero``, and the optimizer step's
  ``Decayed`` and its kin: in ``ir_optimizer`` (imported here).
- ``Merged``: made by merged_views (``view(a * b, c)`` of a sequence-first
  3-d value); read by merged_views, vocab_picks; ``flatten`` (and
  ``transpose``).
- ``Rows``, ``RowsT`` (in the helper ``routed_rows``, beside the rules
  that make them): made by routing, grouped, permute, all_to_all; read by
  the same four; rows of a base at a recorded index, materialized as the
  one-hot rows of the index times the base (``RowsT`` its transpose).
- ``Experts``, ``Transposed`` (in the helper ``grouped_rows``): made by
  grouped, permute, all_to_all; read by the same three; every group's
  result on every row of a base, each row's own group's kept
  (``collapse``) and gathered.

Families keep the pending kinds only they make and read (``masks.Masked``,
``argmax.MaxIndex``, ``vocab_parallel.Clamped``, ``const_lookup.ConstLookup``,
``logprob_views.ReadNllGrad`` ...); those follow the same ``Pending``
protocol. A kind a second family comes to read moves here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.constants import constant_input, constant_value
from backends.torch.lowering.emit import pad
from backends.torch.lowering.ir_ids import IdRows as IdRows
from backends.torch.lowering.ir_ids import Ids as Ids
from backends.torch.lowering.ir_ids import IdsTest as IdsTest
from backends.torch.lowering.ir_ids import MaskedLookup as MaskedLookup
from backends.torch.lowering.ir_ids import Shifted as Shifted
from backends.torch.lowering.ir_ids import VocabMask as VocabMask
from backends.torch.lowering.ir_optimizer import Decayed as Decayed
from backends.torch.lowering.ir_optimizer import Denom as Denom
from backends.torch.lowering.ir_optimizer import Moment1 as Moment1
from backends.torch.lowering.ir_optimizer import Moment2 as Moment2
from backends.torch.lowering.ir_optimizer import Norm as Norm
from backends.torch.lowering.ir_optimizer import NormIsZero as NormIsZero
from backends.torch.lowering.ir_optimizer import NormStack as NormStack
from backends.torch.lowering.ir_optimizer import Scaled as Scaled
from backends.torch.lowering.ir_optimizer import SgdGrad as SgdGrad
from backends.torch.lowering.pending import Pending

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass
class Gathered(Pending):
    """An all-gather along dim 0 of ``x`` over ``group``, not yet emitted.
    ``padded``: x was padded at the end of a dim before the gather (DTensor's
    uneven ``Shard``), so the pieces are equal only with the padding.

    Its readers decide the dim it is emitted along (a split and cat make it
    one all-gather along d), but it runs once, where it was recorded, on
    every member: ``slot`` is its reserved place among the rank's nodes
    (``Lowerer.reserve``), filled by the first read of each dim
    (``gather``, kept in ``values``), or, when no op of this rank reads it,
    by the gather along dim 0 (``Lowerer.settle``). A read-once-per-use
    emission gave two all-gathers on a rank that read the result twice and
    none on a rank that never read it (a ring's rank that skips the block),
    so the members' collectives did not match."""
    x: int
    group: tuple[int, ...]
    padded: bool = False
    slot: int | None = None
    values: dict[int, int] = field(default_factory=dict)
    #: its reader wrote the gather out as point-to-point messages (an uneven
    #: shard's pieces): no all-gather node is emitted for it
    written: bool = False

    def gather(self, lw: Lowerer, dim: int, shape: tuple[int, ...] | list[int] | None = None
               ) -> int:
        """The all-gather along ``dim``, emitted once (in the reserved slot
        for the first dim read)."""
        if dim not in self.values:
            if shape is None:
                shape = list(lw.shapes[self.x])
                shape[dim] *= len(self.group)
            out = lw.emit("all_gather", [self.x], [list(shape)], {"dim": dim},
                          group=self.group)[0]
            lw.fill(self.slot, lw.nodes.pop())
            self.slot = None
            self.values[dim] = out
        return self.values[dim]

    def materialize(self, lw: Lowerer) -> int:
        if self.padded:
            raise LoweringError(f"{lw.name}: an all-gather of padded pieces is read "
                                f"with its padding")
        return self.gather(lw, 0)


@dataclass(frozen=True)
class Empty:
    """A tensor with no entries (a dim of size 0: an empty slice, an op of
    no entries, ``lowering/no_entries.py``): no value, nothing to claim."""
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ZeroPadded(Pending):
    """``x`` padded with ``width`` zeros at the end of ``dim`` (DTensor pads
    its piece of an unevenly sharded dim to the chunk size before an
    all-gather), not yet emitted: that all-gather reads the piece, any
    other reader the padded tensor."""
    x: int
    dim: int
    width: int

    def materialize(self, lw: Lowerer) -> int:
        return pad(lw, self.x, self.dim, 0, self.width)  # read as the padded tensor


@dataclass(frozen=True)
class GatheredAlong(Pending):
    """The all-gather ``g`` seen along ``dim`` (split along 0, cat along
    dim), not yet emitted: a slice of its first rows may drop the padding
    of an uneven shard."""
    g: Gathered
    dim: int

    def materialize(self, lw: Lowerer) -> int:
        if self.g.padded:
            raise LoweringError(f"{lw.name}: an all-gather of padded pieces is read "
                                f"with its padding")
        return self.g.gather(lw, self.dim)


@dataclass
class Piece(Pending):
    of: Any  # a value id or a Gathered
    dim: int
    index: int
    parts: int

    def materialize(self, lw: Lowerer) -> int:
        # read once or many times (a chunk read in the forward and again by its
        # backward), one split node: the rank's reads and the single-device
        # step's then align node for node
        src = lw.materialize(self.of)
        key = (src, self.dim, self.index, self.parts)
        if key not in lw.splits:
            shape = list(lw.shapes[src])
            shape[self.dim] //= self.parts
            lw.splits[key] = lw.emit("split", [src], [shape], {
                "dim": self.dim, "parts": self.parts, "index": self.index})[0]
        return lw.splits[key]


@dataclass
class Stacked:
    x: int
    dim: int
    parts: int


@dataclass
class Flat(Pending):
    """x with its first k dims merged (torch.matmul's batch folding), not yet emitted."""
    x: int
    k: int

    def materialize(self, lw: Lowerer) -> int:
        shape = list(lw.shapes[self.x])
        merged = [math.prod(shape[:self.k])] + shape[self.k:]
        return lw.emit("flatten", [self.x], [merged], {"start": 0, "end": self.k - 1})[0]


@dataclass
class Packed:
    """FSDP's flat all-gather buffer: each rank's flat parameter shards,
    concatenated; ``group`` once all-gathered."""
    parts: list[int]
    group: tuple[int, ...] | None = None


@dataclass
class ChunkCat:
    """FSDP's flat reduce-scatter buffer: each gradient cut in ``chunks``
    along dim 0, chunk i of every gradient in row i; ``group`` once reduced."""
    grads: list[int]
    chunks: int
    group: tuple[int, ...] | None = None
    divide: float = 1.0
    #: HSDP: the replica group the reduced buffer is then all-reduced over
    replicas: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Padding:
    """A rank's shard of parameter ``param`` (value id) followed by FSDP2's
    padding rows (the shard of a dim the group size does not divide, padded
    to its chunk; an empty shard is all padding): only FSDP's all-gather
    copy-in reads it, and the lowering never reads the padding's values
    (docs/soundness.md, "Plans traced from PyTorch", 15)."""
    param: int


@dataclass(frozen=True)
class Unpadded:
    """A parameter FSDP2 pads, as its all-gather gives it to every rank of
    the group: ``x``, the members' rows concatenated in group order (no
    padding row); read only as the parameter's first rows."""
    x: int


@dataclass(frozen=True)
class NoShard(Pending):
    """The empty shard of a parameter this rank holds no rows of, its
    gradient's shard, or what only they made (its optimizer step). The
    gradient's empty shard names the local gradient it is cut from
    (``grad``) and the group whose reduction cuts it."""
    grad: int = -1
    group: tuple[int, ...] = ()

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a shard of a parameter this rank holds no rows of "
                            f"(FSDP2 pads it) is read beyond its own optimizer step")


@dataclass
class As(Pending):
    """Value x seen with another shape, not yet emitted as a reshape."""
    x: int
    shape: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        return lw.reshape(self.x, self.shape)


@dataclass(frozen=True)
class Compare:
    """``x op c`` for a computed tensor x and a number c (op gt, ge, lt, le):
    kept pending until a ``where`` selects with it."""
    x: int
    op: str
    c: float


#: Ops that only lay a tensor's entries out anew (views, copies, casts between
#: floating types, broadcasts)
LAYOUT_OPS = ("aten._to_copy.default", "aten.view.default", "aten._unsafe_view.default",
              "aten.reshape.default", "aten.permute.default", "aten.transpose.int", "aten.t.default",
              "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
              "aten.squeeze.default", "aten.clone.default", "aten.alias.default",
              "aten.expand.default")


def broadcast_layout(lw: Lowerer, event: int) -> bool:
    """Event ``event`` lays out anew (``LAYOUT_OPS``) a constant broadcast
    by an ``expand`` somewhere below it in a chain of such ops (XLNet's
    positional table expanded over the batch, then flattened with its
    positions): lowered op by op from the constant before the ``expand``,
    a rank's copy is that constant, a piece of the single-device one
    whatever the rank's batch, where the laid-out value (the batch's rows
    interleaved with the positions) would be no block of the single-device
    value (docs/soundness.md, "Plans traced from PyTorch", 76)."""
    events = lw.trace["events"]
    seen = 0
    while event >= 0 and seen < 64:
        op, (args, _kwargs), *_ = events[event]
        if op not in LAYOUT_OPS:
            return False
        if op == "aten.expand.default":
            return True
        first = args[0] if args else None
        if not (isinstance(first, (list, tuple)) and len(first) == 2 and first[0] == "v"):
            return False
        event, seen = lw.const_events.get(first[1], -1), seen + 1
    return False


@dataclass(frozen=True)
class Const(Pending):
    """Recorded value ``v``, a constant, computed by event ``event`` (not
    lowered until a lowered op reads it)."""
    v: int
    event: int

    def materialize(self, lw: Lowerer) -> int:
        if self.event >= 0 and self.v not in lw.by_value \
                and (self.v in lw.trace.get("from_buffer", ()) or broadcast_layout(lw, self.event)):
            # computed from a module's buffer (an input by name): lowered
            # op by op, so that its pieces on other ranks align with it;
            # through an op the rule table lacks (the cos and sin of a
            # rotary table), read by value like any other constant, by
            # every reader (a failed attempt may leave the op's arguments
            # lowered, so that a later one would pass: one constant, one
            # reading; docs/soundness.md, "Plans traced from PyTorch", 107)
            try:
                return lw.materialize(lw.lower_event(self.event, self.v))
            except LoweringError:
                if lw.trace.get("constvals", {}).get(self.v) is None:
                    raise
                lw.by_value.add(self.v)
        return constant_input(lw, constant_value(lw, ("v", self.v)))


@dataclass(frozen=True)
class KernelLse(Pending):
    """The log-sum-exp output of the CPU flash kernel, lowered only when an op
    reads it: the ``lse`` of the rule table's ``attention`` of the same
    query, keys and values (heads already repeated), which is the kernel's
    second output by its definition (docs/soundness.md, "Plans traced from
    PyTorch", 38 (c))."""
    q: int
    k: int
    v: int
    scale: float
    causal: bool

    def materialize(self, lw: Lowerer) -> int:
        if self not in lw.kernel_lse:
            q, k, v = (lw.shapes[x] for x in (self.q, self.k, self.v))
            out_shape, lse_shape = (*q[:-1], v[-1]), tuple(q[:-1])
            lw.kernel_lse[self] = lw.emit("attention", [self.q, self.k, self.v],
                                          [out_shape, lse_shape],
                                          {"scale": self.scale, "causal": self.causal})[1]
        return lw.kernel_lse[self]


@dataclass(frozen=True)
class SdpaSaved:
    """What the attention backward recomputes from: the inputs, the masked
    scores (the softmax's input) and the probabilities."""
    q: int
    k: int
    v: int
    scale: float
    masked: int
    probs: int
    causal: bool
    groups: int = 1  # query heads per key-value head (grouped-query attention)
    #: the probabilities are a masked softmax (backends/torch/lowering/masks.py):
    #: their backward is written on them (``softmax_grad``), not on the scores
    masked_probs: bool = False


@dataclass(frozen=True)
class NllGrad(Pending):
    """The nll backward, ``-labels * g`` (divided by the kept-label count
    for a mean), not yet emitted. When every label row is one-hot (no
    label ignored or padded: ``whole``), the log-softmax backward reading
    it fuses into ``(exp(logp) - labels) * g``, which equals ``g' -
    exp(logp) * sum(g')`` for ``g' = -labels * g`` because every row of
    the labels sums to 1 (docs/soundness.md, "Plans traced from PyTorch",
    2 and 7c); an ignored row is a zero row, so it is never fused."""
    labels: int
    g: int
    count: int | None
    whole: bool

    def materialize(self, lw: Lowerer) -> int:
        shape = lw.shapes[self.labels]
        out = lw.emit("mul_scalar", [lw.emit("mul", [self.labels, self.g], [shape])[0]], [shape],
                      {"value": -1.0})[0]
        return self.divided(lw, out)

    def fused(self, lw: Lowerer, logp: int) -> int:
        shape = lw.shapes[logp]
        negated = lw.emit("mul_scalar", [self.labels], [shape], {"value": -1.0})[0]
        e = lw.emit("exp", [logp], [shape])[0]
        total = lw.emit("add", [negated, e], [shape])[0]
        return self.divided(lw, lw.emit("mul", [total, self.g], [shape])[0])

    def divided(self, lw: Lowerer, x: int) -> int:
        if self.count is None:
            return x
        return lw.emit("div", [x], [lw.shapes[x]], {"value": float(self.count)})[0]


@dataclass(frozen=True)
class Flag(Pending):
    """A boolean tensor as its lowered 0/1 value ``x`` (1 where true) and its
    recorded booleans ``value`` (this rank's)."""
    x: int
    value: np.ndarray

    def materialize(self, lw: Lowerer) -> int:
        return self.x


def pending_of(lw: Lowerer, a: Any) -> Any:
    """What a recorded tensor argument stands for (a value id or a pending
    value); None for any other argument."""
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v":
        return lw.env.get(a[1])
    return None


def constant_flag(lw: Lowerer, value: np.ndarray) -> Flag:
    value = np.asarray(value, dtype=bool)
    return Flag(constant_input(lw, value.astype(np.float64)), value)


class FlagLike(Pending):
    """A helper value that is, to any reader outside its own pattern, a flag:
    ``truth`` its recorded booleans, ``flag`` its lowered 0/1 value (emitted
    only when read as a tensor)."""

    def truth(self, lw: Lowerer) -> np.ndarray:
        raise NotImplementedError

    def flag(self, lw: Lowerer) -> Flag:
        raise NotImplementedError

    def materialize(self, lw: Lowerer) -> int:
        return self.flag(lw).x


def as_flag(lw: Lowerer, a: Any) -> Flag | None:
    """The argument as a flag: a flag, or a constant boolean mask (or one
    of integers 0 and 1). A ``FlagLike`` is not taken here: the layers
    outside the loss-parallel pattern would read it before the pattern
    does; a reader outside the pattern materializes it as its flag."""
    x = pending_of(lw, a)
    if isinstance(x, Flag):
        return x
    value = constant_value(lw, a) if isinstance(x, Const) else None
    if value is not None and value.dtype == bool:
        return constant_flag(lw, value)
    if value is not None and value.dtype.kind in "iu" and np.isin(value, (0, 1)).all():
        # integers 0 and 1 (an int32 mask): ``&`` and ``|`` of them are the logical ones
        return constant_flag(lw, value.astype(bool))
    return None


class PatternOnly(Pending):
    """A helper value only the next op of its pattern may read: any other
    reader (materializing it) stops the run with one line."""

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a vocabulary-parallel mask, shifted ids or masked "
                            f"value ({type(self).__name__}) is read outside the patterns "
                            f"lowered (backends/torch/lowering/vocab_parallel.py)")


@dataclass(frozen=True)
class Zeros(Pending):
    """``zeros_like`` of a value that is not a parameter: read by the
    loss-parallel backward's ``index_put_`` as its pattern, by any other op as
    the zeros it is (a write into it in place is a new value of the record)."""
    shape: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        return lw.emit("zeros", [], [self.shape], {"shape": list(self.shape)}, direction="none")[0]


@dataclass(frozen=True)
class Complex:
    """A complex tensor as its real and imaginary parts (lowered values)."""
    re: int
    im: int


def complex_parts(lw: Lowerer, a: Any) -> tuple[int, int | None] | None:
    """(real, imaginary) of a complex argument, (x, None) for a real tensor."""
    x = lw.env.get(a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" else None
    if isinstance(x, Complex):
        return x.re, x.im
    value = constant_value(lw, a)
    if value is not None and np.iscomplexobj(value):
        return constant_input(lw, value.real), constant_input(lw, value.imag)
    return None


def refuse_max_read(lw: Lowerer) -> None:
    raise LoweringError(f"{lw.name}: a comparison with a maximum (amax(x) == x) read other than "
                        f"by amax's backward is not lowered")


@dataclass(frozen=True)
class MaxHit(Pending):
    """``amax(x) == x``: where x is maximal along the reduced dims."""
    x: int
    top: int  # the max node's output
    kwargs: tuple  # the max node's (dim, keepdim)

    def materialize(self, lw: Lowerer) -> int:
        refuse_max_read(lw)


@dataclass(frozen=True)
class MaxCount(Pending):
    """The number of maxima along the dims, ``hit.sum(dims, keepdim=True)``."""
    hit: MaxHit

    def materialize(self, lw: Lowerer) -> int:
        refuse_max_read(lw)


@dataclass(frozen=True)
class NewZeros(Pending):
    """``x.new_zeros(shape)`` not yet read: the start of a backward kernel
    that accumulates into zeros."""
    shape: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        return lw.emit("zeros", [], [self.shape], {"shape": list(self.shape)}, direction="none")[0]


@dataclass(frozen=True)
class RowMax(Pending):
    """``amax(x, dim, keepdim=True)`` of a local tensor, not yet emitted: a
    MAX all-reduce of it is the maximum of the gathered rows; any other
    reader gets the local ``max``."""
    x: int
    dim: int

    def materialize(self, lw: Lowerer) -> int:
        shape = list(lw.shapes[self.x])
        shape[self.dim] = 1
        return lw.emit("max", [self.x], [shape], {"dim": self.dim, "keepdim": True})[0]


@dataclass(frozen=True)
class Bucket(Pending):
    """A flat buffer made of ``pieces`` (lowered values, each with its own
    shape) side by side, in memory order."""
    pieces: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        """The bucket built, when an op reads it whole: the pieces
        flattened and concatenated."""
        flat = [lw.reshape(p, (numel(lw, p),)) for p in self.pieces]
        return lw.emit("cat", flat, [(sum(numel(lw, p) for p in self.pieces),)], {"dim": 0})[0]


def numel(lw: Lowerer, x: int) -> int:
    return math.prod(lw.shapes[x])


@dataclass(frozen=True)
class Merged(Pending):
    """``x`` ``[a, b, c]`` seen as ``[a * b, c]`` (``transposed``: then as its
    transpose ``[c, a * b]``), read only by ``mm``, a bias gradient's
    ``sum(0)`` or a pick: kept 3-d, so that a piece of either leading dim (a
    data-parallel cut of the batch of ``[s, b, h]`` activations) stays a
    piece. Any other reader gets the flattened value."""
    x: int
    transposed: bool = False

    def materialize(self, lw: Lowerer) -> int:
        a, b, c = lw.shapes[self.x]
        flat = lw.emit("flatten", [self.x], [(a * b, c)], {"start": 0, "end": 1})[0]
        if not self.transposed:
            return flat
        return lw.emit("transpose", [flat], [(c, a * b)], {"dim0": 0, "dim1": 1})[0]
