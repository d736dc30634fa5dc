"""Lower one rank's recorded aten ops onto operators of the rule table.

Each recorded op becomes zero or more nodes (``LNode``) on local values.
Ops that only rename a value (same-shape views, clone, detach, copy_) make
no node. The layout moves DTensor wraps around a collective (an all-gather
along dim 0 followed by split and cat along dim d; split along d and cat
along 0 before a reduce-scatter) are folded into one collective along d,
so that every value stays a slice of some single-device value. Only ops
the loss and the final gradients depend on are lowered; an op with no
lowering stops the run with one line naming it (``LoweringError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lower_buckets import (
    BUCKET_HANDLERS,
    PER_PIECE_OPS,
    Bucket,
    all_reduce_bucket,
    bucket_view,
    per_piece,
)
from backends.torch.lower_more import MORE_HANDLERS, check_no_value_reads
from backends.torch.lower_nn import (
    NN_HANDLERS,
    Complex,
    Const,
    SdpaSaved,
    causal_add,
    complex_mul,
    constant_input,
    constant_value,
    masked_fill,
    one_hot_constant,
    to_copy,
    where,
)

__all__ = ["LNode", "Lowered", "LoweringError", "check_shards", "lower_ranks", "lower_trace"]


@dataclass
class LNode:
    op: str
    dir: str
    ins: list[int]
    outs: list[int]
    kwargs: dict[str, Any]
    name: str
    group: tuple[int, ...] | None = None
    mb: int = -1  # the microbatch a pipeline schedule ran it for, -1 outside one


@dataclass
class Lowered:
    rank: int
    coords: dict[str, int]
    shapes: dict[int, tuple[int, ...]]
    nodes: list[LNode]
    inputs: dict[int, tuple[str, str]]  # value -> (kind, name)
    axes: dict[int, list[list[str]]]  # input value -> mesh axes per dim
    losses: list[int]  # one per microbatch the rank computes a loss for
    grads: dict[str, int | None]
    tokens_value: int = -1
    constants: dict[int, Any] = field(default_factory=dict)  # constant input -> its value
    #: with an optimizer step: each parameter's updated value, and its
    #: optimizer states' new values (state name -> value)
    updates: dict[str, int] = field(default_factory=dict)
    states: dict[str, dict[str, int]] = field(default_factory=dict)
    #: HSDP: {"dps": s}, the data-parallel ranks cut into replicas of s shards
    split: dict[str, int] = field(default_factory=dict)
    #: each SUM all-reduce of a count of kept labels: (group, this rank's count)
    count_reduces: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    #: each gradient bucket all-reduced: (group, its pieces' sizes)
    buckets: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    #: the square sum (a zero) of a gradient's empty shard -> (the local
    #: gradient it is cut from, the group whose reduction cuts it)
    empty_sums: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    #: a padded gradient's rows this rank keeps (a narrow) -> the group whose
    #: reduction cuts them
    row_cuts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: parameters the model ties: another name of one -> the name it is held under
    ties: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Ids:
    """Row block ``index`` of ``parts`` of the batch's integer ``source``
    ids (``tokens`` or ``labels``; a pipeline schedule's microbatch, the
    whole batch is (0, 1)), seen with ``shape`` (None: as loaded). In the
    plan, ids are one-hot inputs ``[..., vocab]``."""
    source: str = "tokens"
    index: int = 0
    parts: int = 1
    shape: tuple[int, ...] | None = None

    def cut(self, index: int, parts: int) -> _Ids:
        return _Ids(self.source, self.index * parts + index, self.parts * parts)


@dataclass(frozen=True, eq=False)
class _IdRows:
    """Integer ids the model cut or padded (``labels[:, 1:]``, ``F.pad(...,
    value=-100)``): their one-hot rows ``x`` (lowered, ``[*ids.shape,
    vocab]``; an id outside the vocabulary, a pad, is a zero row) and the
    recorded ids themselves (for the count a mean divides by)."""
    x: int
    ids: np.ndarray


@dataclass(frozen=True)
class _IdsTest:
    """``ids < value`` (op "lt") or ``ids >= value`` (op "ge")."""
    ids: _Ids
    op: str
    value: int


@dataclass(frozen=True)
class _VocabMask:
    """``(ids < lo) | (ids >= hi)``: the ids outside the rows [lo, hi) of a
    vocabulary-parallel embedding table."""
    ids: _Ids
    lo: int
    hi: int


@dataclass(frozen=True)
class _MaskedLookup:
    """A vocabulary-parallel lookup (its lowered value ``out``: the one-hot
    slice times the local table, already zero outside the rows) before the
    recorded run zeroes the rows of ids outside the shard. Until that
    ``index_put_`` only it may read the lookup: the recorded tensor still
    holds table row 0 there, which the lowered value does not."""
    out: int
    mask: _VocabMask

    def emit_into(self, lw: Any) -> int:
        raise LoweringError(f"{lw.name}: a vocabulary-parallel lookup is read before the rows "
                            f"of ids outside its shard are zeroed")


@dataclass(frozen=True)
class _Shifted:
    """``ids - lo``, then (``mask`` set) 0 where the mask holds: the local
    row of each id in the shard [lo, hi)."""
    ids: _Ids
    lo: int
    mask: _VocabMask | None = None


@dataclass
class _Gathered:
    """An all-gather along dim 0 of ``x`` over ``group``, not yet emitted.
    ``padded``: x was padded at the end of a dim before the gather (DTensor's
    uneven ``Shard``), so the pieces are equal only with the padding."""
    x: int
    group: tuple[int, ...]
    padded: bool = False


@dataclass(frozen=True)
class _ZeroPadded:
    """``x`` padded with ``width`` zeros at the end of ``dim`` (DTensor pads
    its piece of an unevenly sharded dim to the chunk size before an
    all-gather), not yet emitted; only that all-gather may read it."""
    x: int
    dim: int
    width: int


@dataclass(frozen=True)
class _GatheredAlong:
    """The all-gather ``g`` seen along ``dim`` (split along 0, cat along
    dim), not yet emitted: a slice of its first rows may drop the padding
    of an uneven shard."""
    g: _Gathered
    dim: int


@dataclass
class _Piece:
    of: Any  # a value id or a _Gathered
    dim: int
    index: int
    parts: int


@dataclass
class _Stacked:
    x: int
    dim: int
    parts: int


@dataclass
class _Flat:
    """x with its first k dims merged (torch.matmul's batch folding), not yet emitted."""
    x: int
    k: int


@dataclass
class _Packed:
    """FSDP's flat all-gather buffer: each rank's flat parameter shards,
    concatenated; ``group`` once all-gathered."""
    parts: list[int]
    group: tuple[int, ...] | None = None


@dataclass
class _ChunkCat:
    """FSDP's flat reduce-scatter buffer: each gradient cut in ``chunks``
    along dim 0, chunk i of every gradient in row i; ``group`` once reduced."""
    grads: list[int]
    chunks: int
    group: tuple[int, ...] | None = None
    divide: float = 1.0
    #: HSDP: the replica group the reduced buffer is then all-reduced over
    replicas: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Padding:
    """A rank's shard of parameter ``param`` (value id) followed by FSDP2's
    padding rows (the shard of a dim the group size does not divide, padded
    to its chunk; an empty shard is all padding): only FSDP's all-gather
    copy-in reads it, and the lowering never reads the padding's values
    (docs/soundness.md, "Plans traced from PyTorch", 15)."""
    param: int


@dataclass(frozen=True)
class _Unpadded:
    """A parameter FSDP2 pads, as its all-gather gives it to every rank of
    the group: ``x``, the members' rows concatenated in group order (no
    padding row); read only as the parameter's first rows."""
    x: int


@dataclass(frozen=True)
class _NoShard:
    """The empty shard of a parameter this rank holds no rows of, its
    gradient's shard, or what only they made (its optimizer step). The
    gradient's empty shard names the local gradient it is cut from
    (``grad``) and the group whose reduction cuts it."""
    grad: int = -1
    group: tuple[int, ...] = ()


@dataclass
class _As:
    """Value x seen with another shape, not yet emitted as a reshape."""
    x: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Norm:
    """sqrt(s / share), s a sum of squares (so s >= 0): a 2-norm, not yet
    emitted. ``share`` is n when DTensor turned a replicated norm into one
    of n partial norms (dividing it by sqrt(n))."""
    s: int
    share: int = 1


@dataclass(frozen=True)
class _NormStack:
    """torch.stack of norms (``squared``: then squared elementwise, one
    square sum per entry, ``_Norm.share`` kept)."""
    norms: tuple[_Norm, ...]
    squared: bool = False


@dataclass(frozen=True)
class _Decayed:
    """p * keep: AdamW's decoupled weight decay, ``p.mul_(1 - lr * wd)``."""
    p: int
    keep: float


@dataclass(frozen=True)
class _Moment1:
    """``m.lerp_(g, weight)``: Adam's first moment, m a fresh state."""
    m: int
    g: int
    weight: float


@dataclass(frozen=True)
class _Scaled:
    """``v.mul_(factor)`` of a fresh optimizer state."""
    v: int
    factor: float


@dataclass(frozen=True)
class _Moment2:
    """``v.mul_(beta2).addcmul_(g, g, value=1 - beta2)``: Adam's second moment."""
    v: int
    g: int
    beta2: float


@dataclass(frozen=True)
class _Denom:
    """``(sqrt(v2) / scale) + eps``: Adam's denominator (``root``: sqrt only)."""
    v2: _Moment2
    scale: float = 1.0
    eps: float = 0.0
    root: bool = False


@dataclass(frozen=True)
class _SgdGrad:
    """``g + wd * p`` (``torch.add(g, p, alpha=wd)``): SGD's weight decay."""
    g: int
    p: int
    wd: float


@dataclass
class _Lowerer:
    trace: dict
    vocab: int
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    nodes: list[LNode] = field(default_factory=list)
    env: dict[int, Any] = field(default_factory=dict)
    fw_in: dict[int, tuple[str, int]] = field(default_factory=dict)  # output -> (op, input)
    ln_y: dict[tuple[int, int, int], int] = field(default_factory=dict)  # a layer norm's (x-mean)*rstd
    sdpa: dict[int, SdpaSaved] = field(default_factory=dict)  # attention output -> its saved values
    inputs: dict[int, tuple[str, str]] = field(default_factory=dict)  # value -> (kind, name)
    axes: dict[int, list[list[str]]] = field(default_factory=dict)  # input value -> mesh axes
    const_inputs: dict[str, int] = field(default_factory=dict)  # constant's name -> input
    const_values: dict[int, Any] = field(default_factory=dict)  # constant input -> its value
    next_id: int = 0
    name: str = ""
    tokens: int = -1
    flat_of: dict[int, int] = field(default_factory=dict)
    mb: int = -1
    id_pieces: dict[_Ids, int] = field(default_factory=dict)
    #: (value, dim, index, parts) -> the split of that equal piece, emitted once
    splits: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    one_hot: dict[str, int] = field(default_factory=dict)  # ids source -> one-hot input
    params: dict[int, str] = field(default_factory=dict)  # the parameters' values -> names
    fresh_state: set[int] = field(default_factory=set)  # zeros_like of a parameter
    updated: dict[Any, int] = field(default_factory=dict)  # optimizer state -> its new value
    quotients: dict[int, tuple[int, int]] = field(default_factory=dict)  # a / b -> (a, b)
    norms: dict[int, int] = field(default_factory=dict)  # a 2-norm along dims -> its input
    stds: set[int] = field(default_factory=set)  # standard deviations (lower_std)
    empty_sums: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    row_cuts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    event: int = -1  # the event being lowered
    buckets: list = field(default_factory=list)  # gradient buckets all-reduced (lower_buckets)
    #: the step's value of each count all-reduce, in order (lower_ranks); None:
    #: an all-reduced count is refused, "collect": this rank's counts are kept
    counts: list[int] | str | None = None
    count_reduces: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    #: pow(x, 2) -> x, and the exact zeros of accumulators (lower_norm_sums)
    squares: dict[int, int] = field(default_factory=dict)
    zero_values: set[int] = field(default_factory=set)

    # -- values -------------------------------------------------------------
    def new(self, shape) -> int:
        v = self.next_id
        self.next_id += 1
        self.shapes[v] = tuple(shape)
        return v

    def emit(self, op: str, ins: list[int], out_shapes: list, kwargs: dict | None = None,
             direction: str = "fw", group=None) -> list[int]:
        outs = [self.new(s) for s in out_shapes]
        self.nodes.append(LNode(op, direction, ins, outs, kwargs or {}, self.name, group, self.mb))
        return outs

    def val(self, a: Any) -> int:
        """The lowered value of a recorded argument, materializing pending layouts."""
        if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
            raise LoweringError(f"{self.name}: expected a tensor, got {a!r}")
        x = self.env.get(a[1])
        if x is None:
            raise LoweringError(f"{self.name}: reads a tensor that no recorded op produced")
        return self.materialize(x)

    def materialize(self, x: Any) -> int:
        if isinstance(x, int):
            return x
        if isinstance(x, Const):
            if x.v in self.trace.get("from_buffer", ()) and x.event >= 0:
                # computed from a module's buffer (an input by name): lowered
                # op by op, so that its pieces on other ranks align with it;
                # through an op the rule table lacks (the cos and sin of a
                # rotary table), read by value like any other constant
                try:
                    return self.materialize(self.lower_event(x.event, x.v))
                except LoweringError:
                    if self.trace.get("constvals", {}).get(x.v) is None:
                        raise
            return constant_input(self, constant_value(self, ("v", x.v)))
        if isinstance(x, _GatheredAlong):
            shape = list(self.shapes[x.g.x])
            shape[x.dim] *= len(x.g.group)
            if x.g.padded:
                raise LoweringError(f"{self.name}: an all-gather of padded pieces is read "
                                    f"with its padding")
            return self.emit("all_gather", [x.g.x], [shape], {"dim": x.dim}, group=x.g.group)[0]
        if isinstance(x, _ZeroPadded):  # read as the padded tensor (lower_conv._pad)
            from backends.torch.lower_conv import _pad
            return _pad(self, x.x, x.dim, 0, x.width)
        if isinstance(x, _Gathered):
            if x.padded:
                raise LoweringError(f"{self.name}: an all-gather of padded pieces is read "
                                    f"with its padding")
            shape = list(self.shapes[x.x])
            shape[0] *= len(x.group)
            return self.emit("all_gather", [x.x], [shape], {"dim": 0}, group=x.group)[0]
        if isinstance(x, _As):
            return self.materialize(_view_to(self, x.x, x.shape))
        if isinstance(x, _Flat):
            shape = list(self.shapes[x.x])
            merged = [math.prod(shape[:x.k])] + shape[x.k:]
            return self.emit("flatten", [x.x], [merged], {"start": 0, "end": x.k - 1})[0]
        if isinstance(x, _Norm):
            s = x.s
            if x.share != 1:
                s = self.emit("div", [s], [self.shapes[s]], {"value": float(x.share)})[0]
            return self.emit("pow", [s], [self.shapes[s]], {"exponent": 0.5})[0]
        if isinstance(x, _NoShard):
            raise LoweringError(f"{self.name}: a shard of a parameter this rank holds no rows of "
                                f"(FSDP2 pads it) is read beyond its own optimizer step")
        if hasattr(x, "emit_into"):  # a pending value of lower_vocab_parallel or _NllGrad
            return self.materialize(x.emit_into(self))
        if isinstance(x, _Piece):
            # read once or many times (a chunk read in the forward and again by its
            # backward), one split node: the rank's reads and the single-device
            # step's then align node for node
            src = self.materialize(x.of)
            key = (src, x.dim, x.index, x.parts)
            if key not in self.splits:
                shape = list(self.shapes[src])
                shape[x.dim] //= x.parts
                self.splits[key] = self.emit("split", [src], [shape], {
                    "dim": x.dim, "parts": x.parts, "index": x.index})[0]
            return self.splits[key]
        from backends.torch.lower_refusals import refusal
        raise LoweringError(refusal(self, x))

    def reshape(self, x: int, shape: tuple[int, ...]) -> int:
        """Value x seen with ``shape`` (flatten/unflatten nodes)."""
        return self.materialize(_view_to(self, x, tuple(shape)))

    def const(self, a: Any) -> float | None:
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return float(a)
        if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v":
            if a[1] in self.trace["consts"]:
                return self.trace["consts"][a[1]]
            value = self.trace.get("constvals", {}).get(a[1])
            if a[1] in self.trace.get("constants", ()) and value is not None and value.size == 1 \
                    and value.dtype.kind in "fiu":
                return float(value.reshape(()))
        return None

    # -- the walk -----------------------------------------------------------
    def run(self, live: set[int]) -> None:
        constants = self.trace.get("constants", set())
        for i, (op, _, outs, *_) in enumerate(self.trace["events"]):
            if i not in live:
                continue
            if outs and all(v in constants for v in outs):
                for v in outs:  # a constant of unknown origin (written in place) is read by value
                    self.env[v] = Const(v, i if op != "unknown" else -1)
                continue
            if self.on_empty(i):
                for v in outs:
                    self.env[v] = _NoShard()
                continue
            self.lower_event(i)

    def on_empty(self, i: int) -> bool:
        """Event i reads only the empty shards of parameters this rank holds
        no rows of, or what such events made (their optimizer step), writes
        only empty tensors and communicates nothing: it computes no value,
        and its outputs may be read by no other op."""
        op, (args, kwargs), outs, out_shapes, *_ = self.trace["events"][i]
        ins = _tensor_args([args, kwargs])
        return (bool(ins) and bool(outs) and not op.startswith(("c10d", "_c10d_functional", "fsdp"))
                and all(isinstance(self.env.get(v), _NoShard) for v in ins)
                and all(0 in tuple(s) for s in out_shapes))

    def lower_event(self, i: int, want: int = -1) -> Any:
        """Lower event ``i`` through its handler; the lowered value of its
        output ``want``."""
        op, (args, kwargs), outs, out_shapes, scope, group, mb = self.trace["events"][i]
        saved = self.name, self.mb, self.event
        self.name, self.mb = scope, mb
        self.event = i
        handler = HANDLERS.get(op)
        if handler is None:
            raise LoweringError(f"aten op {op} (at {scope or 'top level'}) is not lowered "
                                f"onto the rule table")
        if op in PER_PIECE_OPS and args and isinstance(self.env.get(_first_value(args[0])), Bucket):
            handler = _per_piece(handler)
        try:
            result = handler(self, args, kwargs, out_shapes, group)
        except LoweringError as e:
            if not str(e).startswith(": "):
                raise
            # an op outside every module (a clipper's, the step's): say which op
            raise LoweringError(f"{op} at top level{e}") from None
        finally:
            self.name, self.mb, self.event = saved
        if not isinstance(result, list):
            result = [result]
        for v, r in zip(outs, result):
            self.env[v] = r
        return self.env.get(want)


def _first_value(a: Any) -> int | None:
    return a[1] if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" else None


def _per_piece(handler):
    def lower(lw: _Lowerer, args, kwargs, shapes, group):
        return per_piece(lw, handler, args, kwargs, group)
    return lower


def _tensor_args(args: Any) -> list[int]:
    out = []
    if isinstance(args, (list, tuple)):
        if len(args) == 2 and args[0] == "v" and isinstance(args[1], int):
            return [args[1]]
        for a in args:
            out.extend(_tensor_args(a))
    elif isinstance(args, dict):
        for a in args.values():
            out.extend(_tensor_args(a))
    return out


def live_events(trace: dict) -> set[int]:
    """Events the loss and the final gradients depend on."""
    need = set(trace["losses"]) | {g for g in trace["grads"].values() if g is not None}
    need |= {v for v in trace.get("updates", {}).values() if v is not None}
    need |= {v for st in trace.get("states", {}).values() for v in st.values() if v is not None}
    live = set()
    for i in range(len(trace["events"]) - 1, -1, -1):
        op, (args, kwargs), outs = trace["events"][i][:3]
        if not need.intersection(outs) and op != "c10d.send.default":
            continue
        live.add(i)
        if op == "c10d.recv_.default":
            continue  # overwrites its buffers
        if op == "aten.copy_.default":
            need.update(_tensor_args(args[1]))
        else:
            need.update(_tensor_args([args, kwargs]))
    return live


# -- handlers ------------------------------------------------------------------

def _binary(tensor_op: str, scalar_op: str):
    def lower(lw: _Lowerer, args, kwargs, shapes, group):
        a, b = args[0], args[1]
        if kwargs.get("alpha", 1) != 1:
            raise LoweringError(f"{lw.name}: {tensor_op} with alpha is not lowered")
        if tensor_op == "mul":
            product = complex_mul(lw, args, shapes)
            if product is not None:
                return product
        cb = lw.const(b)
        if cb is not None:
            return lw.emit(scalar_op, [lw.val(a)], shapes, {"value": cb})[0]
        ca = lw.const(a)
        if ca is not None:
            return lw.emit(scalar_op, [lw.val(b)], shapes, {"value": ca})[0]
        return lw.emit(tensor_op, [lw.val(a), lw.val(b)], shapes)[0]
    return lower


def _scalar(op: str):
    def lower(lw: _Lowerer, args, kwargs, shapes, group):
        value = lw.const(args[1])
        if value is None and op == "div":
            return _quotient(lw, args, kwargs, shapes)
        if value is None:
            raise LoweringError(f"{lw.name}: {op} by a tensor is not lowered")
        buf = lw.env.get(args[0][1])
        if op == "div" and isinstance(buf, _ChunkCat):
            return _ChunkCat(buf.grads, buf.chunks, buf.group, buf.divide * value, buf.replicas)
        return lw.emit(op, [lw.val(args[0])], shapes, {"value": value})[0]
    return lower


def _quotient(lw: _Lowerer, args, kwargs, shapes) -> int:
    """a / b for a tensor b: a * pow(b, -1) (the reciprocal uninterpreted, as
    every non-linear function); a rounding mode is refused."""
    if kwargs.get("rounding_mode") is not None:
        raise LoweringError(f"{lw.name}: division with rounding_mode is not lowered")
    a, b = lw.val(args[0]), lw.val(args[1])
    recip = lw.emit("pow", [b], [lw.shapes[b]], {"exponent": -1.0})[0]
    out = lw.emit("mul", [a, recip], shapes)[0]
    lw.quotients[out] = (a, b)
    return out


def _unary(op: str):
    return lambda lw, args, kwargs, shapes, group: lw.emit(op, [lw.val(args[0])], shapes)[0]


def _pow(lw: _Lowerer, args, kwargs, shapes, group):
    return lw.emit("pow", [lw.val(args[0])], shapes, {"exponent": float(args[1])})[0]


def _softmax(lw: _Lowerer, args, kwargs, shapes, group):
    x = lw.val(args[0])
    out = lw.emit("softmax", [x], shapes, {"dim": int(args[1])})[0]
    lw.fw_in[out] = ("softmax", x)
    return out


def _softmax_bw(lw: _Lowerer, args, kwargs, shapes, group):
    out = lw.val(args[1])
    producer, x = lw.fw_in.get(out, ("", -1))
    if producer != "softmax":
        raise LoweringError(f"{lw.name}: softmax backward of a value no softmax produced")
    return lw.emit("softmax", [x, lw.val(args[0])], shapes, {"dim": int(args[2])},
                   direction="bw")[0]


def _log_softmax(lw: _Lowerer, args, kwargs, shapes, group):
    """x - top - log(sum(exp(x - top))), top the row maximum."""
    x, dim = lw.val(args[0]), int(args[1])
    shape = list(lw.shapes[x])
    dim %= len(shape)
    row = [*shape[:dim], 1, *shape[dim + 1:]]
    top = lw.emit("max", [x], [row], {"dim": dim, "keepdim": True})[0]
    shifted = lw.emit("sub", [x, top], [shape])[0]
    e = lw.emit("exp", [shifted], [shape])[0]
    total = lw.emit("sum", [e], [row], {"dim": dim, "keepdim": True})[0]
    return lw.emit("sub", [shifted, lw.emit("log", [total], [row])[0]], [shape])[0]


def _log_softmax_bw(lw: _Lowerer, args, kwargs, shapes, group):
    """g - exp(out) * sum(g) along the dim; of the nll backward's gradient,
    the fused form ``(exp(out) - labels) * g`` (``_NllGrad``)."""
    pending = lw.env.get(args[0][1])
    out, dim = lw.val(args[1]), int(args[2])
    shape = list(lw.shapes[out])
    dim %= len(shape)
    if isinstance(pending, _NllGrad) and pending.whole and dim == len(shape) - 1:
        return pending.fused(lw, out)
    g = lw.val(args[0])
    row = [*shape[:dim], 1, *shape[dim + 1:]]
    total = lw.emit("sum", [g], [row], {"dim": dim, "keepdim": True})[0]
    e = lw.emit("exp", [out], [shape])[0]
    return lw.emit("sub", [g, lw.emit("mul", [e, total], [shape])[0]], [shape])[0]


def _label_values(lw: _Lowerer, target: Any) -> np.ndarray:
    """The recorded integer ids an op reads (the rank's rows of the batch,
    its microbatch piece, seen with the op's shape)."""
    piece = lw.env.get(target[1])
    if isinstance(piece, _IdRows):
        return piece.ids
    ids = lw.trace.get("batch_ids", {}).get(getattr(piece, "source", None))
    if not isinstance(piece, _Ids) or ids is None:
        raise LoweringError(f"{lw.name}: the values of the labels a loss reads are not recorded")
    ids = np.split(np.asarray(ids), piece.parts, axis=0)[piece.index]
    return ids.reshape(piece.shape) if piece.shape is not None else ids


def _nll_target(lw: _Lowerer, weight: Any, reduction: int, target: Any,
                ignore: Any) -> tuple[int, int]:
    """The one-hot labels the loss reads and the count a mean divides by.

    An ignore index outside ``[0, vocab)`` (the default, -100) ignores none
    of the batch's labels. One inside it zeroes that column of the one-hot
    labels (the rows of that label drop out, for every label matrix), and
    the mean divides by the count of the other labels *in the recorded
    batch*: a constant of the traced step (docs/soundness.md, "Plans traced
    from PyTorch", 10)."""
    if weight is not None or reduction not in (1, 2):
        raise LoweringError(f"{lw.name}: nll_loss with class weights or no reduction is not lowered")
    labels = _one_hot(lw, target)
    count = math.prod(lw.shapes[labels][:-1])
    if isinstance(lw.env.get(target[1]), _IdRows):
        # ids the model padded: the pads (out of the vocabulary) are zero rows
        ids = _label_values(lw, target)
        outside = (ids < 0) | (ids >= lw.vocab)
        if ignore is None or np.any(outside & (ids != int(ignore))):
            raise LoweringError(f"{lw.name}: labels outside the vocabulary other than the "
                                f"ignore_index {ignore}")
        count = int(np.sum(ids != int(ignore)))
    if ignore is not None and 0 <= int(ignore) < lw.vocab:
        keep = np.ones(lw.vocab)
        keep[int(ignore)] = 0.0
        labels = lw.emit("mul", [labels, constant_input(lw, keep)], [lw.shapes[labels]])[0]
        count = int(np.sum(_label_values(lw, target) != int(ignore)))
    if count == 0 and reduction == 1:
        raise LoweringError(f"{lw.name}: a mean cross-entropy over no kept label (every label "
                            f"is ignore_index {ignore})")
    return labels, count


def _to_classes(lw: _Lowerer, labels: int, classes: int, target: Any) -> int:
    """One-hot labels over the vocabulary cut to the first ``classes``
    columns, for a loss over fewer classes than the vocabulary has ids
    (a classifier's labels ``labels[:, 0] % classes``): exact on the
    recorded labels, which all lie below ``classes`` (checked), so the
    columns cut off are zero in every row (docs/soundness.md, "Plans traced
    from PyTorch", 18)."""
    width = lw.shapes[labels][-1]
    if width == classes:
        return labels
    values = _label_values(lw, target)
    inside = (values >= 0) & (values < lw.vocab)
    if width < classes or np.any(values[inside] >= classes):
        raise LoweringError(f"{lw.name}: nll_loss over {classes} classes against labels up to "
                            f"{int(values.max())}")
    shape = [*lw.shapes[labels][:-1], classes]
    return lw.emit("narrow", [labels], [shape], {"dim": len(shape) - 1, "start": 0,
                                                  "length": classes})[0]


def _class_last(lw: _Lowerer, x: int) -> int:
    """``[N, C, d...]`` with the class dim moved last (nll_loss2d's layout to
    the one-hot labels' ``[N, d..., C]``), by adjacent transposes."""
    shape = list(lw.shapes[x])
    for d in range(1, len(shape) - 1):
        shape[d], shape[d + 1] = shape[d + 1], shape[d]
        x = lw.emit("transpose", [x], [tuple(shape)], {"dim0": d, "dim1": d + 1})[0]
    return x


def _class_second(lw: _Lowerer, x: int) -> int:
    """The inverse of ``_class_last``."""
    shape = list(lw.shapes[x])
    for d in range(len(shape) - 2, 0, -1):
        shape[d], shape[d + 1] = shape[d + 1], shape[d]
        x = lw.emit("transpose", [x], [tuple(shape)], {"dim0": d, "dim1": d + 1})[0]
    return x


def _nll(lw: _Lowerer, args, kwargs, shapes, group, classes_second: bool = False):
    """-sum(logp * one-hot labels), divided by the kept-label count for a
    mean: each row's picked log-probability (a row sum, as a loss-parallel
    run computes it), negated, summed. ``classes_second``: nll_loss2d's
    ``[N, C, d...]`` log-probabilities."""
    logp, reduction = lw.val(args[0]), int(args[3])
    if classes_second:
        logp = _class_last(lw, logp)
    labels, count = _nll_target(lw, args[2], reduction, args[1],
                                args[4] if len(args) > 4 else None)
    shape = lw.shapes[logp]
    labels = _to_classes(lw, labels, shape[-1], args[1])
    if lw.shapes[labels] != shape:
        raise LoweringError(f"{lw.name}: nll_loss of {list(shape)} log-probabilities "
                            f"against labels {list(lw.shapes[labels][:-1])}")
    rows = [*shape[:-1], 1]
    picked = lw.emit("sum", [lw.emit("mul", [logp, labels], [shape])[0]], [rows],
                     {"dim": len(shape) - 1, "keepdim": True})[0]
    picked = lw.reshape(picked, tuple(shape[:-1]))
    negated = lw.emit("mul_scalar", [picked], [shape[:-1]], {"value": -1.0})[0]
    out = lw.emit("sum", [negated], [()], {"dim": None, "keepdim": False})[0]
    if reduction == 1:
        out = lw.emit("div", [out], [()], {"value": float(count)})[0]
    return [out, "count"]


@dataclass(frozen=True)
class _NllGrad:
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

    def emit_into(self, lw: _Lowerer) -> int:
        shape = lw.shapes[self.labels]
        out = lw.emit("mul_scalar", [lw.emit("mul", [self.labels, self.g], [shape])[0]], [shape],
                      {"value": -1.0})[0]
        return self.divided(lw, out)

    def fused(self, lw: _Lowerer, logp: int) -> int:
        shape = lw.shapes[logp]
        negated = lw.emit("mul_scalar", [self.labels], [shape], {"value": -1.0})[0]
        e = lw.emit("exp", [logp], [shape])[0]
        total = lw.emit("add", [negated, e], [shape])[0]
        return self.divided(lw, lw.emit("mul", [total, self.g], [shape])[0])

    def divided(self, lw: _Lowerer, x: int) -> int:
        if self.count is None:
            return x
        return lw.emit("div", [x], [lw.shapes[x]], {"value": float(self.count)})[0]


def _nll_bw(lw: _Lowerer, args, kwargs, shapes, group, classes_second: bool = False):
    """-one-hot labels * g, divided by the kept-label count for a mean
    (pending: ``_NllGrad``; nll_loss2d's gradient moved back to its layout)."""
    g, reduction = lw.val(args[0]), int(args[4])
    ignore = args[5] if len(args) > 5 else None
    labels, count = _nll_target(lw, args[3], reduction, args[2], ignore)
    width = lw.shapes[lw.val(args[1])][1 if classes_second else -1]
    labels = _to_classes(lw, labels, width, args[2])
    whole = count == math.prod(lw.shapes[labels][:-1]) \
        and not isinstance(lw.env.get(args[2][1]), _IdRows) \
        and (ignore is None or not 0 <= int(ignore) < lw.vocab)
    grad = _NllGrad(labels, g, count if reduction == 1 else None, whole)
    return _class_second(lw, grad.emit_into(lw)) if classes_second else grad


def _nll2d(lw: _Lowerer, args, kwargs, shapes, group):
    return _nll(lw, args, kwargs, shapes, group, classes_second=True)


def _nll2d_bw(lw: _Lowerer, args, kwargs, shapes, group):
    return _nll_bw(lw, args, kwargs, shapes, group, classes_second=True)


def _silu_bw(lw: _Lowerer, args, kwargs, shapes, group):
    return lw.emit("silu", [lw.val(args[1]), lw.val(args[0])], shapes, direction="bw")[0]


def _reduce(op: str):
    def lower(lw: _Lowerer, args, kwargs, shapes, group):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if isinstance(dim, list) and not dim:
            dim = None
        x = lw.val(args[0])
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = int(dim[0]) % len(lw.shapes[x])  # one dim, as the lowered log-softmax names it
        return lw.emit(op, [x], shapes, {"dim": dim, "keepdim": keepdim})[0]
    return lower


def _matmul(lw: _Lowerer, args, kwargs, shapes, group):
    a, b = lw.env.get(args[0][1]), lw.env.get(args[1][1])
    if isinstance(a, _Flat) and isinstance(b, _Flat) and a.k == b.k:
        lead = lw.shapes[a.x][:a.k]
        out = lw.emit("matmul", [a.x, b.x], [(*lead, *shapes[0][1:])])[0]
        return _Flat(out, a.k)
    return lw.emit("matmul", [lw.val(args[0]), lw.val(args[1])], shapes)[0]


def _copy_in(lw: _Lowerer, args, kwargs, shapes, group):
    parts = [lw.env.get(a[1]) if isinstance(lw.env.get(a[1]), _Padding) else lw.val(a)
             for a in args[0]]
    parts = [lw.flat_of.get(p, p) if isinstance(p, int) else p for p in parts]
    if any(isinstance(p, int) and lw.shapes[p][0] * len(lw.shapes[p]) == 0 for p in parts):
        raise LoweringError(f"{lw.name}: FSDP copy-in of a shard that is not flat")
    packed = _Packed(parts)
    return [packed, packed]


def _pg(lw: _Lowerer, a: Any) -> tuple[int, ...]:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "pg":
        return tuple(a[1])
    raise LoweringError(f"{lw.name}: a c10d collective without a process group")


def _allgather_base(lw: _Lowerer, args, kwargs, shapes, group):
    packed = lw.env.get(args[1][1])
    if not isinstance(packed, _Packed) and not isinstance(packed, (_ChunkCat, str)):
        return _Gathered(lw.val(args[1]), _pg(lw, args[2]))  # dist.all_gather_into_tensor
    if not isinstance(packed, _Packed):
        raise LoweringError(f"{lw.name}: all-gather of a buffer FSDP's copy-in did not fill")
    return _Packed(packed.parts, _pg(lw, args[2]))


def _plain_reduce_scatter(lw: _Lowerer, x: Any, op: Any, ranks: tuple[int, ...], shapes):
    """``dist.reduce_scatter_tensor(out, x)`` of a tensor (not FSDP's
    buffer): a reduce-scatter along dim 0, SUM or AVG."""
    if op[1] not in (0, 1):
        raise LoweringError(f"{lw.name}: reduce-scatter with reduce op {op} is not lowered")
    return lw.emit("reduce_scatter" + ("_avg" if op[1] == 1 else ""), [lw.val(x)], shapes[:1],
                   {"dim": 0}, group=ranks)[0]


def _split_copy(lw: _Lowerer, args, kwargs, shapes, group):
    packed = lw.env.get(args[0][1])
    if not isinstance(packed, _Packed) or packed.group is None:
        raise LoweringError(f"{lw.name}: FSDP copy-out of a buffer that was not all-gathered")
    n = len(packed.group)
    outs = []
    for p, shape in zip(packed.parts, shapes):
        param = p.param if isinstance(p, _Padding) else p
        name = lw.params.get(param)
        if name is not None and lw.trace["params"][name][1][0] % n:
            if any(a not in ("dp", "dps", "dpr") for a in lw.trace["params"][name][2][0]):
                raise LoweringError(f"{lw.name}: FSDP2 over a tensor-parallel shard of {name} "
                                    f"(dim 0 of {lw.trace['params'][name][1][0]} rows, which the "
                                    f"mesh does not divide) is not lowered")
            outs.append(_Unpadded(_padded_gather(lw, name, param, packed.group)))
            continue
        if isinstance(p, _Padding):
            raise LoweringError(f"{lw.name}: FSDP pads a shard of a dim its group divides")
        full = (lw.shapes[p][0] * n, *lw.shapes[p][1:])
        x = lw.emit("all_gather", [p], [full], {"dim": 0}, group=packed.group)[0]
        outs.append(_As(x, tuple(shape)))
    return outs


def padded_rows(rows: int, n: int, index: int) -> tuple[int, int]:
    """The rows [lo, hi) of a dim of ``rows`` that member ``index`` of ``n``
    holds when FSDP2 (or DTensor's ``Shard``) cuts it in chunks of
    ceil(rows / n) (``torch.chunk``; the last members may hold fewer rows,
    or none)."""
    c = -(-rows // n)
    return min(index * c, rows), min((index + 1) * c, rows)


def _sliced_next(lw: _Lowerer, dim: int) -> bool:
    """The first op that reads the current event's output is a slice of it
    along ``dim`` from 0 (DTensor dropping an uneven shard's padding)."""
    out = lw.trace["events"][lw.event][2][0]
    for op, (args, kwargs), *_ in lw.trace["events"][lw.event + 1:]:
        if out in _tensor_args([args, kwargs]):
            return (op == "aten.slice.Tensor" and len(args) > 2
                    and int(args[1]) % len(lw.trace["shapes"][out]) == dim and not args[2])
    return False


def _drops_padding(lw: _Lowerer, src: _GatheredAlong, rows: int, total: int) -> bool:
    """The first ``rows`` of a gather along a dim (``total`` long) are the
    pieces of an uneven shard without their padding: the gathered pieces
    are chunks of ceil(rows / n), and this rank's own piece is its chunk of
    ``rows`` (padded to the chunk when shorter)."""
    n, d = len(src.g.group), src.dim
    chunk = -(-rows // n)
    lo, hi = padded_rows(rows, n, src.g.group.index(lw.trace["rank"]))
    own = lw.shapes[src.g.x][d]
    return (rows < total == chunk * n and own == hi - lo
            and (src.g.padded or own == chunk))


def _uneven_gather(lw: _Lowerer, src: _GatheredAlong, rows: int) -> int:
    """DTensor's all-gather of a dim of ``rows`` the group does not divide:
    each member's piece padded at the end to ceil(rows / n), gathered, the
    first ``rows`` kept. Those are the members' own pieces in group order
    (the padding lies past them): written as for FSDP2's padded parameter
    (docs/soundness.md, "Plans traced from PyTorch", 15e)."""
    g, d = src.g, src.dim
    n = len(g.group)
    full = list(lw.shapes[g.x])
    full[d] = rows
    if not g.padded and lw.shapes[g.x][d] * n == rows:
        return lw.materialize(src)
    return _gather_pieces(lw, g.x, tuple(full), d, g.group, "a DTensor shard")


def _gather_pieces(lw: _Lowerer, own: Any, full: tuple[int, ...], dim: int,
                   group: tuple[int, ...], what: str) -> int:
    """The whole of a dim that ``group`` holds in torch.chunk's pieces (this
    rank's is ``own``): each member's piece sent to every other member and
    the pieces concatenated along ``dim`` in group order (one holder: its
    piece alone)."""
    me, n = lw.trace["rank"], len(group)
    bounds = [padded_rows(full[dim], n, i) for i in range(n)]
    lo, hi = bounds[group.index(me)]

    def shape(a: int, b: int) -> tuple[int, ...]:
        return tuple(b - a if k == dim else m for k, m in enumerate(full))

    if hi > lo and (not isinstance(own, int) or lw.shapes[own] != shape(lo, hi)):
        raise LoweringError(f"{lw.name}: rank {me}'s piece of {what} is not [{lo}, {hi}) of its "
                            f"{full[dim]} along dim {dim}, as torch.chunk cuts it over {n} ranks")
    if hi > lo:
        for dst in group:
            if dst != me:
                lw.nodes.append(LNode("send", "fw", [own], [], {}, lw.name, (me, dst), lw.mb))
    pieces = []
    for src, (a, b) in zip(group, bounds):
        if b == a:
            continue
        if src == me:
            pieces.append(own)
            continue
        pieces.append(lw.emit("send_recv", [], [shape(a, b)], {"src": src, "dst": me},
                              group=(src, me))[0])
    if len(pieces) == 1:
        return pieces[0]
    return lw.emit("cat", pieces, [full], {"dim": dim})[0]


def _padded_gather(lw: _Lowerer, name: str, param: int, group: tuple[int, ...]) -> int:
    """FSDP2's all-gather of a parameter whose dim 0 the group does not
    divide: the gathered buffer's first rows are the members' own rows in
    group order, the padding after them. Each member's rows are sent to
    every other member and concatenated in group order, so no padding value
    enters the plan (docs/soundness.md, "Plans traced from PyTorch", 15)."""
    return _gather_pieces(lw, lw.env.get(param), tuple(lw.trace["params"][name][1]), 0, group,
                          name)


def _padded_reduce(lw: _Lowerer, src: _ChunkCat, g: int, size: list[int]) -> int | _NoShard:
    """A rank's shard of FSDP2's reduce-scatter of a gradient whose dim 0
    the group does not divide (each gradient padded with zero rows to a
    chunk per rank): rows [lo, hi) of the group's sum, written as the
    group's all-reduce narrowed to the rank's rows (under HSDP then summed
    over the replicas, the same rows of the other shard groups). A rank
    holding no rows still joins the all-reduce, which its peers run, and
    keeps nothing (docs/soundness.md, "Plans traced from PyTorch", 15)."""
    shape = list(lw.shapes[g])
    lo, hi = padded_rows(shape[0], len(src.group), src.group.index(lw.trace["rank"]))
    if list(size) != [hi - lo, *shape[1:]]:
        raise LoweringError(f"{lw.name}: a view of FSDP's reduce-scatter output of shape {size} "
                            f"is not this rank's rows [{lo}, {hi}) of a gradient of {shape[0]}")
    x = lw.emit("all_reduce", [g], [shape], group=src.group)[0]
    if hi == lo:
        return _NoShard(g, src.group)
    if hi - lo != shape[0]:
        x = lw.emit("narrow", [x], [size], {"dim": 0, "start": lo, "length": hi - lo})[0]
        lw.row_cuts[x] = src.group
    if src.replicas is not None:
        x = lw.emit("all_reduce", [x], [size], group=src.replicas)[0]
    if src.divide != 1.0:
        x = lw.emit("div", [x], [size], {"value": src.divide})[0]
    return x


def _chunk_cat(lw: _Lowerer, args, kwargs, shapes, group):
    grads = [lw.val(a) for a in args[0]]
    if int(args[1]) != 0:
        raise LoweringError(f"{lw.name}: chunk_cat along dim {args[1]} is not lowered")
    return _ChunkCat(grads, int(args[2]))


def _reduce_scatter_base(lw: _Lowerer, args, kwargs, shapes, group):
    buf = lw.env.get(args[1][1])
    op = args[3]
    if not isinstance(buf, (_ChunkCat, _Packed, _Gathered, str)):
        return _plain_reduce_scatter(lw, args[1], op, _pg(lw, args[2]), shapes)
    if not isinstance(buf, _ChunkCat):
        raise LoweringError(f"{lw.name}: reduce-scatter of a buffer chunk_cat did not fill")
    if op not in (["redop", 0], ("redop", 0), ["redop", 1], ("redop", 1)):
        raise LoweringError(f"{lw.name}: reduce-scatter with reduce op {op} is not lowered")
    g = _pg(lw, args[2])
    if len(g) != buf.chunks:
        raise LoweringError(f"{lw.name}: reduce-scatter of {buf.chunks} chunks over {len(g)} ranks")
    return _ChunkCat(buf.grads, buf.chunks, g, buf.divide * (float(buf.chunks) if op[1] == 1 else 1.0))


def _as_strided(lw: _Lowerer, args, kwargs, shapes, group):
    src = lw.env.get(args[0][1])
    size, stride = list(args[1]), list(args[2])
    offset = int(args[3]) if len(args) > 3 and args[3] is not None else 0
    contiguous = [math.prod(size[k + 1:]) for k in range(len(size))]
    if any(s != c for s, c, n in zip(stride, contiguous, size) if n > 1):
        raise LoweringError(f"{lw.name}: as_strided with strides {stride} is not lowered")
    if isinstance(src, Bucket):
        return bucket_view(lw, src, offset, tuple(size))
    if isinstance(src, _As) and offset == 0 and tuple(size) == lw.shapes[src.x]:
        return src.x
    if isinstance(src, _Unpadded):
        if offset != 0 or tuple(size) != lw.shapes[src.x]:
            raise LoweringError(f"{lw.name}: a view of FSDP's all-gather output of a padded "
                                f"parameter at offset {offset} is not lowered")
        return src.x
    if isinstance(src, _ChunkCat) and (src.group is not None or src.chunks == 1):
        # reduce-scattered, or (a shard group of one rank) never communicated
        at = 0
        for g in src.grads:
            rows, *rest = lw.shapes[g]
            if rows % src.chunks:  # each rank's chunk padded with zero rows
                if at == offset:
                    return _padded_reduce(lw, src, g, size)
                at += -(-rows // src.chunks) * math.prod(rest)
                continue
            numel = math.prod(lw.shapes[g]) // src.chunks
            if at == offset and numel == math.prod(size):
                shape = list(lw.shapes[g])
                shape[0] //= src.chunks
                x = g
                if src.group is not None:
                    x = lw.emit("reduce_scatter", [g], [shape], {"dim": 0}, group=src.group)[0]
                if src.replicas is not None:
                    x = lw.emit("all_reduce", [x], [shape], group=src.replicas)[0]
                if src.divide != 1.0:
                    x = lw.emit("div", [x], [shape], {"value": src.divide})[0]
                return _view_to(lw, x, tuple(size))
            at += numel
        raise LoweringError(f"{lw.name}: a view of FSDP's reduce-scatter output at offset "
                            f"{offset} is not one gradient's shard")
    x = lw.val(args[0])
    if offset != 0 or math.prod(size) != math.prod(lw.shapes[x]):
        raise LoweringError(f"{lw.name}: as_strided at offset {offset} is not lowered")
    if x in lw.flat_of and lw.shapes[lw.flat_of[x]] == tuple(size):
        return lw.flat_of[x]  # a flattened value seen whole again (FSDP of one rank)
    return _view_to(lw, x, tuple(size))


def _t(lw: _Lowerer, args, kwargs, shapes, group):
    x = lw.val(args[0])
    if len(lw.shapes[x]) < 2:
        return x
    return lw.emit("transpose", [x], shapes, {"dim0": 0, "dim1": 1})[0]


def _transpose(lw: _Lowerer, args, kwargs, shapes, group):
    f = lw.env.get(args[0][1])
    if isinstance(f, _Flat) and int(args[1]) % 3 and int(args[2]) % 3 and len(shapes[0]) == 3:
        d0, d1 = int(args[1]) % 3 + f.k - 1, int(args[2]) % 3 + f.k - 1
        shape = list(lw.shapes[f.x])
        shape[d0], shape[d1] = shape[d1], shape[d0]
        return _Flat(lw.emit("transpose", [f.x], [shape], {"dim0": d0, "dim1": d1})[0], f.k)
    x = lw.val(args[0])
    nd = len(lw.shapes[x])
    d0, d1 = int(args[1]) % nd, int(args[2]) % nd
    if d0 == d1:
        return x
    return lw.emit("transpose", [x], shapes, {"dim0": d0, "dim1": d1})[0]


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i == len(src) or j == len(dst):
            return []
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj or (i < len(src) and src[i] == 1 and j == len(dst)) \
                or (j < len(dst) and dst[j] == 1 and i == len(src)):
            if pi <= pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                return []
        groups.append((gi, gj))
    return groups


def _gathered_dim(src: tuple[int, ...], dst: tuple[int, ...], n: int) -> int | None:
    """The dim k along which an all-gather (along dim 0) of ``src`` pieces,
    seen with shape ``dst``, is an all-gather along k: ``dst`` is ``src``
    with dim k n times longer and every dim before k of size 1 (the ranks'
    pieces then lie one after another along k; DTensor's gather of a
    one-row batch along the sequence is such a view)."""
    if len(src) != len(dst):
        return None
    grown = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(grown) != 1:
        return None
    k = grown[0]
    return k if dst[k] == n * src[k] and all(a == 1 for a in src[:k]) else None


def _view(lw: _Lowerer, args, kwargs, shapes, group):
    f = lw.env.get(args[0][1])
    dst = tuple(shapes[0])
    if isinstance(f, _Ids):
        return _Ids(f.source, f.index, f.parts, dst)
    if isinstance(f, _Gathered) and not f.padded:
        k = _gathered_dim(lw.shapes[f.x], dst, len(f.group))
        if k is not None:
            return lw.emit("all_gather", [f.x], [dst], {"dim": k}, group=f.group)[0]
    if isinstance(f, _IdRows):
        return _IdRows(lw.reshape(f.x, (*dst, lw.vocab)), f.ids.reshape(dst))
    if isinstance(f, (_Flat, _As)) and lw.shapes[f.x] == dst:
        return f.x
    if isinstance(f, _As):
        return _As(f.x, dst)
    if isinstance(f, (_Packed, _ChunkCat, _Unpadded)) or f == "empty":
        return f
    if isinstance(f, Complex):
        return Complex(lw.reshape(f.re, dst), lw.reshape(f.im, dst))
    return _view_to(lw, lw.val(args[0]), dst)


def _view_to(lw: _Lowerer, x: int, dst: tuple[int, ...]) -> int | _Flat:
    src = lw.shapes[x]
    if src == dst:
        return x
    if x in lw.flat_of and lw.shapes[lw.flat_of[x]] == dst:
        return lw.flat_of[x]  # a flattened value seen with its own shape again
    groups = _reshape_groups(src, dst)
    if groups and len(groups[0][0]) > 1 and len(groups[0][1]) == 1 and len(src) > 3 and len(dst) > 1 \
            and all(len(gi) == 1 and len(gj) == 1 for gi, gj in groups[1:]):
        return _Flat(x, len(groups[0][0]))
    if not groups:
        raise LoweringError(f"{lw.name}: reshape {list(src)} -> {list(dst)} is not lowered")
    if len(dst) == 1 and len(src) > 1:
        out = lw.emit("flatten", [x], [dst], {"start": 0, "end": len(src) - 1})[0]
        lw.flat_of[out] = x
        return out
    pos = 0
    cur = x
    for gi, gj in groups:
        shape = list(lw.shapes[cur])
        if len(gi) > 1:
            merged = shape[:pos] + [math.prod(shape[pos:pos + len(gi)])] + shape[pos + len(gi):]
            cur = lw.emit("flatten", [cur], [merged], {"start": pos, "end": pos + len(gi) - 1})[0]
            shape = merged
        if len(gj) > 1:
            sizes = [dst[j] for j in gj]
            split = shape[:pos] + sizes + shape[pos + 1:]
            cur = lw.emit("unflatten", [cur], [split], {"dim": pos, "sizes": sizes})[0]
        pos += len(gj)
    return cur


def _expand(lw: _Lowerer, args, kwargs, shapes, group):
    x = lw.val(args[0])
    if lw.shapes[x] == tuple(shapes[0]):
        return x
    return lw.emit("expand", [x], shapes, {"shape": list(shapes[0])})[0]


def _constant(op: str):
    def lower(lw: _Lowerer, args, kwargs, shapes, group):
        return lw.emit(op, [], shapes, {"shape": list(shapes[0])}, direction="none")[0]
    return lower


def _one_hot(lw: _Lowerer, ids: Any) -> int:
    """The one-hot rows of the ids an op reads: the input, or a microbatch
    of it (one ``split`` per piece), reshaped as the ids were."""
    piece = lw.env.get(ids[1]) if isinstance(ids, (list, tuple)) and ids[0] == "v" else None
    if isinstance(piece, _IdRows):
        return piece.x
    if not isinstance(piece, _Ids):
        raise LoweringError(f"{lw.name}: integer ids other than the batch's are not lowered")
    return one_hot_of(lw, piece)


def one_hot_of(lw: _Lowerer, piece: _Ids) -> int:
    """The one-hot rows of a piece of the batch's ids, shaped as the piece."""
    base = _Ids(piece.source, piece.index, piece.parts)
    if base not in lw.id_pieces:
        x = lw.one_hot[piece.source]
        if piece.parts > 1:
            shape = list(lw.shapes[x])
            shape[0] //= piece.parts
            x = lw.emit("split", [x], [shape],
                        {"dim": 0, "parts": piece.parts, "index": piece.index})[0]
        lw.id_pieces[base] = x
    x = lw.id_pieces[base]
    if piece.shape is not None and piece.shape != lw.shapes[x][:-1]:
        if piece not in lw.id_pieces:
            lw.id_pieces[piece] = lw.materialize(_view_to(lw, x, (*piece.shape, lw.vocab)))
        x = lw.id_pieces[piece]
    return x


def _embedding(lw: _Lowerer, args, kwargs, shapes, group):
    """The lookup; its ``padding_idx`` changes only the backward (a separate
    recorded op, ``_embedding_bw``), not the rows looked up, so it is not
    read here (docs/soundness.md, "Plans traced from PyTorch", 25)."""
    ids = lw.env.get(args[1][1])
    if isinstance(ids, Const):
        rows = lw.shapes[lw.val(args[0])][0]
        onehot = one_hot_constant(lw, constant_value(lw, args[1]), rows)
        return lw.emit("embedding", [onehot, lw.val(args[0])], shapes)[0]
    if not isinstance(ids, _Shifted):
        return lw.emit("embedding", [_one_hot(lw, args[1]), lw.val(args[0])], shapes)[0]
    # a vocabulary-parallel lookup: the one-hot rows' slice [lo, hi) times the
    # local table, zero for ids outside it (which the masked lookup zeroes after)
    w = lw.val(args[0])
    mask = ids.mask
    rows = lw.shapes[w][0]
    if mask is None or mask.lo != ids.lo or mask.hi - mask.lo != rows or mask.lo % rows \
            or lw.vocab % rows:
        raise LoweringError(f"{lw.name}: an embedding of shifted ids that is not a "
                            f"vocabulary-parallel lookup of its table's rows")
    onehot = _one_hot(lw, ("v", _ids_value(lw, mask.ids)))
    shape = [*lw.shapes[onehot][:-1], rows]
    part = lw.emit("split", [onehot], [shape], {"dim": len(shape) - 1, "parts": lw.vocab // rows,
                                                 "index": mask.lo // rows})[0]
    out = lw.emit("embedding", [part, w], shapes)[0]
    return _MaskedLookup(out, mask)


def _ids_value(lw: _Lowerer, ids: _Ids) -> int:
    """A recorded value holding these ids (for ``_one_hot``)."""
    for v, x in lw.env.items():
        if x == ids:
            return v
    raise LoweringError(f"{lw.name}: ids no recorded op produced")


@dataclass(frozen=True)
class _Compare:
    """``x op c`` for a computed tensor x and a number c (op gt, ge, lt, le):
    kept pending until a ``where`` selects with it."""
    x: int
    op: str
    c: float


def _ids_test(op: str):
    def lower(lw: _Lowerer, args, kwargs, shapes, group):
        ids = lw.env.get(args[0][1])
        value = lw.const(args[1])
        if not isinstance(ids, _Ids) and value is not None and op in ("lt", "ge", "gt", "le"):
            return _Compare(lw.val(args[0]), op, value)
        if not isinstance(ids, _Ids) or value is None:
            raise LoweringError(f"{lw.name}: a comparison other than of the batch's ids with "
                                f"a number is not lowered")
        return _IdsTest(ids, op, int(value))
    return lower


def _or(lw: _Lowerer, args, kwargs, shapes, group):
    a, b = lw.env.get(args[0][1]), lw.env.get(args[1][1])
    if isinstance(a, _IdsTest) and isinstance(b, _IdsTest) and a.ids == b.ids \
            and (a.op, b.op) == ("lt", "ge"):
        return _VocabMask(a.ids, a.value, b.value)
    raise LoweringError(f"{lw.name}: an 'or' other than of ids < lo and ids >= hi is not lowered")


def _sub(lw: _Lowerer, args, kwargs, shapes, group):
    a = lw.env.get(args[0][1])
    value = lw.const(args[1])
    if isinstance(a, _Ids) and value is not None:
        return _Shifted(a, int(value))
    if value is not None:
        return lw.emit("add_scalar", [lw.val(args[0])], shapes, {"value": -value})[0]
    return lw.emit("sub", [lw.val(args[0]), lw.val(args[1])], shapes)[0]


def _index_put(lw: _Lowerer, args, kwargs, shapes, group):
    """``x[mask] = 0`` of a vocabulary-parallel lookup: on its shifted ids, or
    on its output (already zero there in the one-hot form)."""
    target = lw.env.get(args[0][1])
    masks = [lw.env.get(m[1]) for m in args[1]] if isinstance(args[1], (list, tuple)) else []
    accumulate = bool(args[3]) if len(args) > 3 else False
    if len(masks) == 1 and isinstance(masks[0], _VocabMask) and lw.const(args[2]) == 0 \
            and not accumulate:
        mask = masks[0]
        if isinstance(target, _Shifted) and target.ids == mask.ids and target.mask is None:
            return _Shifted(target.ids, target.lo, mask)
        if isinstance(target, _MaskedLookup) and target.mask == mask:
            return target.out
    raise LoweringError(f"{lw.name}: index_put_ other than the masking of a "
                        f"vocabulary-parallel lookup is not lowered")


def _embedding_bw(lw: _Lowerer, args, kwargs, shapes, group):
    """The one-hot rows' transpose times the gradient. With a ``padding_idx``
    p (the forward lookup is unchanged), the one-hot rows times the constant
    row that is 0 at p and 1 elsewhere: a row of id p becomes a zero row and
    adds nothing to the table's gradient, any other row is unchanged
    (docs/soundness.md, "Plans traced from PyTorch", 16)."""
    padding = args[3] if len(args) > 3 else kwargs.get("padding_idx", -1)
    rows = int(args[2])
    if len(args) > 4 and args[4]:
        raise LoweringError(f"{lw.name}: embedding backward with scale_grad_by_freq is not lowered")
    if isinstance(lw.env.get(args[1][1]), Const):
        tokens = one_hot_constant(lw, constant_value(lw, args[1]), rows)
    else:
        tokens = _one_hot(lw, args[1])
    if padding is not None and 0 <= int(padding) < rows:
        keep = np.ones(rows)
        keep[int(padding)] = 0.0
        tokens = lw.emit("mul", [tokens, constant_input(lw, keep)], [lw.shapes[tokens]])[0]
    out = lw.new(shapes[0])
    lw.nodes.append(LNode("embedding", "bw", [tokens, -1, lw.val(args[0])], [-1, out], {},
                          lw.name, None, lw.mb))
    return out


def _copy(lw: _Lowerer, args, kwargs, shapes, group):
    src = lw.env.get(args[1][1])
    if isinstance(src, _ChunkCat) and src.chunks == 1:
        return src  # FSDP's gradient buffer of a one-rank shard group, copied out
    if isinstance(src, Bucket):
        return src
    return lw.val(args[1])


#: c10d reduce ops as the rule table's collectives (sum, or the group's mean)
REDUCE_OPS = {"sum": "", "avg": "_avg"}


def _all_reduce(lw: _Lowerer, args, kwargs, shapes, group):
    if args[1] not in REDUCE_OPS:
        raise LoweringError(f"{lw.name}: all_reduce with op {args[1]} is not lowered")
    return lw.emit("all_reduce" + REDUCE_OPS[args[1]], [lw.val(args[0])], shapes, group=group)[0]


def _all_gather(lw: _Lowerer, args, kwargs, shapes, group):
    x = lw.env.get(args[0][1])
    if isinstance(x, _ZeroPadded):
        return _Gathered(x.x, group, padded=True)
    return _Gathered(lw.val(args[0]), group)


def _reduce_scatter(lw: _Lowerer, args, kwargs, shapes, group):
    if args[1] not in REDUCE_OPS:
        raise LoweringError(f"{lw.name}: reduce_scatter with op {args[1]} is not lowered")
    x = lw.env.get(args[0][1])
    if isinstance(x, _Stacked):
        if x.parts != len(group):
            raise LoweringError(f"{lw.name}: reduce_scatter of a buffer split {x.parts} ways "
                                f"over a group of {len(group)}")
        src, dim = x.x, x.dim
    else:
        src, dim = lw.val(args[0]), 0
    return lw.emit("reduce_scatter" + REDUCE_OPS[args[1]], [src], shapes, {"dim": dim},
                   group=group)[0]


def _split(lw: _Lowerer, args, kwargs, shapes, group):
    """Equal pieces (``split``, ``chunk``) stay pieces until read (DTensor's
    and FSDP's layouts fold them away); unequal ones are ``narrow`` nodes."""
    src = lw.env.get(args[0][1])
    dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", 0))
    n = len(shapes)
    if len({tuple(s) for s in shapes}) != 1:
        if isinstance(src, _Ids):
            raise LoweringError(f"{lw.name}: integer ids split into unequal pieces")
        x = lw.val(args[0])
        dim %= len(lw.shapes[x])
        outs, at = [], 0
        for shape in shapes:
            size = shape[dim]
            outs.append(lw.emit("narrow", [x], [shape], {"dim": dim, "start": at, "length": size})[0])
            at += size
        return outs
    if isinstance(src, _Ids) and dim == 0 and src.shape is None:
        return [src.cut(i, n) for i in range(n)]
    if n == 1:
        return lw.val(args[0])
    if isinstance(src, _Gathered) and dim == 0 and n == len(src.group):
        return [_Piece(src, 0, i, n) for i in range(n)]
    x = lw.val(args[0])
    return [_Piece(x, dim % len(lw.shapes[x]), i, n) for i in range(n)]


def _slice(lw: _Lowerer, args, kwargs, shapes, group):
    """A slice that is one of equal pieces (a schedule's microbatch); of
    an all-gather, its first rows (DTensor's gather of an uneven shard)."""
    src = lw.env.get(args[0][1])
    dim, start = (int(args[1]) if len(args) > 1 else 0), (args[2] if len(args) > 2 else 0) or 0
    if isinstance(src, _GatheredAlong) and dim % len(shapes[0]) == src.dim and start == 0 \
            and _drops_padding(lw, src, shapes[0][src.dim],
                               lw.trace["shapes"][args[0][1]][src.dim]):
        return _uneven_gather(lw, src, shapes[0][src.dim])
    step = args[4] if len(args) > 4 else 1
    if isinstance(src, _Ids) and (dim != 0 or src.shape is not None) or isinstance(src, _IdRows):
        return _slice_ids(lw, args, shapes)
    if isinstance(src, Bucket) and step == 1 and dim == 0:
        return bucket_view(lw, src, int(start), tuple(shapes[0]))
    if isinstance(src, _Ids):
        total = lw.trace["data"][1][0] // src.parts
    else:
        x = lw.val(args[0])
        dim %= len(lw.shapes[x])
        total = lw.shapes[x][dim]
    size = shapes[0][dim]
    start = start + total if start < 0 else start
    if step == 1 and size and not isinstance(src, _Ids) and (total % size or start % size):
        return lw.emit("narrow", [x], shapes, {"dim": dim, "start": start, "length": size})[0]
    if step != 1 or size == 0 or total % size or start % size:
        raise LoweringError(f"{lw.name}: a slice of dim {dim} at {start} that is not one of "
                            f"equal pieces")
    index, parts = start // size, total // size
    if isinstance(src, _Ids):
        return src.cut(index, parts)
    return x if parts == 1 else _Piece(x, dim, index, parts)


def _id_rows(lw: _Lowerer, a: Any) -> _IdRows:
    """Ids (the batch's, or already cut) as their one-hot rows and values."""
    src = lw.env.get(a[1])
    if isinstance(src, _IdRows):
        return src
    return _IdRows(_one_hot(lw, a), _label_values(lw, a))


def _slice_ids(lw: _Lowerer, args, shapes) -> _IdRows:
    """A slice of integer ids along any dim (a shifted ``labels[:, 1:]``):
    a narrow of their one-hot rows."""
    rows = _id_rows(lw, args[0])
    nd = rows.ids.ndim
    dim = int(args[1]) % nd if len(args) > 1 else 0
    total = rows.ids.shape[dim]
    start, end = (args[2] if len(args) > 2 else 0) or 0, args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    start, stop, _ = slice(start, end, step).indices(total)
    if step != 1:
        raise LoweringError(f"{lw.name}: a strided slice of the integer ids is not lowered")
    length = max(stop - start, 0)
    shape = list(lw.shapes[rows.x])
    shape[dim] = length
    x = lw.emit("narrow", [rows.x], [shape], {"dim": dim, "start": start, "length": length})[0]
    return _IdRows(x, np.take(rows.ids, range(start, start + length), axis=dim))


def _pad_ids(lw: _Lowerer, args, kwargs, shapes, group):
    """``F.pad`` of integer ids with a value outside the vocabulary (a label
    the loss ignores): zero one-hot rows concatenated on either side."""
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    src = lw.env.get(args[0][1])
    if not isinstance(src, (_Ids, _IdRows)):
        return _zero_padded(lw, args, value)
    if 0 <= int(value) < lw.vocab:
        raise LoweringError(f"{lw.name}: ids padded with {value}, a label of the vocabulary, "
                            f"are not lowered (pad with the loss's ignore_index)")
    rows = _id_rows(lw, args[0])
    pads = list(args[1])
    x, ids = rows.x, rows.ids
    for k in range(len(pads) // 2):
        dim = ids.ndim - 1 - k
        before, after = int(pads[2 * k]), int(pads[2 * k + 1])
        if before < 0 or after < 0:
            raise LoweringError(f"{lw.name}: a negative pad of integer ids is not lowered")
        pieces = []
        for width, at_end in ((before, False), (after, True)):
            if width:
                zshape = list(lw.shapes[x])
                zshape[dim] = width
                pieces.append((at_end, lw.emit("zeros", [], [zshape], {"shape": zshape},
                                               direction="none")[0]))
        if pieces:
            parts = [p for end, p in pieces if not end] + [x] + [p for end, p in pieces if end]
            shape = list(lw.shapes[x])
            shape[dim] += before + after
            x = lw.emit("cat", parts, [shape], {"dim": dim})[0]
            width = [(0, 0)] * ids.ndim
            width[dim] = (before, after)
            ids = np.pad(ids, width, constant_values=int(value))
    return _IdRows(x, ids)


def _zero_padded(lw: _Lowerer, args, value) -> _ZeroPadded:
    """A tensor padded with zeros at the end of one dim (DTensor's piece of
    an uneven shard, before its all-gather): pending, read only by it."""
    pads = [int(p) for p in args[1]]
    x = lw.val(args[0])
    widths = [(k, pads[2 * k], pads[2 * k + 1]) for k in range(len(pads) // 2)
              if pads[2 * k] or pads[2 * k + 1]]
    if float(value) != 0.0 or len(widths) != 1 or widths[0][1] != 0 or widths[0][2] < 0:
        raise LoweringError(f"{lw.name}: constant_pad_nd of other than integer ids is not "
                            f"lowered, except zeros at the end of one dim before an all-gather")
    k, _, width = widths[0]
    return _ZeroPadded(x, len(lw.shapes[x]) - 1 - k, width)


def _send(lw: _Lowerer, args, kwargs, shapes, group):
    ranks = _pg(lw, args[1])
    (x,) = args[0]
    me = lw.trace["rank"]
    lw.nodes.append(LNode("send", "fw", [lw.val(x)], [], {}, lw.name, (me, ranks[int(args[2])]),
                          lw.mb))
    return []


def _recv(lw: _Lowerer, args, kwargs, shapes, group):
    ranks = _pg(lw, args[1])
    src, me = ranks[int(args[2])], lw.trace["rank"]
    return lw.emit("send_recv", [], shapes, {"src": src, "dst": me}, group=(src, me))


def _cat(lw: _Lowerer, args, kwargs, shapes, group):
    items = [lw.env.get(a[1]) for a in args[0]]
    dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
    first = items[0]
    if all(isinstance(p, _Piece) for p in items) and [p.index for p in items] == list(range(len(items))) \
            and all(p.of is first.of for p in items) and len(items) == first.parts:
        if isinstance(first.of, _Gathered):
            along = _GatheredAlong(first.of, dim % len(shapes[0]))
            return along if _sliced_next(lw, along.dim) else lw.materialize(along)
        if dim == 0:
            return _Stacked(first.of, first.dim, first.parts)
        if dim % len(shapes[0]) == first.dim:
            return first.of
    if any(isinstance(p, (_Gathered, _Packed, _ChunkCat)) for p in items):
        raise LoweringError(f"{lw.name}: cat of a collective's buffer is not lowered")
    parts = [lw.val(a) for a in args[0]]
    if len(parts) > 1 and all(len(s) == 1 for s in shapes) and all(p in lw.flat_of for p in parts):
        # flattened tensors side by side (a flat gradient bucket by hand)
        return Bucket(tuple(lw.flat_of[p] for p in parts))
    if len(parts) == 1:
        return parts[0]
    return lw.emit("cat", parts, shapes, {"dim": dim % len(shapes[0])})[0]


def _allreduce_inplace(lw: _Lowerer, args, kwargs, shapes, group):
    """``dist.all_reduce(t)`` of one tensor with SUM (c10d's in-place
    all-reduce); of FSDP's reduced buffer (HSDP's all-reduce across
    replicas, SUM or AVG), recorded on the buffer and emitted per gradient."""
    tensors, op = args[0], args[2]
    buf = lw.env.get(tensors[0][1]) if len(tensors) == 1 else None
    if isinstance(buf, Bucket):
        return [all_reduce_bucket(lw, buf, op, _pg(lw, args[1]))]
    if isinstance(buf, _ChunkCat) and (buf.group is not None or buf.chunks == 1):
        if buf.replicas is not None:
            raise LoweringError(f"{lw.name}: FSDP's reduced buffer all-reduced twice")
        if op not in (["redop", 0], ("redop", 0), ["redop", 1], ("redop", 1)):
            raise LoweringError(f"{lw.name}: all-reduce of FSDP's buffer with reduce op {op} "
                                f"is not lowered")
        replicas = _pg(lw, args[1])
        divide = buf.divide * (float(len(replicas)) if op[1] == 1 else 1.0)
        return [_ChunkCat(buf.grads, buf.chunks, buf.group, divide, replicas)]
    if len(tensors) != 1 or op not in (["redop", 0], ("redop", 0)):
        raise LoweringError(f"{lw.name}: c10d allreduce_ other than a SUM of one tensor is not lowered")
    return [lw.emit("all_reduce", [lw.val(tensors[0])], shapes[:1], group=_pg(lw, args[1]))[0]]


def _add(lw: _Lowerer, args, kwargs, shapes, group):
    """``scores + mask`` with the constant causal mask, or an addition."""
    masked = causal_add(lw, args, shapes)
    return masked if masked is not None else _binary("add", "add_scalar")(lw, args, kwargs,
                                                                          shapes, group)


def _to_copy(lw: _Lowerer, args, kwargs, shapes, group):
    """A change of precision (lower_nn.to_copy); the batch's integer ids are
    never converted to numbers."""
    x = lw.env.get(args[0][1])
    if isinstance(x, (_Ids, _Shifted, _IdsTest, _VocabMask)):
        raise LoweringError(f"{lw.name}: the batch's integer ids converted to numbers")
    if isinstance(x, _ChunkCat) and (x.group is not None or x.chunks == 1):
        # FSDP's reduced buffer cast back from its reduce dtype
        if "float" not in str(kwargs.get("dtype", "")) and "double" not in str(kwargs.get("dtype", "")):
            raise LoweringError(f"{lw.name}: FSDP's reduced buffer converted to {kwargs.get('dtype')}")
        return x
    return to_copy(lw, args, kwargs, shapes, group)


def _permute(lw: _Lowerer, args, kwargs, shapes, group):
    """A permutation as the transposes that sort it."""
    x = lw.val(args[0])
    order = [int(d) % len(lw.shapes[x]) for d in args[1]]
    current = list(range(len(order)))
    for pos, want in enumerate(order):
        at = current.index(want)
        if at != pos:
            shape = list(lw.shapes[x])
            shape[pos], shape[at] = shape[at], shape[pos]
            x = lw.emit("transpose", [x], [shape], {"dim0": pos, "dim1": at})[0]
            current[pos], current[at] = current[at], current[pos]
    return x


# -- gradient clipping: norms ------------------------------------------------------

def _square_sum(lw: _Lowerer, x: int) -> int:
    shape = lw.shapes[x]
    sq = lw.emit("mul", [x, x], [shape])[0]
    return lw.emit("sum", [sq], [()], {"dim": None, "keepdim": False})[0]


def _check_two_norm(lw: _Lowerer, ord_: Any) -> None:
    if float(ord_) != 2.0:
        raise LoweringError(f"{lw.name}: a norm of order {ord_} is not lowered (only 2-norms)")


def _foreach_norm(lw: _Lowerer, args, kwargs, shapes, group):
    """One 2-norm per tensor: sqrt of its square sum, kept pending (``_Norm``)."""
    _check_two_norm(lw, args[1] if len(args) > 1 else 2.0)
    return [_Norm(_square_sum_of(lw, a)) for a in args[0]]


def _square_sum_of(lw: _Lowerer, a: Any) -> int:
    """The square sum of a tensor; of a gradient's empty shard, 0 (a sum
    over no rows: docs/soundness.md, "Plans traced from PyTorch", 15d)."""
    x = lw.env.get(a[1])
    if isinstance(x, _NoShard) and x.grad >= 0:
        s = lw.emit("zeros", [], [()], {"shape": []}, direction="none")[0]
        lw.empty_sums[s] = (x.grad, x.group)
        return s
    return _square_sum(lw, lw.val(a))


def _vector_norm(lw: _Lowerer, args, kwargs, shapes, group):
    """The 2-norm of a tensor, or of a stack of norms: sqrt of the sum of
    the square sums (the square of a norm of a square sum s is s, s >= 0),
    summed in stack order."""
    _check_two_norm(lw, args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim not in (None, []):
        return _norm_along(lw, lw.val(args[0]), list(dim),
                           bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False)), shapes)
    x = lw.env.get(args[0][1])
    if isinstance(x, _NormStack) and not x.squared:
        total = None
        for norm in x.norms:
            if norm.share != 1:
                raise LoweringError(f"{lw.name}: the norm of a stack of partial norms, never "
                                    f"reduced, is not lowered")
            total = norm.s if total is None else lw.emit("add", [total, norm.s], [()])[0]
        return _Norm(total)
    return _Norm(_square_sum(lw, lw.val(args[0])))


def _norm_along(lw: _Lowerer, x: int, dims: list[int], keepdim: bool, shapes) -> int:
    """``x.norm(dim=dims)``: pow(sum(x * x, dims), 0.5)."""
    nd = len(lw.shapes[x])
    dims = sorted(d % nd for d in dims)
    sq = lw.emit("mul", [x, x], [lw.shapes[x]])[0]
    s = lw.emit("sum", [sq], shapes, {"dim": dims, "keepdim": keepdim})[0]
    out = lw.emit("pow", [s], shapes, {"exponent": 0.5})[0]
    if keepdim:
        lw.norms[out] = x
    return out


@dataclass(frozen=True)
class _NormIsZero:
    """``norm == 0`` for a 2-norm along dims (kept dims) of a tensor."""
    norm: int


def _eq_scalar(lw: _Lowerer, args, kwargs, shapes, group):
    """``norm == 0`` (the norm's backward guards its division with it)."""
    n = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
    if isinstance(n, int) and n in lw.norms and lw.const(args[1]) == 0:
        return _NormIsZero(n)
    raise LoweringError(f"{lw.name}: a comparison other than a norm's with 0 is not lowered")


def _masked_fill_pending(lw: _Lowerer, args, kwargs, shapes, group):
    """A constant mask's fill (``lower_nn.masked_fill``), or the norm's
    backward guard ``(x / n).masked_fill_(n == 0, 0)`` for ``n`` the 2-norm
    of ``x`` along kept dims: the identity, since in real arithmetic ``n =
    0`` only where every entry of ``x`` along the dims is 0, where ``x / n``
    is then ``0 * pow(0, -1) = 0`` already (docs/soundness.md, "Plans
    traced from PyTorch", 10)."""
    mask = lw.env.get(args[1][1])
    if not isinstance(mask, _NormIsZero):
        return masked_fill(lw, args, kwargs, shapes, group)
    q = lw.val(args[0])
    if lw.quotients.get(q) != (lw.norms[mask.norm], mask.norm) or lw.const(args[2]) != 0:
        raise LoweringError(f"{lw.name}: a fill where a norm is 0 of other than the norm's "
                            f"input divided by it is not lowered")
    return q


def _selected(lw: _Lowerer, cmp: _Compare, t: int, where_true: bool, shape) -> int:
    """``t`` where ``cmp`` holds (``where_true``) or where it does not, else
    0. With step(y) = 1 for y > 0, else 0 (relu's derivative, the rule
    table's ``relu`` backward is ``g * step(y)``): x > c is step(x - c),
    x < c is step(c - x), x >= c and x <= c their complements."""
    positive = cmp.op in ("gt", "le")  # gt: step(x - c); le: 1 - step(x - c)
    sign = 1.0 if positive else -1.0
    y = lw.emit("mul_scalar", [cmp.x], [lw.shapes[cmp.x]], {"value": sign})[0]
    y = lw.emit("add_scalar", [y], [lw.shapes[cmp.x]], {"value": -sign * cmp.c})[0]
    if lw.shapes[y] != tuple(shape) or lw.shapes[t] != tuple(shape):
        raise LoweringError(f"{lw.name}: a where on a comparison that broadcasts is not lowered")
    stepped = lw.emit("relu", [y, t], [shape], direction="bw")[0]
    if where_true == (cmp.op in ("gt", "lt")):
        return stepped
    return lw.emit("sub", [t, stepped], [shape])[0]


def _where_pending(lw: _Lowerer, args, kwargs, shapes, group):
    """``where(x op c, t, 0)`` or ``where(x op c, 0, t)`` (clamp's backward),
    else a constant mask's ``where`` (``lower_nn.where``)."""
    cond = lw.env.get(args[0][1])
    if not isinstance(cond, _Compare):
        return where(lw, args, kwargs, shapes, group)
    if lw.const(args[2]) == 0:
        return _selected(lw, cond, lw.val(args[1]), True, shapes[0])
    if lw.const(args[1]) == 0:
        return _selected(lw, cond, lw.val(args[2]), False, shapes[0])
    raise LoweringError(f"{lw.name}: where on a comparison without a zero branch is not lowered")


def _clamp_min(lw: _Lowerer, args, kwargs, shapes, group):
    bound = lw.const(args[1])
    if bound is None:
        raise LoweringError(f"{lw.name}: clamp_min by a tensor is not lowered")
    return lw.emit("clamp", [lw.val(args[0])], shapes, {"min": bound, "max": None})[0]


def _stack(lw: _Lowerer, args, kwargs, shapes, group):
    items = [lw.env.get(a[1]) for a in args[0]]
    dim = int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0))
    if items and all(isinstance(x, _Norm) for x in items) and dim == 0:
        return _NormStack(tuple(items))
    raise LoweringError(f"{lw.name}: stack of tensors other than norms is not lowered")


def _sqrt2_share(value: float) -> int | None:
    """n when value is DTensor's float sqrt(n), n a positive integer."""
    n = round(value * value)
    return n if n >= 1 and math.isclose(math.sqrt(n), value, rel_tol=1e-15, abs_tol=0) else None


def _div_tensor(lw: _Lowerer, args, kwargs, shapes, group):
    x = lw.env.get(args[0][1])
    value = lw.const(args[1])
    if isinstance(x, _Norm) and value is not None and x.share == 1:
        share = _sqrt2_share(value)
        if share is None:
            raise LoweringError(f"{lw.name}: a norm divided by {value} is not lowered")
        return _Norm(x.s, share)
    if isinstance(x, _Denom) and x.root and value is not None:
        return _Denom(x.v2, value, 0.0)
    return _scalar("div")(lw, args, kwargs, shapes, group)


def _pow_pending(lw: _Lowerer, args, kwargs, shapes, group):
    """A power; of a norm or a stack of norms, kept pending: the square of a
    norm is its square sum, the root of a squared stack its norms again
    (a stack's entries always carry their square sums)."""
    x = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
    e = float(args[1])
    if isinstance(x, _Norm) and e == 2.0:
        return _squared(lw, x)
    if isinstance(x, _NormStack) and e == 2.0 and not x.squared:
        return _NormStack(x.norms, squared=True)
    if isinstance(x, _NormStack) and e == 0.5 and x.squared \
            and all(n.share == 1 for n in x.norms):
        return _NormStack(x.norms)
    return _pow(lw, args, kwargs, shapes, group)


def _squared(lw: _Lowerer, x: _Norm) -> int:
    """The square of a norm: its square sum (divided by its share)."""
    if x.share == 1:
        return x.s
    return lw.emit("div", [x.s], [lw.shapes[x.s]], {"value": float(x.share)})[0]


def _all_reduce_pending(lw: _Lowerer, args, kwargs, shapes, group):
    """DTensor's reduction of partial norms: the squared stack summed over the
    group. A square sum that is a partial sum over the group is all-reduced;
    a replicated one, divided by the group size on each of its ranks, sums
    back to itself (the n shares of s / n are s), so it is kept."""
    x = lw.env.get(args[0][1])
    if not isinstance(x, _NormStack) or not x.squared:
        return _all_reduce(lw, args, kwargs, shapes, group)
    if args[1] != "sum":
        raise LoweringError(f"{lw.name}: all_reduce of norms with op {args[1]} is not lowered")
    out = []
    for norm in x.norms:
        if norm.share == 1:
            s = lw.emit("all_reduce", [norm.s], [lw.shapes[norm.s]], group=group)[0]
        elif norm.share == len(group):
            s = norm.s
        else:
            raise LoweringError(f"{lw.name}: a norm shared {norm.share} ways reduced over "
                                f"{len(group)} ranks")
        out.append(_Norm(s))
    return _NormStack(tuple(out), squared=True)


def _reciprocal(lw: _Lowerer, args, kwargs, shapes, group):
    return lw.emit("pow", [lw.val(args[0])], shapes, {"exponent": -1.0})[0]


def _clamp(lw: _Lowerer, args, kwargs, shapes, group):
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    bounds = {"min": None if lo is None else lw.const(lo), "max": None if hi is None else lw.const(hi)}
    if (lo is not None and bounds["min"] is None) or (hi is not None and bounds["max"] is None):
        raise LoweringError(f"{lw.name}: clamp by a tensor is not lowered")
    return lw.emit("clamp", [lw.val(args[0])], shapes, bounds)[0]


def _foreach_mul_(lw: _Lowerer, args, kwargs, shapes, group):
    """Each tensor of the list times the scalar (clipping's coefficient)."""
    c = lw.val(args[1])
    return [_NoShard() if isinstance(lw.env.get(a[1]), _NoShard)
            else lw.emit("mul", [lw.val(a), c], [lw.shapes[lw.val(a)]])[0] for a in args[0]]


# -- the optimizer step: torch.optim's AdamW and SGD (for-loop implementation) -----

def _zeros_like(lw: _Lowerer, args, kwargs, shapes, group):
    """A zero tensor; shaped like a parameter, a fresh optimizer state, named
    after it (so each rank's state is matched with its own parameter's)."""
    p = lw.env.get(args[0][1])
    if p in lw.params:
        lw.name = f"{lw.params[p]}.optimizer"
    out = _constant("zeros")(lw, args, kwargs, shapes, group)
    if p in lw.params:
        lw.fresh_state.add(out)
    return out


def _mul_inplace(lw: _Lowerer, args, kwargs, shapes, group):
    x = lw.env.get(args[0][1])
    value = lw.const(args[1])
    if value is not None and x in lw.params:
        return _Decayed(x, value)
    if value is not None and x in lw.fresh_state:
        return _Scaled(x, value)
    return _binary("mul", "mul_scalar")(lw, args, kwargs, shapes, group)


def _lerp(lw: _Lowerer, args, kwargs, shapes, group):
    m, weight = lw.env.get(args[0][1]), lw.const(args[2])
    if m not in lw.fresh_state or weight is None or 1.0 - (1.0 - weight) != weight:
        raise LoweringError(f"{lw.name}: lerp_ other than Adam's first moment is not lowered")
    return _Moment1(m, lw.val(args[1]), weight)


def _addcmul(lw: _Lowerer, args, kwargs, shapes, group):
    v = lw.env.get(args[0][1])
    value = kwargs.get("value", args[3] if len(args) > 3 else 1.0)
    if isinstance(v, _Scaled) and args[1] == args[2] and value == 1.0 - v.factor:
        return _Moment2(v.v, lw.val(args[1]), v.factor)
    raise LoweringError(f"{lw.name}: addcmul_ other than Adam's second moment is not lowered")


def _sqrt(lw: _Lowerer, args, kwargs, shapes, group):
    x = lw.env.get(args[0][1])
    if isinstance(x, _Moment2):
        return _Denom(x, root=True)
    return lw.emit("pow", [lw.val(args[0])], shapes, {"exponent": 0.5})[0]


def _add_pending(plain):
    """An addition, or a step of the optimizer (Adam's eps, SGD's alpha)."""
    def lower(lw: _Lowerer, args, kwargs, shapes, group):
        a = lw.env.get(args[0][1]) if isinstance(args[0], (list, tuple)) else None
        alpha = kwargs.get("alpha", 1)
        eps = lw.const(args[1])
        if isinstance(a, _Denom) and not a.root and a.eps == 0.0 and eps is not None \
                and alpha == 1:
            return _Denom(a.v2, a.scale, eps)
        if alpha != 1:
            return _sgd(lw, a, args, float(alpha), shapes)
        return plain(lw, args, kwargs, shapes, group)
    return lower


def _sgd(lw: _Lowerer, a: Any, args, alpha: float, shapes) -> Any:
    """``torch.add(g, p, alpha=wd)`` (weight decay), then ``p.add_(d, alpha=-lr)``."""
    b = lw.env.get(args[1][1])
    if b in lw.params and isinstance(a, int):
        return _SgdGrad(a, b, alpha)
    if a in lw.params:
        lw.name = f"{lw.params[a]}.optimizer"
        g, wd = (b.g, b.wd) if isinstance(b, _SgdGrad) and b.p == a else (lw.val(args[1]), 0.0)
        return lw.emit("sgd_step", [a, g], shapes, {"lr": -alpha, "weight_decay": wd},
                       direction="none")[0]
    raise LoweringError(f"{lw.name}: an addition with alpha other than SGD's step is not lowered")


def _adam_step_count(beta2: float, scale: float) -> int:
    """The step n whose bias correction sqrt(1 - beta2 ** n) is ``scale``."""
    for n in range(1, 100_000):
        if (1 - beta2 ** n) ** 0.5 == scale:
            return n
    raise LoweringError(f"no Adam step has the bias correction {scale}")


def _addcdiv(lw: _Lowerer, args, kwargs, shapes, group):
    """AdamW's update ``p.addcdiv_(m, denom, value=-step_size)`` after its
    moments: one ``adam_step`` of (p, g, m, v); its new moments become the
    values of the states."""
    target, m, denom = (lw.env.get(a[1]) for a in args[:3])
    value = kwargs.get("value", args[3] if len(args) > 3 else 1.0)
    p, keep = (target.p, target.keep) if isinstance(target, _Decayed) else (target, 1.0)
    if p not in lw.params or not isinstance(m, _Moment1) or not isinstance(denom, _Denom) \
            or denom.root or m.g != denom.v2.g:
        raise LoweringError(f"{lw.name}: addcdiv_ other than AdamW's update is not lowered")
    beta1, beta2 = 1.0 - m.weight, denom.v2.beta2
    step = _adam_step_count(beta2, denom.scale)
    lr = -value * (1 - beta1 ** step)
    kw = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": denom.eps,
          "weight_decay": (1.0 - keep) / lr, "decoupled": True, "step": step}
    shape = lw.shapes[p]
    lw.name = f"{lw.params[p]}.optimizer"
    new_p, new_m, new_v = lw.emit("adam_step", [p, m.g, m.m, denom.v2.v], [shape] * 3, kw,
                                  direction="none")
    lw.updated[m] = new_m
    lw.updated[denom.v2] = new_v
    return new_p


HANDLERS: dict[str, Any] = {
    "unknown": lambda lw, args, kwargs, shapes, group: None,
    "aten.empty.memory_format": lambda lw, args, kwargs, shapes, group: "empty",
    "aten.empty_like.default": lambda lw, args, kwargs, shapes, group: "empty",
    "aten.new_empty.default": lambda lw, args, kwargs, shapes, group: "empty",
    "fsdp.all_gather_copy_in.default": _copy_in,
    "c10d._allgather_base_.default": _allgather_base,
    "fsdp.split_with_sizes_copy.default": _split_copy,
    "fsdp.chunk_cat.default": _chunk_cat,
    "fsdp.padded_shard": lambda lw, args, kwargs, shapes, group: _Padding(args[0][1]),
    "c10d._reduce_scatter_base_.default": _reduce_scatter_base,
    "aten.as_strided.default": _as_strided,
    "aten.div_.Scalar": _scalar("div"),
    "aten.div_.Tensor": _scalar("div"),
    "aten.slice.Tensor": _slice,
    "aten.constant_pad_nd.default": _pad_ids,
    "aten.sub.Tensor": _sub,
    "aten.lt.Scalar": _ids_test("lt"),
    "aten.ge.Scalar": _ids_test("ge"),
    "aten.__or__.Tensor": _or,
    "aten.index_put_.default": _index_put,
    "c10d.send.default": _send,
    "c10d.recv_.default": _recv,
    "aten.mul.Tensor": _binary("mul", "mul_scalar"),
    "aten.mul.out": _binary("mul", "mul_scalar"),
    "aten.mul.Scalar": _scalar("mul_scalar"),
    "aten.div.Scalar": _scalar("div"),
    "aten.rsqrt.default": _unary("rsqrt"),
    "aten.silu.default": _unary("silu"),
    "aten.silu_backward.default": _silu_bw,
    "aten._softmax.default": _softmax,
    "aten._log_softmax.default": _log_softmax,
    "aten._log_softmax_backward_data.default": _log_softmax_bw,
    "aten.nll_loss_forward.default": _nll,
    "aten.nll_loss_backward.default": _nll_bw,
    "aten.eq.Scalar": _eq_scalar,
    "aten.gt.Scalar": _ids_test("gt"),
    "aten.le.Scalar": _ids_test("le"),
    "aten.clamp_min.default": _clamp_min,
    "aten.masked_fill_.Scalar": _masked_fill_pending,
    "aten.nll_loss2d_forward.default": _nll2d,
    "aten.nll_loss2d_backward.default": _nll2d_bw,
    "aten._softmax_backward_data.default": _softmax_bw,
    "aten.mean.dim": _reduce("mean"),
    "aten.mean.default": _reduce("mean"),
    "aten.sum.dim_IntList": _reduce("sum"),
    "aten.sum.default": _reduce("sum"),
    "aten.mm.default": _matmul,
    "aten.bmm.default": _matmul,
    "aten.t.default": _t,
    "aten.transpose.int": _transpose,
    "aten.view.default": _view,
    "aten._unsafe_view.default": _view,
    "aten.reshape.default": _view,
    "aten.expand.default": _expand,
    "aten.ones_like.default": _constant("ones"),
    "aten.embedding.default": _embedding,
    "aten.embedding_dense_backward.default": _embedding_bw,
    "aten.copy_.default": _copy,
    "_c10d_functional.all_gather_into_tensor.default": _all_gather,
    "_c10d_functional.reduce_scatter_tensor.default": _reduce_scatter,
    "_c10d_functional_autograd.all_gather_into_tensor.default": _all_gather,
    "_c10d_functional_autograd.reduce_scatter_tensor.default": _reduce_scatter,
    "aten.split.Tensor": _split,
    "aten.split_with_sizes.default": _split,
    "aten.unsqueeze.default": _view,
    "aten.squeeze.dim": _view,
    "aten.squeeze.dims": _view,
    "aten.squeeze.default": _view,
    "aten.permute.default": _permute,
    "aten._to_copy.default": _to_copy,
    "aten.add_.Scalar": _binary("add", "add_scalar"),
    "aten.sub_.Tensor": _sub,
    "aten.cat.default": _cat,
    "c10d.allreduce_.default": _allreduce_inplace,
    "aten._foreach_norm.Scalar": _foreach_norm,
    "aten.linalg_vector_norm.default": _vector_norm,
    "aten.stack.default": _stack,
    "aten.div.Tensor": _div_tensor,
    "aten.pow.Tensor_Scalar": _pow_pending,
    "_c10d_functional.all_reduce.default": _all_reduce_pending,
    "aten.reciprocal.default": _reciprocal,
    "aten.clamp.default": _clamp,
    "aten._foreach_mul_.Tensor": _foreach_mul_,
    "aten.zeros_like.default": _zeros_like,
    "aten.mul_.Tensor": _mul_inplace,
    "aten.lerp_.Scalar": _lerp,
    "aten.addcmul_.default": _addcmul,
    "aten.sqrt.default": _sqrt,
    "aten.add.Tensor": _add_pending(_add),
    "aten.add_.Tensor": _add_pending(_binary("add", "add_scalar")),
    "aten.addcdiv_.default": _addcdiv,
    **NN_HANDLERS,
    **MORE_HANDLERS,
    **BUCKET_HANDLERS,
    "aten.where.self": _where_pending,
}
# lower_vocab_parallel reads this module's id types, so it is imported once they exist
from backends.torch.lower_vocab_parallel import vocab_parallel_handlers  # noqa: E402

HANDLERS.update(vocab_parallel_handlers(HANDLERS))
# lower_masks reads the id types and wraps the entries above (lower_vocab_parallel's too)
from backends.torch.lower_masks import mask_handlers  # noqa: E402

HANDLERS.update(mask_handlers(HANDLERS))
# lower_ids and lower_compose take their own cases and hand the others to the entries above
from backends.torch.lower_ids import id_handlers  # noqa: E402

HANDLERS.update(id_handlers(HANDLERS))
from backends.torch.lower_compose import compose_handlers  # noqa: E402

HANDLERS.update(compose_handlers(HANDLERS))
from backends.torch.lower_std import std_handlers  # noqa: E402

HANDLERS.update(std_handlers(HANDLERS))
from backends.torch.lower_max import max_handlers  # noqa: E402

HANDLERS.update(max_handlers(HANDLERS))
from backends.torch.lower_argmax import argmax_handlers  # noqa: E402

HANDLERS.update(argmax_handlers(HANDLERS))
from backends.torch.lower_max_all import max_all_handlers  # noqa: E402
from backends.torch.lower_pool import POOL_HANDLERS  # noqa: E402

HANDLERS.update(POOL_HANDLERS)
from backends.torch.lower_copies import COPY_HANDLERS  # noqa: E402

HANDLERS.update(COPY_HANDLERS)
from backends.torch.lower_group_norm import GROUP_NORM_HANDLERS  # noqa: E402

HANDLERS.update(GROUP_NORM_HANDLERS)

HANDLERS.update(max_all_handlers(HANDLERS))
from backends.torch.lower_slices import slice_handlers  # noqa: E402

HANDLERS.update(slice_handlers(HANDLERS))
from backends.torch.lower_norm_sums import norm_sum_handlers  # noqa: E402

HANDLERS.update(norm_sum_handlers(HANDLERS))
from backends.torch.lower_const_lookup import const_lookup_handlers  # noqa: E402

HANDLERS.update(const_lookup_handlers(HANDLERS))
from backends.torch.lower_chunk import chunk_handlers  # noqa: E402

HANDLERS.update(chunk_handlers(HANDLERS))
from backends.torch.lower_label_masks import label_mask_handlers  # noqa: E402

HANDLERS.update(label_mask_handlers(HANDLERS))
from backends.torch.lower_logprob_views import logprob_view_handlers  # noqa: E402

HANDLERS.update(logprob_view_handlers(HANDLERS))
from backends.torch.lower_scan import scan_handlers  # noqa: E402

HANDLERS.update(scan_handlers(HANDLERS))

from backends.torch.lower_routing import routing_handlers  # noqa: E402  (top-k routing, issue 30)

HANDLERS.update(routing_handlers(HANDLERS))
from backends.torch.lower_safe_softmax import safe_softmax_handlers  # noqa: E402

HANDLERS.update(safe_softmax_handlers(HANDLERS))
from backends.torch.lower_grouped import grouped_handlers  # noqa: E402

HANDLERS.update(grouped_handlers(HANDLERS))
from backends.torch.lower_all_to_all import OPS as ALL_TO_ALL_OPS  # noqa: E402
from backends.torch.lower_all_to_all import NeedPeers, all_to_all_handlers  # noqa: E402

HANDLERS.update(all_to_all_handlers(HANDLERS))
from backends.torch.lower_permute import permute_handlers  # noqa: E402

HANDLERS.update(permute_handlers(HANDLERS))


def lower_ranks(traces: list[dict], vocab: int) -> list[Lowered]:
    """Lower every rank's trace (in rank order). A count of kept labels
    all-reduced by a rank has, as its value, the sum of the group members'
    recorded counts: each rank is lowered once to read its counts, and again
    with the step's values when any rank all-reduces one (docs/soundness.md,
    "Plans traced from PyTorch", 16)."""
    peers = _all_to_all_peers(traces, vocab)
    first = [lower_trace(t, vocab, "collect", peers) for t in traces]
    if not any(low.count_reduces for low in first):
        return first
    by_rank = {low.rank: low.count_reduces for low in first}
    counts = []
    for low in first:
        values = []
        for k, (group, _) in enumerate(low.count_reduces):
            members = [by_rank.get(m, []) for m in group]
            if any(len(c) <= k or c[k][0] != group for c in members):
                raise LoweringError(f"rank {low.rank}: its count all-reduce {k + 1} over ranks "
                                    f"{list(group)} is not every member's {k + 1}th")
            values.append(sum(c[k][1] for c in members))
        counts.append(values)
    return [lower_trace(t, vocab, c, peers) for t, c in zip(traces, counts)]


def _all_to_all_peers(traces: list[dict], vocab: int) -> dict | None:
    """What every rank sends at each of its all-to-alls of data (rank ->
    ``lower_all_to_all.Sent`` by (group, k)): the ranks are lowered in
    rounds, each publishing its sends, until none stops for want of a
    member's (None when no rank runs one)."""
    ops = set(ALL_TO_ALL_OPS)
    if not any(ev[0] in ops for t in traces for ev in t["events"]):
        return None
    peers: dict[int, dict] = {}
    rounds = 2 + max(sum(ev[0] in ops for ev in t["events"]) for t in traces)
    for _ in range(rounds):
        waiting = False
        for t in traces:
            lw = _Lowerer(t, vocab, counts="collect")
            lw.peers = peers
            try:
                _lower_into(lw, t)
            except NeedPeers:
                waiting = True
            peers[t["rank"]] = dict(getattr(lw, "published", {}))
        if not waiting:
            return peers
    raise LoweringError("the ranks' all-to-alls wait on each other's sends (a member that "
                        "never reaches an all-to-all another one runs)")


def lower_trace(trace: dict, vocab: int, counts: list[int] | str | None = None,
                peers: dict | None = None) -> Lowered:
    """Lower one rank's trace (``backends.torch.rank.run``'s result);
    ``counts`` as ``_Lowerer.counts`` (``lower_ranks`` gives them);
    ``peers``: the members' sends at its all-to-alls (``_all_to_all_peers``)."""
    check_no_value_reads(trace)
    lw = _Lowerer(trace, vocab, counts=counts)
    lw.peers = peers
    return _lower_into(lw, trace)


def _lower_into(lw: _Lowerer, trace: dict) -> Lowered:
    """The body of ``lower_trace`` on a lowerer made for ``trace``."""
    vocab = lw.vocab
    lw.next_id = len(trace["shapes"])
    inputs, axes = lw.inputs, lw.axes
    for name, (v, full, dims) in trace["params"].items():
        local = tuple(trace["shapes"][v])
        _check_shard(name, tuple(full), local, dims)
        lw.params[v] = name
        if any(axes and n == 0 for axes, n in zip(dims, local)):
            lw.env[v] = _NoShard()  # this rank holds no rows of it: not an input here
            continue
        lw.env[v] = v
        lw.shapes[v] = local
        inputs[v] = ("param", name)
        axes[v] = dims
    for name, (v, shape, what) in trace["buffers"].items():
        if what == "causal":
            lw.env[v] = Const(v, -1)
            continue
        lw.env[v] = v
        lw.shapes[v] = tuple(shape)
        inputs[v] = ("buffer", name)
        axes[v] = [[] for _ in shape]
    for source in ("data", "labels"):
        if source not in trace:
            continue
        v, ids_shape = trace[source]
        name = "tokens" if source == "data" else source
        lw.env[v] = _Ids(name)
        x = lw.one_hot[name] = lw.new((*ids_shape, vocab))
        inputs[x] = ("tokens", name)
        axes[x] = [["dp"]] + [[] for _ in ids_shape]
    lw.tokens = lw.one_hot["tokens"]
    lw.run(live_events(trace))
    losses = [lw.materialize(lw.env[v]) for v in trace["losses"]]
    held = {n for n, (v, _, _) in trace["params"].items() if not isinstance(lw.env[v], _NoShard)}
    grads = {n: (None if g is None else lw.materialize(lw.env[g])) for n, g in trace["grads"].items()
             if n in held}
    updates = {n: _updated(lw, n, v) for n, v in trace.get("updates", {}).items() if n in held}
    states = {n: {k: _updated(lw, n, v) for k, v in st.items()}
              for n, st in trace.get("states", {}).items() if n in held}
    finals = [*updates.values(), *(v for st in states.values() for v in st.values())]
    return Lowered(trace["rank"], trace["coords"], lw.shapes,
                   _used(lw.nodes, losses, grads, finals), inputs, axes, losses, grads,
                   lw.tokens, lw.const_values, updates, states, dict(trace.get("split", {})),
                   lw.count_reduces, lw.buckets, lw.empty_sums, lw.row_cuts,
                   dict(trace.get("ties", {})))


def check_shards(traces: list[dict]) -> None:
    """``_check_shard`` for every parameter of every rank, before any rank
    is lowered (the rank that shows an uneven cut may not be the first)."""
    for trace in traces:
        for name, (v, full, dims) in trace["params"].items():
            _check_shard(name, tuple(full), tuple(trace["shapes"][v]), dims)


def _check_shard(name: str, full: tuple[int, ...], local: tuple[int, ...],
                 dims: list[list[str]]) -> None:
    """Refuse a rank holding none of a dim other than 0 of a parameter.
    Uneven cuts are lowered along every dim: FSDP2's padded shards of dim 0
    (a rank without rows holds no input of it), DTensor's uneven
    ``Shard(d)`` (``torch.chunk``'s pieces: docs/soundness.md, "Plans traced
    from PyTorch", 15 and 27). That the rank's rows are its chunk is checked
    where the claims are made (``build``)."""
    for d, axes in enumerate(dims):
        if d and axes and local[d] == 0:
            raise LoweringError(
                f"parameter {name} of shape {list(full)} is sharded along dim {d} so that this "
                f"rank holds none of its {full[d]} (the mesh axes {axes}); a rank with an empty "
                f"shard is lowered along dim 0 only: choose sizes the mesh divides")


def _updated(lw: _Lowerer, name: str, v: int | None) -> int:
    """The lowered value a parameter or an optimizer state ends the step with."""
    x = lw.env.get(v) if v is not None else None
    x = lw.updated.get(x, x) if isinstance(x, (_Moment1, _Moment2)) else x
    if not isinstance(x, int) or x in lw.params:
        raise LoweringError(f"the optimizer step of {name} is not lowered (it is not "
                            f"torch.optim's AdamW or SGD, for-loop implementation)")
    return x


def _used(nodes: list[LNode], losses: list[int], grads: dict[str, int | None],
          finals: list[int] = ()) -> list[LNode]:
    """The nodes the losses, the gradients and the updated parameters and
    states depend on (collectives and sends always stay: their peers on
    other ranks are matched by order)."""
    need = set(losses) | {g for g in grads.values() if g is not None} | set(finals)
    keep = []
    for node in reversed(nodes):
        if node.group is not None or need.intersection(node.outs):
            keep.append(node)
            need.update(v for v in node.ins if v >= 0)
    return keep[::-1]
