"""Logical graph + parallelism -> per-rank parallel plan with lineage views.

Two passes:

1. :func:`shard` walks the logical graph once and decides, per mesh axis
   (microbatch, expert-data-parallel, expert-parallel, tensor-parallel), the
   layout of every value (see gen_model.sharding), inserting collectives
   where a consumer needs another layout and send/recv where it runs on
   another pipeline stage. The result is a program of sharded ops.
2. :func:`emit` instantiates that program on every rank for every
   microbatch, in the order of the pipeline schedule (GPipe or 1F1B), adds
   gradient accumulation and the cross-replica reducer, and merges the
   per-rank sequences into one execution order.

docs/parallelism.md explains the rank layout and each strategy.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any

from tqdm import tqdm

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.graph import ABSENT, LogicalGraph, LOp, Value
from gen_model.sharding import Layout, grad_layout, is_split, natural_grad, propagate
from verdict.ops import get_op
from verdict.ops.step import OPTIMIZERS
from verdict.plan import INPUT_KINDS, Node, Plan, Tensor
from verdict.structure import fw_shapes

AXES = ("mb", "edp", "ep", "cp", "tp")
#: Order in which the axes number the pieces of a split dim (last fastest):
#: the batch is microbatch-major; an expert dim split on tp and ep is tp-major,
#: so an all-to-all over ep gathers contiguous experts.
SLICE_ORDER = ("mb", "edp", "cp", "tp", "ep")
#: Order in which the axes number the parts of a partial sum (last fastest).
PART_ORDER = ("edp", "ep", "cp", "tp", "mb")
#: Axes that split the tokens of a step (the batch, and the sequence on cp):
#: gradients are partial sums over them, reduced by the reducer.
BATCH_AXES = ("mb", "edp", "ep", "cp")

COLUMN = re.compile(r"\.(wq|wk|wv|w1|w3)\.weight$|^output\.weight$")
ROW = re.compile(r"\.(wo|w2)\.weight$")
EXPERT = re.compile(r"\.feed_forward\.(w1|w2|w3)$")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: Ops whose tensor-parallel partial sums are all-reduced right away, as in
#: Megatron's row-parallel linear and vocab-parallel embedding.
REDUCE_AT_ONCE = ("linear", "embedding")
#: The sequence dim of a [batch, sequence, hidden] activation.
SEQ_DIM = 1
#: The heads dim of attention's [batch, heads, sequence, head_dim] operands.
HEAD_DIM = 1


@dataclass(frozen=True)
class Policy:
    """Choices a parallelizer makes beyond the degrees of parallelism."""

    vocab_parallel: bool = False
    schedule: str = "1f1b"  # or "gpipe"
    #: Megatron sequence parallelism: outside tensor-parallel regions the
    #: activations are split along the sequence (dim 1) across TP ranks.
    sequence_parallel: bool = False
    #: Ulysses (DeepSpeed) on the cp axis: attention runs on head shards of
    #: whole sequences, reached by all-to-alls, instead of gathering keys.
    ulysses: bool = False
    #: Interleaved (virtual) pipeline: each rank holds this many model chunks,
    #: chunk k of the pp * virtual_stages chunks on stage k % pp.
    virtual_stages: int = 1
    #: ZeRO stage: 0 none; 1 optimizer state sharded (gradients all-reduced,
    #: each rank keeps its owned shard); 2 gradients reduce-scattered to owners;
    #: 3 parameters sharded too and all-gathered before every use (FSDP).
    zero: int = 0
    #: Causal load balancing on the cp axis: the sequence is cut into 2 cp
    #: chunks and cp rank i holds chunks i and 2 cp - 1 - i (Megatron's
    #: layout), so every rank gets the same share of unmasked scores.
    cp_balance: bool = False


@dataclass(frozen=True)
class SVal:
    """A logical value in one layout per axis (AXES order)."""

    tid: int
    lver: int
    layout: tuple[Layout, ...]
    #: 1 for the copy of a ZeRO-3 parameter gathered again in the backward,
    #: a second tensor of the same value
    copy: int = 0

    def on(self, axis: str) -> Layout:
        return self.layout[AXES.index(axis)]

    def relaid(self, axis: str, layout: Layout) -> SVal:
        lay = list(self.layout)
        lay[AXES.index(axis)] = layout
        return SVal(self.tid, self.lver, tuple(lay))


@dataclass
class SOp:
    """One op of the sharded program; ``kind`` is op, conv or move."""

    kind: str
    op: str
    dir: str
    name: str
    stage: int
    inputs: list[SVal | None]
    outputs: list[SVal | None]
    kwargs: dict[str, Any] = field(default_factory=dict)
    axis: str = ""
    src_stage: int = -1


@dataclass
class Program:
    ops: list[SOp]
    params: dict[int, tuple[int, SVal | None]]  # param tid -> (stage, final grad value)
    inputs: dict[int, SVal]  # input tid -> its layout as read from memory
    loss: SVal
    #: param tid -> the data-parallel axes its owned shard is cut on (ZeRO)
    zero_axes: dict[int, tuple[str, ...]] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# pass 1: layouts


class _Sharder:
    def __init__(self, g: LogicalGraph, cfg: ModelConfig, par: Parallelism, policy: Policy):
        self.g, self.cfg, self.par, self.policy = g, cfg, par, policy
        self.size = axis_sizes(par, policy)
        self.ops: list[SOp] = []
        self.current: dict[Value, SVal] = {}
        self.where: dict[SVal, int] = {}
        self.cache: dict[tuple, SVal] = {}
        self.used: dict[int, tuple[list[SVal | None], list[Layout], list[bool]]] = {}
        self.stages = self.assign_stages()
        self.accumulated = {lop.outputs[0][0]: lop.inputs[1] for lop in g.ops
                            if lop.op == "local_grad_accumulation"}
        self.gather_first = self.fanouts_to_columns() if (
            policy.sequence_parallel and self.size["tp"] > 1) else set()

    # -- placement ----------------------------------------------------------
    def assign_stages(self) -> list[int]:
        g, pp = self.g, self.par.pp * self.policy.virtual_stages  # virtual stages
        last = pp - 1
        stages, seen_layer = [], False
        for lop in g.ops:
            m = LAYER.search(lop.name + ".")
            if lop.dir == "bw" and lop.fw >= 0:
                stages.append(stages[lop.fw])
            elif m:
                seen_layer = True
                stages.append(int(m.group(1)) * pp // self.cfg.layers)
            elif lop.dir == "bw" or lop.dir == "none":
                stages.append(-1)  # placed by its consumer or parameter
            else:
                stages.append(last if seen_layer else 0)
        # a fan-out lives with its readers, so a pipeline boundary sends one tensor
        readers: dict[Value, list[int]] = {}
        for i, lop in enumerate(g.ops):
            for v in lop.inputs:
                readers.setdefault(v, []).append(i)
        for i, lop in enumerate(g.ops):
            if lop.op == "multiref" and lop.dir == "fw":
                stages[i] = min(stages[j] for v in lop.outputs for j in readers.get(v, [i]))
            elif lop.dir == "bw" and lop.fw >= 0:
                stages[i] = stages[lop.fw]
        return stages

    def fanouts_to_columns(self) -> set[int]:
        """Forward multirefs whose copies all feed column-parallel linears. With
        sequence parallelism their input is all-gathered once, before the
        fan-out (as Megatron gathers once for q, k and v), not once per copy."""
        readers: dict[Value, list[LOp]] = {}
        for lop in self.g.ops:
            for v in lop.inputs if lop.dir == "fw" else ():
                readers.setdefault(v, []).append(lop)

        def column(lop: LOp) -> bool:
            return (lop.op == "linear"
                    and COLUMN.search(self.g.tensors[lop.inputs[1][0]].name) is not None)

        return {i for i, lop in enumerate(self.g.ops)
                if lop.op == "multiref" and lop.dir == "fw"
                and all(column(r) for v in lop.outputs for r in readers.get(v, []))}

    def input_layout(self, tid: int) -> tuple[Layout, ...]:
        """How an input is laid out; everything is replicated on an axis of size 1.
        With ZeRO a parameter is loaded as the shard its rank owns."""
        lay = list(self.axis_layouts(tid))
        lay = ["R" if self.size[a] == 1 else x for a, x in zip(AXES, lay)]
        axes = self.zero_axes(tid)
        if axes:
            dim = self.zero_dim(tid, lay, axes)
            for a in axes:
                lay[AXES.index(a)] = dim
        return tuple(lay)

    def zero_axes(self, tid: int) -> tuple[str, ...]:
        """The data-parallel axes a parameter's gradient is reduced over, on
        which ZeRO cuts its owned shards (experts: the expert-data-parallel
        axis only)."""
        t = self.g.tensors[tid]
        if self.policy.zero < 1 or t.kind != "param":
            return ()
        expert = EXPERT.search(t.name) is not None
        return tuple(a for a in (("edp",) if expert else ("edp", "ep")) if self.size[a] > 1)

    def zero_dim(self, tid: int, lay: list[Layout], axes: tuple[str, ...]) -> int:
        """The first dim of a parameter that no other axis splits and that the
        owners divide evenly."""
        shape = self.g.shape(tid)
        owners = 1
        for a in axes:
            owners *= self.size[a]
        for d, n in enumerate(shape):
            pieces = 1
            for a, x in zip(AXES, lay):
                if x == d:
                    pieces *= self.size[a]
            if pieces == 1 and n % owners == 0:
                return d
        raise ConfigError(f"{self.g.tensors[tid].name} {shape}: no dim splits into {owners} "
                          f"ZeRO shards")

    def gathered(self, sv: SVal, stage: int) -> SVal:
        """A ZeRO-sharded parameter all-gathered for use: once per step before
        the first microbatch (ZeRO-1/2, direction 'none'), or before every
        use in each microbatch's forward (ZeRO-3)."""
        axes = self.zero_axes(sv.tid)
        if not axes:
            return sv
        want = list(sv.layout)
        for a in axes:
            want[AXES.index(a)] = "R"
        dir = "fw" if self.policy.zero >= 3 else "none"
        return self.convert(sv, tuple(want), stage, dir, data_parallel=True)

    def regathered(self, v: Value, used: SVal, stage: int) -> SVal:
        """ZeRO-3 (FSDP) frees a parameter gathered for the forward and gathers
        it again for the backward: the same all-gathers from the owned shard,
        in each microbatch's backward, writing a second copy (``copy`` 1).
        ``used`` is the layout the forward read; anything but a ZeRO-3
        parameter is returned as it is."""
        if self.policy.zero < 3 or not self.zero_axes(v[0]):
            return used
        key = ("regather", used, stage % self.par.pp)
        if key in self.cache:
            return self.cache[key]
        sv = self.value(v)
        name = self.g.tensors[sv.tid].name
        while sv.layout != used.layout:
            axis = next(a for a in SLICE_ORDER if sv.on(a) != used.on(a)
                        and contiguous(sv, sv.relaid(a, used.on(a)), a))
            if used.on(axis) != "R" or not is_split(sv.on(axis)):
                raise AssertionError(f"{name}: the forward read it in {used.layout}, not "
                                     f"gathered from {sv.layout}")
            out = replace(sv.relaid(axis, "R"), copy=1)
            self.ops.append(SOp("conv", "all_gather", "bw", name, stage, [sv], [out],
                                {"dim": sv.on(axis)}, axis=axis))
            self.where[out] = stage
            sv = out
        self.cache[key] = sv
        return sv

    def axis_layouts(self, tid: int) -> tuple[Layout, ...]:
        t = self.g.tensors[tid]
        if t.kind in ("data", "tokens"):
            tp = len(t.shape) - 1 if t.kind == "tokens" and self.policy.vocab_parallel else "R"
            return (0, 0, 0, SEQ_DIM if t.kind == "tokens" else "R", tp)
        expert = t.kind == "param" and EXPERT.search(t.name) is not None
        tp: Layout = "R"
        if t.kind == "param":
            if expert:
                ffn_dim = 2 if t.name.endswith(".w2") else 1
                tp = 0 if self.par.experts_over_tp else ffn_dim
            elif COLUMN.search(t.name):
                tp = 0
            elif ROW.search(t.name):
                tp = 1
            elif t.name.endswith("tok_embeddings.weight") and self.policy.vocab_parallel:
                tp = 0
            elif self.cfg.model == "mlp" and len(t.shape) == 2:
                layer = int(LAYER.search(t.name + ".").group(1)) if LAYER.search(t.name + ".") else 0
                tp = 0 if layer % 2 == 0 else 1
        return ("R", "R", 0 if expert else "R", "R", tp)

    def value(self, v: Value) -> SVal:
        if v not in self.current:
            kind = self.g.tensors[v[0]].kind
            if kind not in INPUT_KINDS:
                raise AssertionError(f"value {v} read before it is written")
            self.current[v] = SVal(v[0], v[1], self.input_layout(v[0]))
        return self.current[v]

    # -- conversions ----------------------------------------------------------
    def convert(self, sv: SVal, want: tuple[Layout, ...], stage: int, dir: str,
                data_parallel: bool = False) -> SVal:
        """Collectives that take ``sv`` to layout ``want``, one axis at a time, in
        an order where each acts on contiguous pieces (see :func:`contiguous`).
        ``data_parallel`` allows collectives on the edp axis (ZeRO's parameter
        all-gather and gradient reduce-scatter); activations never take one."""
        while sv.layout != want:
            step = next((a for a in SLICE_ORDER if sv.on(a) != want[AXES.index(a)]
                         and contiguous(sv, sv.relaid(a, want[AXES.index(a)]), a)), None)
            if step is None:
                raise ConfigError(f"{self.g.tensors[sv.tid].name}: no order of collectives "
                                  f"takes {sv.layout} to {want}")
            sv = self.convert_axis(sv, step, want[AXES.index(step)], stage, dir, data_parallel)
        return self.move(sv, stage, dir)

    def convert_axis(self, sv: SVal, axis: str, need: Layout, stage: int, dir: str,
                     data_parallel: bool = False) -> SVal:
        key = (sv, axis, need, stage % self.par.pp)  # one per rank: chunks share it
        if key in self.cache:  # made on these ranks already (for another model chunk)
            self.where[self.cache[key]] = stage
            return self.cache[key]
        have = sv.on(axis)
        if axis == "mb" or (axis == "edp" and not data_parallel) or need in ("P", "M") or (
                have == "M" and need != "R"):
            name = self.g.tensors[sv.tid].name
            raise ConfigError(f"{name}: cannot convert from {have} to {need} on the {axis} axis")
        sv = self.move(sv, stage, dir)
        if have == "M":
            op, kw = "all_reduce_max", {}
        elif have == "P":
            op, kw = ("all_reduce", {}) if need == "R" else ("reduce_scatter", {"dim": need})
        elif need == "R":
            op, kw = "all_gather", {"dim": have}
        elif have == "R":
            op, kw = "split", {"dim": need, "parts": self.size[axis]}
        else:
            op, kw = "all_to_all", {"split_dim": need, "concat_dim": have}
        out = sv.relaid(axis, need)
        self.ops.append(SOp("conv", op, dir, self.g.tensors[sv.tid].name, stage, [sv], [out],
                            kw, axis=axis))
        self.where[out] = stage
        self.cache[key] = out
        return out

    def move(self, sv: SVal, stage: int, dir: str) -> SVal:
        src = self.where.get(sv, stage)
        if src % self.par.pp == stage % self.par.pp:  # the same ranks (model chunks of a stage)
            return sv
        key = (sv, "move", stage % self.par.pp)
        if key not in self.cache:
            name = self.g.tensors[sv.tid].name
            self.ops.append(SOp("move", "send_recv", dir, name, stage, [sv], [sv], src_stage=src))
            self.cache[key] = sv
        return sv

    # -- ops ------------------------------------------------------------------
    def run(self) -> Program:
        params: dict[int, tuple[int, SVal | None]] = {}
        grad_of = self.grad_targets()
        last_forward = max(i for i, lop in enumerate(self.g.ops) if lop.dir == "fw")
        for i, lop in enumerate(tqdm(self.g.ops, desc="sharding", leave=False, disable=None)):
            if lop.dir == "fw":
                self.forward(i, lop)
            elif lop.op in ("ones", "zeros") and lop.dir == "bw":
                self.constant(i, lop, grad_of[lop.outputs[0]])
            elif lop.dir == "bw":
                self.backward(i, lop)
            if i == last_forward:
                self.finish_loss()
        for tid in self.g.grads:
            stage = self.param_stage(tid)
            grad = self.final_grad(tid, stage)
            params[tid] = (stage, grad)
        inputs = {v[0]: sv for v, sv in self.current.items()
                  if self.g.tensors[v[0]].kind in INPUT_KINDS}
        zero = {tid: self.zero_axes(tid) for tid in params if self.zero_axes(tid)}
        return Program(self.ops, params, inputs, self.current[(self.g.loss, 0)], zero)

    def grad_targets(self) -> dict[Value, Value]:
        """Gradient value -> the forward value it is the gradient of."""
        target: dict[Value, Value] = {}
        for lop in self.g.ops:
            if lop.dir == "bw" and lop.fw >= 0:
                fw = self.g.ops[lop.fw]
                for k, out in enumerate(fw.outputs):
                    target[lop.inputs[len(fw.inputs) + k]] = out
        return target

    def shapes(self, values) -> list[tuple[int, ...]]:
        return [self.g.shape(v[0]) for v in values]

    def forward(self, i: int, lop: LOp) -> None:
        stage = self.stages[i]
        ins = [self.gathered(self.value(v), stage) for v in lop.inputs]
        shapes = self.shapes(lop.inputs)
        params = [self.g.tensors[v[0]].kind == "param" for v in lop.inputs]
        need_by_axis, out_by_axis, replicated = [], [], []
        for axis in AXES:
            need, out, rep = propagate(lop.op, lop.kwargs, [s.on(axis) for s in ins], shapes,
                                       self.size[axis], params, len(lop.outputs))
            if axis == "tp" and i in self.gather_first:
                need, out = ["R"], ["R"] * len(lop.outputs)
            if axis == "cp" and self.policy.ulysses:
                need, out, rep = ulysses(lop, [s.on(axis) for s in ins], shapes, need, out, rep)
            need_by_axis.append(need)
            out_by_axis.append(out)
            replicated.append(rep)
        used = [self.convert(sv, tuple(n[p] for n in need_by_axis), stage, "fw")
                for p, sv in enumerate(ins)]
        outs = [SVal(v[0], v[1], tuple(o[k] for o in out_by_axis))
                for k, v in enumerate(lop.outputs)]
        self.emit_op(lop, stage, used, outs)
        self.used[i] = (used, [tuple(o[k] for o in out_by_axis) for k in range(len(outs))],
                        replicated)
        leave = self.leave_tp_region(lop, outs[0])
        if leave is not None:
            reduced = self.convert(outs[0], outs[0].relaid("tp", leave).layout, stage, "fw")
            self.current[lop.outputs[0]] = reduced

    def leave_tp_region(self, lop: LOp, out: SVal) -> Layout | None:
        """The tp layout a value leaving a tensor-parallel region takes at once,
        or None. A row-parallel linear's (or vocab-parallel embedding's) partial
        sum is all-reduced; with sequence parallelism it is reduce-scattered
        along the sequence instead, and a replicated embedding is split along
        it, so everything between TP regions is sequence-split."""
        sp = self.policy.sequence_parallel and self.size["tp"] > 1
        have = out.on("tp")
        if lop.op in REDUCE_AT_ONCE and have == "P":
            return SEQ_DIM if sp else "R"
        if sp and lop.op == "embedding" and have == "R":
            return SEQ_DIM
        return None

    def constant(self, i: int, lop: LOp, target: Value) -> None:
        layout = tuple(grad_layout(layer) for layer in self.current[target].layout)
        stage = self.stages[i] if self.stages[i] >= 0 else self.where[self.current[target]]
        self.stages[i] = stage
        self.emit_op(lop, stage, [], [SVal(*lop.outputs[0], layout)])

    def backward(self, i: int, lop: LOp) -> None:
        stage = self.stages[i]
        fw = self.g.ops[lop.fw]
        used, out_layouts, replicated = self.used[lop.fw]
        n_in = len(fw.inputs)
        inputs: list[SVal | None] = [self.regathered(v, used[p], stage)
                                     if v != ABSENT else None
                                     for p, v in enumerate(lop.inputs[:n_in])]
        grads = [self.value(v) for v in lop.inputs[n_in:]]
        if any(layer == "M" for lay in out_layouts for layer in lay):
            raise ConfigError(f"{lop.name}: the gradient of a maximum over a split dim is not "
                              f"supported (detach it, as a stable cross-entropy does)")
        wants = [tuple(grad_layout(layer) for layer in lay) for lay in out_layouts]
        natural = [tuple(natural_grad(layer, rep) for layer, rep in zip(used[p].layout, replicated))
                   for p in range(n_in)]
        if lop.op == "multiref":
            # sum the copies' gradients in whatever layout they share (partial sums
            # add up), so a fan-out needs one reduction, not one per reader
            for a in range(len(AXES)):
                if len({g.layout[a] for g in grads}) == 1:
                    wants = [w[:a] + (grads[0].layout[a],) + w[a + 1:] for w in wants]
                    natural[0] = natural[0][:a] + (grads[0].layout[a],) + natural[0][a + 1:]
        inputs += [self.convert(g, w, stage, "bw") for g, w in zip(grads, wants)]
        outs: list[SVal | None] = [None if v == ABSENT else SVal(v[0], v[1], natural[p])
                                   for p, v in enumerate(lop.outputs)]
        self.emit_op(lop, stage, inputs, outs)

    def emit_op(self, lop: LOp, stage: int, ins: list[SVal | None],
                outs: list[SVal | None]) -> None:
        self.ops.append(SOp("op", lop.op, lop.dir, lop.name, stage, ins, outs, dict(lop.kwargs)))
        for v, sv in zip(lop.outputs, outs):
            if sv is not None:
                self.current[v] = sv
                self.where[sv] = stage

    def finish_loss(self) -> None:
        """Reduce the loss across tensor-parallel ranks (stays partial over batches)."""
        loss = self.current[(self.g.loss, 0)]
        if loss.on("tp") == "P":
            want = loss.relaid("tp", "R").layout
            self.current[(self.g.loss, 0)] = self.convert(loss, want, self.where[loss], "fw")

    def param_stage(self, tid: int) -> int:
        stages = {self.stages[i] for i, lop in enumerate(self.g.ops)
                  if lop.dir == "fw" and any(v[0] == tid for v in lop.inputs)}
        if len(stages) != 1:
            raise ConfigError(f"parameter {self.g.tensors[tid].name} is used on stages {stages}")
        return stages.pop()

    def final_grad(self, tid: int, stage: int) -> SVal | None:
        """The parameter's gradient laid out like the parameter on tp; partial
        sums over the batch axes are left to accumulation and the reducer."""
        grad_value = self.accumulated.get(self.g.grads[tid])
        if grad_value is None:
            return None
        sv = self.current[grad_value]
        param = self.value((tid, 0))
        axes = self.zero_axes(tid)
        if param.on("ep") != sv.on("ep") and sv.on("ep") != "P" and "ep" not in axes:
            raise AssertionError(f"gradient of {self.g.tensors[tid].name} is {sv.on('ep')} on ep")
        sv = self.convert(sv, sv.relaid("tp", param.on("tp")).layout, stage, "bw")
        if self.policy.zero >= 2:  # each microbatch's gradient reduce-scattered to its owner
            want = list(sv.layout)
            for a in axes:
                want[AXES.index(a)] = param.on(a)
            sv = self.convert(sv, tuple(want), stage, "bw", data_parallel=True)
        return sv


