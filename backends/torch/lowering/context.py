"""The lowering context every handler receives, and what lowering yields.

``Lowerer`` holds one rank's lowering: the recorded trace, the lowered
values' shapes, the nodes emitted so far (``LNode``), and what each recorded
value has become (``env``: a value id, or a pending value of ``ir``). Its
methods are the handlers' vocabulary: ``val`` (a recorded argument as a
lowered value), ``emit`` (append a node, checked against its op's rule),
``materialize``, ``reshape``, ``const``. ``run`` walks the trace and calls
each live event's handler (``registry.handlers()``). ``Lowered`` is a rank's
result, read by ``backends/torch/build.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backends.torch.errors import LoweringError
from backends.torch.lowering import range_steps
from backends.torch.lowering.bucket_pieces import PER_PIECE_OPS, per_piece
from backends.torch.lowering.flat_ranges import FlatRange, per_block
from backends.torch.lowering.ir import (
    Bucket,
    Const,
    Empty,
    Gathered,
    Ids,
    NoShard,
    Pending,
    SdpaSaved,
)
from backends.torch.lowering.no_entries import makes_nothing
from backends.torch.lowering.refusals import refusal
from backends.torch.lowering.registry import handlers
from backends.torch.lowering.shapes import view_to
from backends.torch.lowering.zero_flow import zero_values, zeros_of
from verdict.ops import OPS, ShapeError

#: the op of a placeholder node: the place of a collective not emitted yet
#: (``Lowerer.reserve``)
RESERVED = "reserved"


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
    #: a ring attention's merged out or lse -> ("out" or "lse", q, k, v): the
    #: attention of the rank's query over the keys and values k and v are
    #: pieces of (the shim's ``ring_result``; docs/soundness.md, "Plans
    #: traced from PyTorch", 53 (d))
    anchors: dict[int, tuple[str, int, int, int]] = field(default_factory=dict)
    #: a parameter whose final gradient is blocks of it (the flat range of it
    #: the rank's optimizer reads: Megatron's distributed optimizer) -> each
    #: block as (the value it is a block of, its starts, its shape, whether
    #: the value is the block itself, elements found elsewhere: 91 (b))
    grad_blocks: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...], bool]]] = \
        field(default_factory=dict)
    #: the rank's sequence is laid out in a load balancer's order, and the
    #: single-device step is written in it (``tracer.seq_order``): a ring's
    #: blocks are loose, its results named by the shim (docs/soundness.md,
    #: "Plans traced from PyTorch", 66)
    reordered: bool = False
    #: each branch on a number read with ``.item()``, in program order: (the
    #: number's value, the comparison, its constant, the branch taken, the
    #: scope) (``constants.check_no_value_reads``; matched by ``tracer.build``)
    guards: list[tuple[int, str, float, bool, str]] = field(default_factory=list)
    #: the square sum of a run of a reduce-scattered range that is part of a
    #: value -> (the value, the group the ranges were cut for): a part, over
    #: that group, of the value's square sum (docs/soundness.md, 80)
    range_sums: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    #: Megatron's distributed optimizer: a parameter (or a state: "name.state")
    #: whose final value is elements of values side by side -> its runs
    #: (``param_buffers.Run``; after ``walk.resolve_gathers``, each
    #: (rank, value, lo, hi): elements [lo, hi) of that rank's value)
    final_runs: dict[str, tuple] = field(default_factory=dict)
    #: each all-gather of flat ranges over a group, in order: this rank's input's parts
    gathers: dict[tuple[int, ...], list] = field(default_factory=dict)
    #: values the lowering built from elements of several values, or of one
    #: value elsewhere than the step reads them (``flat_ranges.mixed``): no
    #: single-device piece, loose (docs/soundness.md, 91 (b)) -> the
    #: parameter whose final gradient block reads it, if any
    mixed: dict[int, str | None] = field(default_factory=dict)
    #: the window of a dispatcher's moved rows this rank's copies are read in
    #: (``moved_rows.reread``'s ``narrow``; docs/soundness.md, 103 and 113 (e))
    moved_windows: set[int] = field(default_factory=set)


@dataclass
class Lowerer:
    trace: dict
    vocab: int
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    nodes: list[LNode] = field(default_factory=list)
    env: dict[int, Any] = field(default_factory=dict)
    fw_in: dict[int, tuple[str, int]] = field(default_factory=dict)  # output -> (op, input)
    ln_y: dict[tuple[int, int, int], int] = field(default_factory=dict)  # a layer norm's (x-mean)*rstd
    sdpa: dict[int, SdpaSaved] = field(default_factory=dict)  # attention output -> its saved values
    #: a kernel's log-sum-exp (ir.KernelLse) -> its lowered value, emitted once however often read
    kernel_lse: dict[Any, int] = field(default_factory=dict)
    #: constants of a buffer read by value once (``ir.Const``): read so by every reader
    by_value: set[int] = field(default_factory=set)
    inputs: dict[int, tuple[str, str]] = field(default_factory=dict)  # value -> (kind, name)
    axes: dict[int, list[list[str]]] = field(default_factory=dict)  # input value -> mesh axes
    const_inputs: dict[str, int] = field(default_factory=dict)  # constant's name -> input
    const_values: dict[int, Any] = field(default_factory=dict)  # constant input -> its value
    next_id: int = 0
    name: str = ""
    tokens: int = -1
    flat_of: dict[int, int] = field(default_factory=dict)
    mb: int = -1
    id_pieces: dict[Ids, int] = field(default_factory=dict)
    #: (value, dim, index, parts) -> the split of that equal piece, emitted once
    splits: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    #: layout: an unequal split's piece (source, dim, start, length) -> its narrow, emitted once
    #: layout: a cat's value -> (its dim, its parts), for slices at the parts' bounds
    #: counts: an integer value computed from the ids -> its bounds for every batch;
    #: (value, rows) -> its one-hot rows
    integral: dict[int, tuple[int, int]] = field(default_factory=dict)
    integral_rows: dict[tuple[int, int], int] = field(default_factory=dict)
    #: the integers a bounded value may take, when fewer than its bounds hold
    #: (``where(ids != 0, 2, 0)`` is 0 or 2)
    integral_sets: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: a bounded value selected between two (``where(flag, a, b)``): the flag's
    #: 0/1 value and the two arguments, whose one-hot rows it selects between
    integral_where: dict[int, tuple[int, Any, Any]] = field(default_factory=dict)
    cats: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    narrows: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    one_hot: dict[str, int] = field(default_factory=dict)  # ids source -> one-hot input
    params: dict[int, str] = field(default_factory=dict)  # the parameters' values -> names
    fresh_state: set[int] = field(default_factory=set)  # zeros_like of a parameter
    #: a value written in place into a parameter (its ``.data`` clamped in the
    #: forward) -> the parameter's name: what the optimizer steps from
    written_params: dict[int, str] = field(default_factory=dict)
    updated: dict[Any, int] = field(default_factory=dict)  # optimizer state -> its new value
    quotients: dict[int, tuple[int, int]] = field(default_factory=dict)  # a / b -> (a, b)
    norms: dict[int, int] = field(default_factory=dict)  # a 2-norm along dims -> its input
    stds: set[int] = field(default_factory=set)  # standard deviations (std)
    empty_sums: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    row_cuts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    range_sums: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    #: each all-gather of flat ranges over a group, in order: this rank's
    #: input's parts (``param_buffers``)
    range_gathers: dict[tuple[int, ...], list] = field(default_factory=dict)
    mixed: dict[int, str | None] = field(default_factory=dict)  # flat_ranges.mixed
    moved_windows: set[int] = field(default_factory=set)  # moved_rows.reread's windows
    event: int = -1  # the event being lowered
    buckets: list = field(default_factory=list)  # gradient buckets all-reduced (buckets)
    #: the step's value of each count all-reduce, in order (lower_ranks); None:
    #: an all-reduced count is refused, "collect": this rank's counts are kept
    counts: list[int] | str | None = None
    count_reduces: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    #: pow(x, 2) -> x, and the exact zeros of accumulators (norm_sums)
    squares: dict[int, int] = field(default_factory=dict)
    zero_values: set[int] = field(default_factory=set)
    #: the values made by a ``zeros`` node (emit.put_region cuts no part of them)
    zeros_made: set[int] = field(default_factory=set)
    #: a pending value emitted once for all its readers -> its lowered value
    emitted_once: dict[Any, int] = field(default_factory=dict)
    #: routing: recorded value -> the event that made it; a value reshaped once per shape
    routing_producers: dict[int, int] | None = None
    routing_views: dict[tuple[int, tuple[int, ...]], int] = field(default_factory=dict)
    #: grouped: recorded value -> the event that made it; (value, C) -> its C-fold copy
    grouped_producers: dict[int, int] | None = None
    grouped_copies: dict[tuple[int, int], int] = field(default_factory=dict)
    #: the groups of this rank's grouped GEMMs: (each row's group, the GEMM's
    #: number of groups), read by ``per_group.index_add`` for the rows of its sums
    grouped_groups: list[tuple[Any, int]] = field(default_factory=list)
    #: this rank added routed rows back at other copies than they were
    #: gathered at (``grouped_rows._summed_elsewhere``): rows of one base read
    #: at two indices are then re-read at one (``moved_rows.reread``)
    rows_moved: bool = False
    #: a constant recorded value -> the event that made it (``ir.broadcast_layout``)
    const_events: dict[int, int] = field(default_factory=dict)
    #: the weights a combine of pair rows read (``pair_combine``)
    pair_weights: set[int] = field(default_factory=set)
    #: all_to_all: the members' sends (rank -> (group, k) -> Sent; walk.lower_ranks),
    #: this rank's, and its all-to-alls per group so far
    peers: dict | None = None
    published: dict = field(default_factory=dict)
    all_to_alls: dict[tuple[int, ...], int] = field(default_factory=dict)
    #: an all-to-all's input that is a view: its bases, nearest first (arranged.blocks_of)
    bases_sent: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: nn: a ring attention's merged out and lse -> what they are (``Lowered.anchors``)
    anchors: dict[int, tuple[str, int, int, int]] = field(default_factory=dict)
    #: collectives: all-gathers not emitted yet, each holding its reserved slot in ``nodes``
    gathers: list[Gathered] = field(default_factory=list)

    # -- values -------------------------------------------------------------
    def new(self, shape) -> int:
        v = self.next_id
        self.next_id += 1
        self.shapes[v] = tuple(shape)
        return v

    def emit(self, op: str, ins: list[int], out_shapes: list, kwargs: dict | None = None,
             direction: str = "fw", group=None) -> list[int]:
        """Append an ``op`` node reading ``ins``; its new outputs, of
        ``out_shapes``. The node is checked against ``op``'s rule first
        (``check_emitted``): a handler that names an op the table lacks, or
        computes other output shapes than the rule, fails here."""
        check_emitted(self.name, op, direction, [self.shapes.get(v) for v in ins], out_shapes,
                      kwargs or {})
        outs = [self.new(s) for s in out_shapes]
        self.nodes.append(LNode(op, direction, ins, outs, kwargs or {}, self.name, group, self.mb))
        if op == "zeros" and not ins:
            self.zeros_made.update(outs)
        return outs

    def reserve(self, gathered: Gathered) -> Gathered:
        """Reserve the place of a collective whose form its readers decide
        (``ir.Gathered``): a placeholder node, filled by ``fill`` when it is
        first read, or by ``settle`` at the end of the trace, so that it runs
        once, where it was recorded, whether this rank reads it or not."""
        gathered.slot = len(self.nodes)
        self.nodes.append(LNode(RESERVED, "fw", [], [], {}, self.name, gathered.group, self.mb))
        self.gathers.append(gathered)
        return gathered

    def fill(self, slot: int | None, node: LNode) -> None:
        """Put ``node`` in the reserved ``slot`` (with the recorded op's
        module and microbatch), or append it when no slot is left."""
        if slot is None or self.nodes[slot].op != RESERVED:
            self.nodes.append(node)
            return
        held = self.nodes[slot]
        node.name, node.mb = held.name, held.mb
        self.nodes[slot] = node

    def settle(self) -> None:
        """The all-gathers no op of this rank read, emitted along dim 0 in
        their slots (their members read them: a ring's ranks that skip a
        block still take part), and the slots left empty dropped (a gather
        of padded pieces unread, or written out as its pieces' messages)."""
        for g in self.gathers:
            if g.slot is not None and not g.padded and not g.written:
                g.gather(self, 0)
        self.gathers = []
        self.nodes = [n for n in self.nodes if n.op != RESERVED]

    def val(self, a: Any) -> int:
        """The lowered value of a recorded argument, materializing pending layouts."""
        if not (isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v"):
            raise LoweringError(f"{self.name}: expected a tensor, got {a!r}")
        x = self.env.get(a[1])
        if x is None:
            raise LoweringError(f"{self.name}: reads a tensor that no recorded op produced")
        return self.materialize(x)

    def materialize(self, x: Any) -> int:
        """The lowered value of ``x``: a value id as it is, a pending value
        (``ir.Pending``) emitted; any other record is read only by the
        handlers that know it, so reading it here is refused in one line
        naming the op and the value (``refusals.refusal``)."""
        while not isinstance(x, int):
            if not isinstance(x, Pending):
                raise LoweringError(refusal(self, x))
            x = x.materialize(self)
        return x

    def reshape(self, x: int, shape: tuple[int, ...]) -> int:
        """Value x seen with ``shape`` (flatten/unflatten nodes)."""
        return self.materialize(view_to(self, x, tuple(shape)))

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
        zeros = zero_values(self.trace)
        for i, (op, _, outs, *_) in enumerate(self.trace["events"]):
            if i not in live:
                continue
            if outs and all(v in constants for v in outs):
                for v in outs:  # a constant of unknown origin (written in place) is read by value
                    self.env[v] = Const(v, i if op != "unknown" else -1)
                    self.const_events[v] = i if op != "unknown" else -1
                continue
            if outs and all(v in zeros for v in outs):
                for v, shape in zip(outs, self.trace["events"][i][3]):
                    self.env[v] = zeros_of(tuple(shape))  # zeros by the ops' algebra (item 125 b)
                continue
            if self.on_empty(i):
                for v in outs:
                    self.env[v] = NoShard()
                continue
            op, (args, kwargs), _, out_shapes, *_ = self.trace["events"][i]
            if makes_nothing(self, op, tensor_args([args, kwargs]), out_shapes):
                for v, shape in zip(outs, out_shapes):  # no entries: no value (item 110 (a))
                    self.env[v] = Empty(tuple(shape))
                continue
            self.lower_event(i)

    def on_empty(self, i: int) -> bool:
        """Event i reads only the empty shards of parameters this rank holds
        no rows of, or what such events made (their optimizer step), writes
        only empty tensors and communicates nothing: it computes no value,
        and its outputs may be read by no other op."""
        op, (args, kwargs), outs, out_shapes, *_ = self.trace["events"][i]
        ins = tensor_args([args, kwargs])
        return (bool(ins) and bool(outs) and not op.startswith(("c10d", "_c10d_functional", "fsdp"))
                and all(isinstance(self.env.get(v), NoShard) for v in ins)
                and all(0 in tuple(s) for s in out_shapes))

    def lower_event(self, i: int, want: int = -1) -> Any:
        """Lower event ``i`` through its handler; the lowered value of its
        output ``want``."""
        op, (args, kwargs), outs, out_shapes, scope, group, mb = self.trace["events"][i]
        saved = self.name, self.mb, self.event
        self.name, self.mb = scope, mb
        self.event = i
        handler = handlers().get(op)
        if handler is None:
            raise LoweringError(f"aten op {op} (at {scope or 'top level'}) is not lowered "
                                f"onto the rule table")
        if range_steps.applies(self, op, args):
            handler = range_steps.range_step(handler)  # an optimizer op on flat ranges (item 90)
        elif op in PER_PIECE_OPS and args and isinstance(self.env.get(_first_value(args[0])), Bucket):
            handler = _per_piece(handler)
        elif op in PER_PIECE_OPS and args and isinstance(self.env.get(_first_value(args[0])),
                                                         FlatRange):
            handler = _per_block(handler)
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


def check_emitted(name: str, op: str, direction: str, in_shapes: list, out_shapes: list,
                  kwargs: dict) -> None:
    """Refuse a node that does not obey ``op``'s rule: an op the rule table
    lacks, another number of outputs, or other output shapes than the rule
    computes from the inputs'. A backward node (``direction`` "bw") reads
    the forward inputs, then the output gradients, and makes the input
    gradients, as plans hold it (``verdict.structure.fw_shapes``). A
    collective's node is checked in the plan, where it reads every
    member's input."""
    rule = OPS.get(op)
    if rule is None:
        raise LoweringError(f"{name}: emits {op}, which the rule table does not have")
    if rule.group:
        return
    want: list = [tuple(s) for s in out_shapes]
    ins = in_shapes
    if direction == "bw" and rule.backward is not None:
        n = len(want)
        ins = [s if s is not None else g for s, g in zip(in_shapes[:n], want)]
        want = list(in_shapes[n:])
    if any(s is None for s in ins):
        return
    shown = f"{op} of shapes {[list(s) for s in ins]} with {kwargs}"
    try:
        got = rule.shape([tuple(s) for s in ins], **kwargs)
    except (ShapeError, TypeError, ValueError, IndexError, KeyError) as e:
        raise LoweringError(f"{name}: {shown} breaks its rule: {e}") from None
    if len(got) != len(want) or any(w is not None and tuple(w) != tuple(g)
                                    for w, g in zip(want, got)):
        made = [None if w is None else list(w) for w in want]
        raise LoweringError(f"{name}: {shown} makes {[list(g) for g in got]} by its rule, "
                            f"not {made}")


def _first_value(a: Any) -> int | None:
    return a[1] if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v" else None


def _per_block(handler):
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        return per_block(lw, handler, args, kwargs, shapes, group)
    return lower


def _per_piece(handler):
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        return per_piece(lw, handler, args, kwargs, group)
    return lower


def tensor_args(args: Any) -> list[int]:
    out = []
    if isinstance(args, (list, tuple)):
        if len(args) == 2 and args[0] == "v" and isinstance(args[1], int):
            return [args[1]]
        for a in args:
            out.extend(tensor_args(a))
    elif isinstance(args, dict):
        for a in args.values():
            out.extend(tensor_args(a))
    return out


#: ops that read only their tensor argument's shape and dtype, never its values
SHAPE_ONLY = frozenset({"aten.ones_like.default", "aten.zeros_like.default",
                        "aten.empty_like.default"})

#: collectives that run whether or not this rank reads their result: a
#: member that never reads it (a ring's rank that skips a block) still
#: takes part, and the members' collectives are matched by order
ALWAYS_LIVE = ("c10d.send.default", "_c10d_functional.all_gather_into_tensor.default",
               "_c10d_functional_autograd.all_gather_into_tensor.default",
               "_c10d_functional.all_to_all_single.default",
               "_c10d_functional_autograd.all_to_all_single.default")


def live_events(trace: dict) -> set[int]:
    """Events the loss and the final gradients depend on, and the
    collectives of ``ALWAYS_LIVE``."""
    need = set(trace["losses"]) | {g for g in trace["grads"].values() if g is not None}
    need |= {v for v in trace.get("updates", {}).values() if v is not None}
    need |= {v for blocks in trace.get("grad_blocks", {}).values() for v, _ in blocks}
    need |= {v for st in trace.get("states", {}).values() for v in st.values() if v is not None}
    need |= {g[0] for g in trace.get("guards", ())}  # the numbers branched on: compared
    need |= {v for v, _ in trace.get("count_reads", ())}  # counts branched on: decided
    live = set()
    zeros = zero_values(trace)  # made by the ops' algebra, reading nothing (item 125 b)
    # a memory read's value (``mem.slice``): a fresh optimizer state made like
    # a flat range of a parameter is shaped after that parameter (item 90)
    read_from_memory = {o for ev in trace["events"] if ev[0] == "mem.slice" for o in ev[2]}
    for i in range(len(trace["events"]) - 1, -1, -1):
        op, (args, kwargs), outs = trace["events"][i][:3]
        if not need.intersection(outs) and op not in ALWAYS_LIVE:
            continue
        live.add(i)
        if outs and all(v in zeros for v in outs):
            continue
        if op == "aten.zeros_like.default":
            need.update(v for v in tensor_args(args[:1]) if v in read_from_memory)
            continue
        if op == "c10d.recv_.default" or op in SHAPE_ONLY:
            continue  # overwrites its buffers; reads only its argument's shape
        if op in ("aten.copy_.default", "aten._foreach_copy_.default"):
            need.update(tensor_args(args[1]))  # the destinations are written, not read
        elif op == "c10d._allgather_base_.default":
            need.update(tensor_args(args[1:]))  # its output buffer is written, not read
        elif op == "aten.baddbmm.default" and _beta_zero(args, kwargs):
            need.update(tensor_args([args[1:], kwargs]))  # the input is not read
        else:
            need.update(tensor_args([args, kwargs]))
    return live


def _beta_zero(args: list, kwargs: dict) -> bool:
    """``baddbmm(input, b1, b2, beta=0)``: torch does not read ``input``
    (Megatron's attention passes an uninitialized buffer)."""
    beta = args[3] if len(args) > 3 else kwargs.get("beta", 1)
    return isinstance(beta, (int, float)) and beta == 0


def pg(lw: Lowerer, a: Any) -> tuple[int, ...]:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "pg":
        return tuple(a[1])
    raise LoweringError(f"{lw.name}: a c10d collective without a process group")
