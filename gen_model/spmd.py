"""Pass 1 of the parallelizer: the SPMD program per pipeline stage.

:func:`shard` walks the logical graph once and decides, per mesh axis
(microbatch, expert-data-parallel, expert-parallel, context-parallel,
tensor-parallel), the layout of every value (see gen_model.sharding),
inserting collectives where a consumer needs another layout and send/recv
where it runs on another pipeline stage. docs/parallelism.md explains each
strategy.
"""

from __future__ import annotations

from dataclasses import replace

from tqdm import tqdm

from gen_model.config import ConfigError, ModelConfig, Parallelism
from gen_model.graph import ABSENT, LogicalGraph, LOp, Value
from gen_model.program import (
    AXES,
    COLUMN,
    EXPERT,
    HEAD_DIM,
    LAYER,
    REDUCE_AT_ONCE,
    ROW,
    SEQ_DIM,
    SLICE_ORDER,
    Policy,
    Program,
    SOp,
    SVal,
    axis_sizes,
    contiguous,
)
from gen_model.sharding import Layout, grad_layout, is_split, natural_grad, propagate
from verdict.plan import INPUT_KINDS


class Sharder:
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
        owners divide evenly (the owners at ``policy.zero_dims_at``
        data-parallel ranks when set: a multiple of this plan's)."""
        shape = self.g.shape(tid)
        owners = 1
        for a in axes:
            owners *= self.size[a]
        if self.policy.zero_dims_at:
            if self.policy.zero_dims_at % self.par.dp:
                raise ConfigError(f"ZeRO dims of dp {self.policy.zero_dims_at} in a plan of "
                                  f"dp {self.par.dp}")
            owners *= self.policy.zero_dims_at // self.par.dp
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
    return Sharder(g, cfg, par, policy).run()