def ulysses(lop: LOp, ins: list[Layout], shapes: list[tuple[int, ...]], need: list[Layout],
            out: list[Layout], rep: bool) -> tuple[list[Layout], list[Layout], bool]:
    """Ulysses on the cp axis: attention's two matmuls take their operands
    split on heads (an all-to-all from the sequence split), so scores, mask
    and softmax see whole sequences; a linear reading a head-split input
    (the output projection) takes it split on the sequence again."""
    if lop.op == "matmul" and len(shapes[0]) == 4 and any(is_split(x) for x in ins):
        return [HEAD_DIM, HEAD_DIM], [HEAD_DIM], False
    if lop.op == "linear" and ins[0] == len(shapes[0]) - 1 and ins[1] == "R":
        return [SEQ_DIM, "R"], [SEQ_DIM], False
    return need, out, rep


def shard(g: LogicalGraph, cfg: ModelConfig, par: Parallelism, policy: Policy) -> Program:
    return _Sharder(g, cfg, par, policy).run()


# ---------------------------------------------------------------------------
# pass 2: ranks


@dataclass(frozen=True)
class Coord:
    """Where a piece lives: pipeline stage and index on each mesh axis. ``cp``
    is the sequence chunk, which names the cp rank except with causal load
    balancing, where 2 cp chunks live on cp ranks (``_Emitter.cp_rank``)."""

    stage: int
    edp: int
    ep: int
    cp: int
    tp: int

    def get(self, axis: str, mb: int) -> int:
        return mb if axis == "mb" else getattr(self, axis)

    def with_axes(self, **values: int) -> Coord:
        return Coord(self.stage, values.get("edp", self.edp), values.get("ep", self.ep),
                     values.get("cp", self.cp), values.get("tp", self.tp))


