"""Pass 2 of the parallelizer: the emitter per rank and microbatch.

:class:`Emitter` instantiates the sharded program (gen_model/program.py) on
every rank for every microbatch, in the order of the pipeline schedule
(GPipe, 1F1B, interleaved), adds gradient accumulation, the cross-replica
reducer and the optimizer step, and merges the per-rank sequences into one
execution order (gen_model/order.py). docs/parallelism.md gives the rank
layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from tqdm import tqdm

from gen_model.config import ConfigError, Parallelism
from gen_model.graph import LogicalGraph
from gen_model.order import merge, number_versions
from gen_model.program import (
    AXES,
    BATCH_AXES,
    PART_ORDER,
    SLICE_ORDER,
    Policy,
    Program,
    SOp,
    SVal,
    axis_sizes,
    contiguous,
)
from gen_model.sharding import is_split
from verdict.ops import get_op
from verdict.ops.step import OPTIMIZERS
from verdict.plan import INPUT_KINDS, Node, Plan, Tensor
from verdict.structure import fw_shapes


@dataclass(frozen=True)
class Coord:
    """Where a piece lives: pipeline stage and index on each mesh axis. ``cp``
    is the sequence chunk, which names the cp rank except with causal load
    balancing, where 2 cp chunks live on cp ranks (``Emitter.cp_rank``)."""

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


class Emitter:
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