class _Emitter:
    def __init__(self, g: LogicalGraph, prog: Program, par: Parallelism, policy: Policy,
                 world: dict):
        self.g, self.prog, self.par, self.policy = g, prog, par, policy
        self.size = axis_sizes(par, policy)
        self.plan = Plan(world=dict(world), logical=list(g.tensors), loss=g.loss,
                         grads=dict(g.grads))
        self.slots: dict[tuple[SVal, int, int, int], int] = {}
        self.written: set[int] = set()
        self.last_buffer: dict[tuple[int, int], int] = {}
        #: (rank, param) -> the reduced gradient the optimizer reads, when a
        #: reducer (and ZeRO-1's owned split) follows the last accumulation
        self.final_buffer: dict[tuple[int, int], int] = {}
        #: values made once per step, before the first microbatch (ZeRO-1/2's
        #: parameter all-gather): every microbatch reads the one copy
        self.per_step = {sv for sop in prog.ops if sop.dir == "none" for sv in sop.outputs}
        #: the (virtual) stage that computes the loss
        self.loss_stage = next(sop.stage for sop in reversed(prog.ops)
                               if prog.loss in sop.outputs)

    def cp_rank(self, chunk: int) -> int:
        """The context-parallel rank that holds sequence chunk ``chunk``: with
        causal load balancing chunks k and 2 cp - 1 - k are on rank k."""
        n = self.par.cp
        return chunk if chunk < n else 2 * n - 1 - chunk

    def rank(self, c: Coord) -> int:
        d = c.edp * self.size["ep"] + c.ep
        return ((c.stage * self.par.dp + d) * self.par.cp + self.cp_rank(c.cp)) * self.par.tp + c.tp

    def coords(self, stage: int) -> list[Coord]:
        """One coordinate per rank of a stage (its first sequence chunk on cp)."""
        return [Coord(stage, a, b, k, t) for a, b, k, t in product(
            range(self.size["edp"]), range(self.size["ep"]), range(self.par.cp),
            range(self.size["tp"]))]

    def chunks(self, c: Coord) -> list[Coord]:
        """The coordinates of the sequence chunks the rank of ``c`` holds: its
        own, and with causal load balancing chunk 2 cp - 1 - c.cp too."""
        if not self.policy.cp_balance:
            return [c]
        return [c, c.with_axes(cp=2 * self.par.cp - 1 - c.cp)]

    def chunk_key(self, sv: SVal, c: Coord) -> int:
        """Which of a rank's two chunks a value belongs to; -1 when it does not
        depend on the chunk (replicated on cp, a parameter say)."""
        return c.cp if self.policy.cp_balance and sv.on("cp") != "R" else -1

    # -- tensors --------------------------------------------------------------
    def view(self, sv: SVal, c: Coord, mb: int, mb_parts: tuple[int, int] | None,
             both: bool = False):
        """Slices (full coordinates) and partial-sum parts of ``sv`` on (c, mb).

        With causal load balancing a part partial on cp is numbered by the rank
        holding it and, as the fastest digit, which of its two chunks it is
        (``both``: the rank's two chunks summed); ``mb_parts`` then counts
        (microbatch, chunk) pairs, so a gradient buffer's parts stay one range."""
        slices = []
        for dim, full in enumerate(self.g.shape(sv.tid)):
            index, count = 0, 1
            for axis in SLICE_ORDER:
                if sv.on(axis) == dim:
                    index = index * self.size[axis] + c.get(axis, mb)
                    count *= self.size[axis]
            if full % count:
                name = self.g.tensors[sv.tid].name
                raise ConfigError(f"{name}: dim {dim} of size {full} does not split {count} ways")
            step = full // count
            slices.append((index * step, (index + 1) * step))
        kind = "M" if "M" in sv.layout else "P"
        halves = self.policy.cp_balance and sv.on("cp") == kind
        digits = []  # (size, first, count) of each axis the value is partial on
        for axis in PART_ORDER:
            if sv.on(axis) != kind:
                continue
            if axis == "cp" and halves:
                digits.append((self.par.cp, self.cp_rank(c.cp), 1))
            elif axis == "mb" and mb_parts:
                size = self.size["mb"] * (2 if halves else 1)
                digits.append((size, mb_parts[0], mb_parts[1] - mb_parts[0]))
            else:
                digits.append((self.size[axis], c.get(axis, mb), 1))
        if halves and mb_parts and sv.on("mb") != kind:  # one microbatch: chunks 0..u
            digits.append((2, mb_parts[0], mb_parts[1] - mb_parts[0]))
        elif halves and not mb_parts:
            digits.append((2, 0, 2) if both else (2, int(c.cp >= self.par.cp), 1))
        lo, span, n = 0, 1, 1
        for size, first, count in digits:
            n *= size
            lo = lo * size + first
            span *= count
        if kind == "M":
            if "P" in sv.layout:
                raise AssertionError(f"{self.g.tensors[sv.tid].name}: a partial sum of maxima")
            return tuple(slices), (lo, lo + span, -n)  # parts of a partial maximum
        parts = (0, 1, 1) if span == n else (lo, lo + span, n)
        return tuple(slices), parts

    def slot(self, sv: SVal, c: Coord, mb: int, mb_parts=None, both: bool = False) -> int:
        """The plan tensor of ``sv`` on (c, mb), made on first use; versions are
        numbered later, in execution order."""
        key = (sv, self.rank(c), mb, -2 if both else self.chunk_key(sv, c))
        if key not in self.slots:
            slices, parts = self.view(sv, c, mb, mb_parts, both)
            shape = tuple(b - a for a, b in slices)
            self.plan.tensors.append(
                Tensor(self.rank(c), mb, sv.tid, -1, shape, sv.lver, slices, parts))
            self.slots[key] = len(self.plan.tensors) - 1
        return self.slots[key]

    def read(self, sv: SVal | None, c: Coord, mb: int) -> int:
        if sv is None:
            return -1
        if (self.prog.inputs.get(sv.tid) == sv and self.g.tensors[sv.tid].kind in (
                "param", "buffer")) or sv in self.per_step:
            mb = -1  # one copy for all microbatches
        return self.slot(sv, c, mb)

    def write(self, sv: SVal | None, c: Coord, mb: int, mb_parts=None, both: bool = False) -> int:
        if sv is None:
            return -1
        if sv in self.per_step:
            mb = -1
        t = self.slot(sv, c, mb, mb_parts, both)
        if t in self.written:
            raise AssertionError(f"{self.g.tensors[sv.tid].name} written twice on {c} mb {mb}")
        self.written.add(t)
        return t

    # -- nodes ----------------------------------------------------------------
    def instances(self, sop: SOp, chunks: list[Coord], mb: int) -> list[Node]:
        """The nodes of a sharded op on one rank: one per sequence chunk the
        rank holds, or one when its outputs do not depend on the chunk (a
        value replicated on cp, such as keys all-gathered along the sequence)."""
        if len(chunks) > 1 and any(sv is not None and sv.on("cp") != "R" for sv in sop.outputs):
            return [self.node(sop, k, mb) for k in chunks]
        return [self.node(sop, chunks[0], mb)]

    def loss_sum(self, chunks: list[Coord], mb: int) -> Node:
        """With causal load balancing: the loss of a rank's two chunks summed,
        the loss of all the tokens it holds (one tensor per microbatch, as
        every rank ends with)."""
        loss = self.prog.loss
        inputs = tuple(self.read(loss, k, mb) for k in chunks)
        out = self.write(loss, chunks[0], mb, both=True)
        return Node(self.rank(chunks[0]), mb, "add", "fw", inputs, (out,), {},
                    self.g.tensors[loss.tid].name)

    def node(self, sop: SOp, c: Coord, mb: int) -> Node:
        rank = self.rank(c)
        kw = dict(sop.kwargs)
        if sop.kind == "move":
            src = Coord(sop.src_stage % self.par.pp, c.edp, c.ep, c.cp, c.tp)
            inputs = (self.read(sop.inputs[0], src, mb),)
            kw = {"src": self.rank(src), "dst": rank}
        elif sop.kind == "conv":
            me = c.get(sop.axis, mb)
            kw["index"] = me
            if sop.op == "split":
                inputs = (self.read(sop.inputs[0], c, mb),)
            else:
                group = [c.with_axes(**{sop.axis: i}) for i in range(self.size[sop.axis])]
                inputs = tuple(self.read(sop.inputs[0], other, mb) for other in group)
        else:
            inputs = tuple(self.read(sv, c, mb) for sv in sop.inputs)
        outputs = tuple(self.write(sv, c, mb) for sv in sop.outputs)
        if sop.op == "causal_mask":
            kw.update(self.mask_chunks(outputs[0]))
        node = Node(rank, mb, sop.op, sop.dir, inputs, outputs, kw, sop.name)
        if sop.kind == "op":
            node = node._replace(kwargs=self.local_kwargs(node))
        return node

    def mask_chunks(self, t: int) -> dict[str, int]:
        """Where a causal mask's local scores sit in the whole sequence (a
        context-parallel rank holds one chunk of the query rows), in units of
        the local size; nothing when they are the whole sequence."""
        (r0, r1), (c0, c1) = self.plan.tensors[t].slices[-2:]
        chunks = {"row_chunk": r0 // (r1 - r0), "col_chunk": c0 // (c1 - c0)}
        return {k: v for k, v in chunks.items() if v}

    def local_kwargs(self, node: Node) -> dict:
        """Kwargs that hold sizes (unflatten's sizes, ...), for the local shapes."""
        ins, outs = fw_shapes(self.plan, node)
        return get_op(node.op).resized(node.kwargs, ins, outs)

    # -- schedule -------------------------------------------------------------
    def order(self, stage: int) -> list[tuple[str, int, int]]:
        """The (phase, microbatch, virtual stage) sequence of one pipeline stage."""
        nm, pp, v = self.par.nm, self.par.pp, self.policy.virtual_stages
        if v > 1:
            return self.interleaved(stage)
        if self.policy.schedule == "gpipe":
            return [("fw", m, stage) for m in range(nm)] + [("bw", m, stage) for m in range(nm)]
        warm = min(pp - stage - 1, nm)
        seq = [("fw", m, stage) for m in range(warm)]
        for m in range(nm - warm):
            seq += [("fw", warm + m, stage), ("bw", m, stage)]
        return seq + [("bw", m, stage) for m in range(nm - warm, nm)]

    def interleaved(self, stage: int) -> list[tuple[str, int, int]]:
        """Megatron's interleaved schedule: microbatches in groups of pp run
        chunk after chunk (backward chunks in reverse); 1F1B after a warm-up
        of 2 (pp - stage - 1) + (v - 1) pp forward units."""
        nm, pp, v = self.par.nm, self.par.pp, self.policy.virtual_stages
        units = nm * v

        def unit(phase: str, u: int) -> tuple[str, int, int]:
            group, within = divmod(u, pp * v)
            chunk = within // pp if phase == "fw" else v - 1 - within // pp
            return phase, group * pp + within % pp, chunk * pp + stage

        fw = [unit("fw", u) for u in range(units)]
        bw = [unit("bw", u) for u in range(units)]
        if self.policy.schedule == "gpipe":
            return fw + bw
        warm = min(2 * (pp - stage - 1) + (v - 1) * pp, units)
        seq = fw[:warm]
        for i in range(units - warm):
            seq += [fw[warm + i], bw[i]]
        return seq + bw[units - warm:]

    def run(self) -> Plan:
        seqs: dict[int, list[Node]] = {}
        coords = [c for s in range(self.par.pp) for c in self.coords(s)]
        for c in tqdm(coords, desc="ranks", leave=False, disable=None):
            ops = [op for op in self.prog.ops if op.stage % self.par.pp == c.stage]
            seqs[self.rank(c)] = self.rank_sequence(ops, c)
        shared: dict[tuple, tuple[int, ...]] = {}
        for c in coords:
            seqs[self.rank(c)].extend(self.reducers(c, shared))
            seqs[self.rank(c)].extend(self.optimizer_steps(c))
        self.plan.nodes = merge(seqs, self.plan)
        self.check_written()
        number_versions(self.plan)
        return self.plan

    def params_of(self, stage: int) -> list[tuple[int, SVal | None]]:
        """Parameters of one virtual stage (model chunk)."""
        return [(tid, grad) for tid, (s, grad) in self.prog.params.items() if s == stage]

    def params_on(self, stage: int) -> list[tuple[int, SVal | None]]:
        """Parameters of every model chunk of one pipeline stage."""
        return [(tid, grad) for tid, (s, grad) in self.prog.params.items()
                if s % self.par.pp == stage]

    def rank_sequence(self, ops: list[SOp], c: Coord) -> list[Node]:
        rank = self.rank(c)
        chunks = self.chunks(c)
        sum_loss = len(chunks) > 1 and self.prog.loss.on("cp") == "P"
        params = self.params_on(c.stage)
        seq: list[Node] = []
        full = self.policy.zero == 1  # ZeRO-1 accumulates whole gradients
        for tid, _ in params:
            t = self.write(self.buffer(tid, None, lver=0, full=full), c, -1)
            seq.append(Node(rank, -1, "zeros", "none", (), (t,),
                            {"shape": list(self.plan.tensors[t].shape)}, self.buffer_name(tid)))
            self.last_buffer[(rank, tid)] = t
        for sop in ops:
            if sop.dir == "none":
                seq.extend(self.instances(sop, chunks, -1))
        for phase, mb, chunk in self.order(c.stage):
            for sop in ops:
                if sop.dir == phase and sop.stage == chunk:
                    seq.extend(self.instances(sop, chunks, mb))
            if phase == "fw":
                if sum_loss and chunk == self.loss_stage:
                    seq.append(self.loss_sum(chunks, mb))
                continue
            for tid, grad in self.params_of(chunk):
                if grad is None:
                    continue
                # each chunk's gradient in turn: (microbatch, chunk) pairs 0..u
                each = chunks if grad.on("cp") == "P" else chunks[:1]
                for s, k in enumerate(each):
                    t = self.write(self.buffer(tid, grad, lver=1, full=full), k, mb,
                                   mb_parts=(0, mb * len(each) + s + 1))
                    seq.append(Node(rank, mb, "local_grad_accumulation", "none",
                                    (self.last_buffer[(rank, tid)], self.read(grad, k, mb)),
                                    (t,), {}, self.buffer_name(tid)))
                    self.last_buffer[(rank, tid)] = t
        return seq

    def buffer_name(self, tid: int) -> str:
        return self.g.tensors[self.g.grads[tid]].name

    def buffer(self, tid: int, grad: SVal | None, lver: int, full: bool = False) -> SVal:
        """A gradient buffer: laid out like its parameter on ep/tp, and partial
        over the batch axes where the gradient is (None: fully reduced). With
        ZeRO it is the owned shard, or whole on the data-parallel axes when
        ``full`` (ZeRO-1 before its last step)."""
        lay = list(self.prog.inputs[tid].layout)
        if full:
            for axis in self.prog.zero_axes.get(tid, ()):
                lay[AXES.index(axis)] = "R"
        if grad is not None:
            for axis in BATCH_AXES:
                if grad.on(axis) == "P":
                    lay[AXES.index(axis)] = "P"
        return SVal(self.g.grads[tid], lver, tuple(lay))

    def reducers(self, c: Coord, shared: dict[tuple, tuple[int, ...]]) -> list[Node]:
        """Cross-replica reduction of every gradient that is partial over replicas.

        Every member of a replica group reads the same inputs: the tuple is
        built once per group (``shared``), not once per member, which made
        emitting the reducers quadratic in the replicas."""
        nodes = []
        for tid, grad in self.params_on(c.stage):
            axes = [a for a in ("edp", "ep", "cp") if grad is not None and grad.on(a) == "P"]
            if not axes:
                continue
            key = (tid, c.stage, *(0 if a in axes else getattr(c, a) for a in ("edp", "ep", "tp")))
            ranks = dict(self.size, cp=self.par.cp)  # ranks per axis, not chunks
            if key not in shared:
                group = [c.with_axes(**dict(zip(axes, idx)))
                         for idx in product(*(range(ranks[a]) for a in axes))]
                shared[key] = tuple(self.last_buffer[(self.rank(o), tid)] for o in group)
            index = 0
            for a in axes:
                index = index * ranks[a] + getattr(c, a)
            zero1 = self.policy.zero == 1 and tid in self.prog.zero_axes
            t = self.write(self.buffer(tid, None, lver=1, full=zero1), c, -1)
            nodes.append(Node(self.rank(c), -1, "reducer", "none", shared[key], (t,),
                              {"index": index}, self.buffer_name(tid)))
            self.final_buffer[(self.rank(c), tid)] = t
            if zero1:
                nodes.append(self.keep_owned(tid, t, c))
                self.final_buffer[(self.rank(c), tid)] = nodes[-1].outputs[0]
        return nodes

    def optimizer_steps(self, c: Coord) -> list[Node]:
        """The optimizer step of every parameter of the stage, on the shard the
        rank holds (its owned shard under ZeRO), after the final gradient."""
        nodes = []
        stage_params = {tid for tid, _ in self.params_on(c.stage)}
        for lop in self.g.ops:
            if lop.op not in OPTIMIZERS or lop.inputs[0][0] not in stage_params:
                continue
            tid = lop.inputs[0][0]
            lay = self.prog.inputs[tid].layout
            states = [self.read(SVal(v[0], v[1], lay), c, -1) for v in lop.inputs[2:]]
            key = (self.rank(c), tid)
            inputs = (self.read(self.prog.inputs[tid], c, -1),
                      self.final_buffer.get(key, self.last_buffer[key]), *states)
            outputs = tuple(self.write(SVal(v[0], v[1], lay), c, -1) for v in lop.outputs)
            nodes.append(Node(self.rank(c), -1, lop.op, "none", inputs, outputs,
                              dict(lop.kwargs), lop.name))
            if self.policy.zero in (1, 2):
                nodes += self.gather_updated(SVal(*lop.outputs[0], lay), c)
        return nodes

    def gather_updated(self, sv: SVal, c: Coord) -> list[Node]:
        """ZeRO-1/2 keep the whole parameter for the step: after the update,
        each rank all-gathers the owners' updated shards (one all-gather per
        ZeRO axis, the finest first, so each gathers contiguous pieces)."""
        nodes = []
        axes = self.prog.zero_axes.get(sv.tid, ())
        while any(is_split(sv.on(a)) for a in axes):
            step = next(a for a in SLICE_ORDER if a in axes and is_split(sv.on(a))
                        and contiguous(sv, sv.relaid(a, "R"), a))
            group = [c.with_axes(**{step: i}) for i in range(self.size[step])]
            inputs = tuple(self.read(sv, other, -1) for other in group)
            out = sv.relaid(step, "R")
            nodes.append(Node(self.rank(c), -1, "all_gather", "none", inputs,
                              (self.write(out, c, -1),),
                              {"dim": sv.on(step), "index": c.get(step, -1)},
                              self.g.tensors[sv.tid].name))
            sv = out
        return nodes

    def keep_owned(self, tid: int, reduced: int, c: Coord) -> Node:
        """ZeRO-1: the rank keeps the owned shard of the reduced gradient (what
        its optimizer-state shard updates); a local split, no communication."""
        axes = self.prog.zero_axes[tid]
        owned = self.buffer(tid, None, lver=1)
        index, parts = 0, 1
        for axis in SLICE_ORDER:
            if axis in axes:
                index = index * self.size[axis] + c.get(axis, -1)
                parts *= self.size[axis]
        t = self.write(owned, c, -1)
        kw = {"dim": owned.on(axes[0]), "parts": parts, "index": index}
        return Node(self.rank(c), -1, "split", "none", (reduced,), (t,), kw, self.buffer_name(tid))

    def check_written(self) -> None:
        """Every tensor read is written by some node or is an input."""
        for i, t in enumerate(self.plan.tensors):
            if i not in self.written and self.g.tensors[t.tid].kind not in INPUT_KINDS:
                raise AssertionError(f"{self.g.tensors[t.tid].name} on rank {t.rank} "
                                     f"mb {t.mb} is read but never written")


def number_versions(plan: Plan, tids: frozenset[int] | None = None) -> None:
    """SSA versions in execution order, per (rank, mb, tid); gradient buffers,
    updated across microbatches, count per (rank, tid). Only the logical
    tensors ``tids`` when given; tensors never written get version 0, and
    an input relaid on a rank (a local split) numbers on from it."""
    count: dict[tuple, int] = {}
    tensors = plan.tensors
    outputs = {o for node in plan.nodes for o in node.outputs if o >= 0}
    for i, t in enumerate(tensors):  # inputs read from memory: versions 0, 1, ...
        if i not in outputs and plan.logical[t.tid].kind in INPUT_KINDS and (
                tids is None or t.tid in tids):
            key = (t.rank, t.mb, t.tid)  # two pieces with causal load balancing
            tensors[i] = t._replace(version=count.get(key, 0))
            count[key] = count.get(key, 0) + 1
    written = set()
    for node in plan.nodes:
        for o in node.outputs:
            if o < 0 or (tids is not None and tensors[o].tid not in tids):
                continue
            t = tensors[o]
            gradbuf = plan.logical[t.tid].kind == "gradbuf"
            key = (t.rank, None if gradbuf else t.mb, t.tid)
            tensors[o] = t._replace(version=count.get(key, 0))
            count[key] = count.get(key, 0) + 1
            written.add(o)
    for i, t in enumerate(tensors):
        if i not in written and t.version < 0:
            tensors[i] = t._replace(version=0)


def merge(seq: dict[int, list[Node]], plan: Plan) -> list[Node]:
    """One global execution order from per-rank sequences: repeatedly run, on
    each rank, the nodes whose inputs are already written."""
    produced = [False] * len(plan.tensors)
    written = {o for nodes in seq.values() for n in nodes for o in n.outputs if o >= 0}
    for i in range(len(plan.tensors)):
        if i not in written:
            produced[i] = True
    pos = dict.fromkeys(seq, 0)
    out: list[Node] = []
    while True:
        progress = False
        for rank, nodes in seq.items():
            while pos[rank] < len(nodes):
                n = nodes[pos[rank]]
                if not all(i < 0 or produced[i] for i in n.inputs):
                    break
                out.append(n)
                for o in n.outputs:
                    if o >= 0:
                        produced[o] = True
                pos[rank] += 1
                progress = True
        if all(pos[r] == len(nodes) for r, nodes in seq.items()):
            return out
        if not progress:
            stuck = {r: nodes[pos[r]].name for r, nodes in seq.items() if pos[r] < len(nodes)}
            raise AssertionError(f"schedule deadlock: {stuck}")


def contiguous(before: SVal, after: SVal, axis: str) -> bool:
    """Whether a collective on ``axis`` from ``before`` to ``after`` splits or
    gathers contiguous pieces: no finer axis (later in SLICE_ORDER) may split
    the dim it splits or gathers at the same time."""
    finer = SLICE_ORDER[SLICE_ORDER.index(axis) + 1:]
    return not any(is_split(lay.on(axis)) and any(lay.on(a) == lay.on(axis) for a in finer)
                   for lay in (before, after))


def axis_sizes(par: Parallelism, policy: Policy | None = None) -> dict[str, int]:
    """Pieces per axis. With causal load balancing the cp axis cuts the
    sequence into 2 cp chunks, two per context-parallel rank."""
    cp = par.cp * (2 if policy is not None and policy.cp_balance else 1)
    return {"mb": par.nm, "edp": par.dp // par.ep_dp, "ep": par.ep_dp, "cp": cp, "tp": par.tp}


def check_parallelism(cfg: ModelConfig, par: Parallelism, gbs: int) -> None:
    for flag in ("dp", "tp", "pp", "ep", "nm", "cp"):
        if getattr(par, flag) < 1:
            raise ConfigError(f"--{flag} must be at least 1")
    if gbs % (par.dp * par.nm):
        raise ConfigError(f"--gbs {gbs} does not split into dp {par.dp} x nm {par.nm} microbatches")
    if par.pp > cfg.layers:
        raise ConfigError(f"--pp {par.pp} is more than --layers {cfg.layers}")
    if par.dp % par.ep and (par.ep % par.tp or par.dp % (par.ep // par.tp)):
        raise ConfigError(f"--ep {par.ep} must divide --dp {par.dp}, or be --tp {par.tp} times "
                          f"a divisor of --dp")
    if par.ep > 1 and cfg.model != "moe":
        raise ConfigError("--ep needs the moe model")
    if par.ep > 1 and cfg.experts % par.ep:
        raise ConfigError(f"--experts {cfg.experts} is not divisible by --ep {par.ep}")
    if cfg.model != "mlp":
        for name in ("heads", "kv_heads", "ffn", "vocab"):
            if getattr(cfg, name) % par.tp:
                raise ConfigError(f"--{name} {getattr(cfg, name)} is not divisible by --tp {par.tp}")
    elif cfg.hidden % par.tp:
        raise ConfigError(f"--hidden {cfg.hidden} is not divisible by --tp {par.tp}")


def check_policy(cfg: ModelConfig, par: Parallelism, policy: Policy) -> None:
    sp = par.tp if policy.sequence_parallel else 1
    if policy.sequence_parallel and cfg.model != "llama3":
        raise ConfigError("--sequence_parallel needs the llama3 model")
    if par.cp > 1 and cfg.model != "llama3":
        raise ConfigError("--cp needs the llama3 model")
    v = policy.virtual_stages
    if v < 1:
        raise ConfigError("--vpp must be at least 1")
    if v > 1 and (par.pp < 2 or par.nm % par.pp or cfg.layers < par.pp * v):
        raise ConfigError(f"--vpp {v} needs --pp > 1, --nm divisible by --pp {par.pp} and "
                          f"--layers at least pp x vpp = {par.pp * v}")
    if policy.ulysses and (par.cp < 2 or par.tp > 1 or cfg.heads % par.cp):
        raise ConfigError(f"--ulysses needs --cp > 1, --tp 1 and --heads {cfg.heads} "
                          f"divisible by --cp {par.cp}")
    if policy.cp_balance and (par.cp < 2 or policy.ulysses):
        raise ConfigError("--cp_balance needs --cp > 1 and no --ulysses")
    chunks = par.cp * (2 if policy.cp_balance else 1)
    if cfg.seqlen % (chunks * sp):
        raise ConfigError(f"--seqlen {cfg.seqlen} is not divisible by {chunks * sp} "
                          f"(sequence chunks {chunks} x sequence parallel {sp})")
    if cfg.model == "moe" and not par.experts_over_tp and cfg.moe_ffn % par.tp:
        raise ConfigError(f"--moe_ffn {cfg.moe_ffn} is not divisible by --tp {par.tp}")
    if policy.zero and (par.cp > 1 or v > 1):
        raise ConfigError("--zero with --cp or --vpp is not supported yet")


def parallel_plan(g: LogicalGraph, cfg: ModelConfig, par: Parallelism, gbs: int,
                  world: dict, policy: Policy | None = None,
                  edit: Callable[[Program], Program] | None = None) -> Plan:
    """The plan of ``par``. ``edit`` changes the sharded program before it is
    expanded per rank and microbatch (scripts/mutate_fold.py makes every
    replica and microbatch wrong alike that way)."""
    policy = policy or Policy()
    check_parallelism(cfg, par, gbs)
    check_policy(cfg, par, policy)
    prog = shard(g, cfg, par, policy)
    if edit is not None:
        prog = edit(prog)
    return _Emitter(g, prog, par, policy, world).run()


