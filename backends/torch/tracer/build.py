"""Build the single-device plan and the parallel plan from lowered traces.

This is the only module of the backend that constructs plans (through
``verdict.plan``'s in-memory API).

Every parallel value is aligned with the single-device value it computes:
inputs by name, a computing node with the single-device node of the same
operator reading the aligned inputs, a collective's output with its input.
Its claim (which slice, which parts of a partial sum) is inferred: each dim
carries the mesh axes that cut it, taken from parameter placements and the
data-parallel batch split, carried through each operator's dims relations
(``Op.relations``), moved by collectives, and summed away by contractions
(a contracted dim cut by an axis makes the result partial over that axis).
An inference is never trusted: every claim of a computed tensor is proved
by the verifier, so a wrong one is a FAIL, not an assumption.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from fractions import Fraction

import numpy as np

from backends.torch.errors import WrongStep
from backends.torch.lowering import LNode, Lowered, LoweringError, padded_rows
from verdict.numeric import NumericXP, run_node
from verdict.ops import get_op
from verdict.plan import Logical, Node, Plan, Tensor

#: HSDP: "dp" as its two sub-axes, replicas outer, shards inner (data-parallel
#: rank d is replica d // s, shard d % s), so a cut or a partial sum over
#: both, in this order, is one over "dp" (docs/soundness.md, "HSDP")
DP_SUBAXES = ("dpr", "dps")
P2P = ("send", "send_recv")
SIZE_KWARGS = ("shape", "sizes", "index", "parts", "value")
SCALINGS = ("div", "mul_scalar")


class AlignError(LoweringError):
    """A parallel op with no single-device counterpart."""


@dataclass
class Claim:
    """Which piece of its single-device value a value is: the mesh axes
    cutting each dim (``mb``: a pipeline's microbatches), the axes it is a
    partial sum over, and, when partial over ``mb``, the microbatches
    [lo, hi) it sums (None: its own microbatch), and the exact factor it
    is of that piece (docs/soundness.md, "Scaled claims"). A dim whose
    size the axes do not divide is cut as ``torch.chunk`` cuts it (FSDP2's
    and DTensor's padded shards: ``lower.padded_rows``). ``at``: the
    coordinates the axes are read at when they are not the holder's (a
    piece received from another rank)."""
    dims: list[list[str]]
    partial: frozenset[str] = frozenset()
    mbs: tuple[int, int] | None = None
    scale: Fraction = Fraction(1)
    at: dict[str, int] | None = None
    #: partial over the ring's steps ("step"): the parts [lo, hi) of n it sums,
    #: n the key (or query) blocks that contribute to it (docs/soundness.md,
    #: "Plans traced from PyTorch", 4X-ring31 (f))
    steps: tuple[int, int, int] | None = None
    #: a value of no single-device tensor (a ring block's softmax over part of
    #: its keys, a running merge): its number k > 0, whole along its own
    #: shape, part 0 of a partial maximum of size -(k + 1) that no other
    #: tensor uses, so never grouped (4X-ring31 (e)); 0 for any other value
    loose: int = 0


#: The mesh axes a constant's dim may be cut by, in the order they are
#: tried: the batch dim (0) data-parallel first, any other dim model- or
#: context-parallel first (a sequence of positions cut by "cp")
CONST_CUTS = ((("dp",), ("tp",), ("cp",), ("dp", "tp"), ("dp", "cp")),
              (("tp",), ("cp",), ("dp",), ("dp", "tp"), ("cp", "tp")))

#: The mesh axes a module buffer a recipe cut may be cut by, in the order
#: they are tried (``_Rank.buffer_piece``)
BUFFER_CUTS = (("cp",), ("tp",), ("cp", "tp"))

#: Operators a ring runs per key block: aligned with the single-device one
#: reading the same tensors whatever their mask kwargs
BLOCK_OPS = ("attention", "attention_grad")

#: Operators whose output is the sum of their inputs (a scaled input must
#: have the scale of the others, up to a replicated value split n ways).
ADDITIONS = ("add", "sub", "local_grad_accumulation")
#: Averaging collectives divide by their group's size.
AVERAGES = ("all_reduce_avg", "reduce_scatter_avg")


def _factor(value) -> Fraction:
    """A scalar kwarg as the exact rational Z3 reads it (its decimal repr)."""
    return Fraction(repr(float(value)))


def probe_scale(node: LNode, shapes: dict[int, tuple[int, ...]],
                scales: list[Fraction]) -> list[Fraction]:
    """The factor of each output of ``node`` when its inputs are scaled by
    ``scales``: run it on positive random inputs, then on the inputs times
    their factors, and read one common ratio per output (1 when there is
    none: the output is not a multiple of the unscaled one, and its claim,
    which the verifier proves, then says so). A guess: the claim is proved."""
    rng = np.random.default_rng(0)
    args = [None if v < 0 else rng.uniform(0.5, 1.5, shapes[v]) for v in node.ins]
    out_shapes = [None if o < 0 else shapes[o] for o in node.outs]
    fake = Node(0, 0, node.op, node.dir, tuple(node.ins), tuple(node.outs), dict(node.kwargs))
    try:
        with np.errstate(all="ignore"):
            base = run_node(NumericXP(), fake, args, out_shapes)
            scaled = run_node(NumericXP(), fake, [None if a is None else a * float(f)
                                                  for a, f in zip(args, scales)], out_shapes)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError):
        return [Fraction(1)] * len(node.outs)
    out = []
    for a, b in zip(base, scaled):
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        keep = np.isfinite(a) & np.isfinite(b) & (np.abs(a) > 1e-12)
        if not keep.any():
            out.append(Fraction(1))
            continue
        ratio = b[keep] / a[keep]
        guess = Fraction(float(np.median(ratio))).limit_denominator(10**6)
        exact = np.allclose(ratio, float(guess), rtol=1e-9, atol=0) and np.allclose(
            b[~keep & np.isfinite(a)], 0, atol=1e-12)
        out.append(guess if exact and guess != 0 else Fraction(1))
    return out


def maps_zero_to_zero(node: LNode, shapes: dict[int, tuple[int, ...]]) -> bool:
    """``node`` run on zeros gives exact zeros (its meaning, evaluated
    once: a guess for a factor's claim, which the verifier proves)."""
    args = [None if v < 0 else np.zeros(shapes[v]) for v in node.ins]
    out_shapes = [None if o < 0 else shapes[o] for o in node.outs]
    fake = Node(0, 0, node.op, node.dir, tuple(node.ins), tuple(node.outs), dict(node.kwargs))
    try:
        with np.errstate(all="ignore"):
            outs = run_node(NumericXP(), fake, args, out_shapes)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError):
        return False
    return all(o is None or not np.any(np.asarray(o, dtype=float)) for o in outs)


@dataclass
class _Single:
    low: Lowered
    tid: dict[int, int] = field(default_factory=dict)  # S value -> logical id
    by_key: dict[tuple, list[int]] = field(default_factory=dict)  # node key -> S node indices
    lver: dict[int, int] = field(default_factory=dict)  # S value -> its logical version (updates)


def _key_kwargs(kw: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in kw.items() if k not in SIZE_KWARGS))


def _kind(node: LNode) -> str:
    return "grad" if node.dir == "bw" or node.name.startswith("bw:") else "act"


def _scope(name: str) -> str:
    return name.removeprefix("bw:").removeprefix("Llama.") or "step"


class _Builder:
    def __init__(self, single: Lowered, world: dict):
        self.s = _Single(single)
        self.world = world
        self.logical: list[Logical] = []
        self.plan_s = Plan(world={**world, "dp": 1, "tp": 1, "pp": 1, "cp": 1, "nm": 1})
        self.gradbuf: dict[str, int] = {}
        self.own_inputs: dict[str, int] = {}  # a constant no single-device one matches -> tid
        self.loose = 0  # loose values numbered so far (``loose_number``)
        #: each single-device value -> the node that makes it
        self.s_made = {o: node for node in single.nodes for o in node.outs if o >= 0}

    def loose_number(self) -> int:
        """A fresh number for a loose value's part (4X-ring31 (e))."""
        self.loose += 1
        return self.loose

    # -- single-device plan ---------------------------------------------------
    def logical_of(self, name: str, shape, kind: str) -> int:
        self.logical.append(Logical(name, tuple(shape), kind))
        return len(self.logical) - 1

    def own_input(self, name: str, shape: tuple[int, ...], kind: str) -> int:
        """A logical input that only ranks read (one per constant's name,
        which is its value's digest: ranks holding the same value read the
        same input): written into the single-device plan as an input no node
        reads."""
        if name in self.own_inputs:
            return self.own_inputs[name]
        tid = self.own_inputs[name] = self.logical_of(name, shape, kind)
        mb = -1 if kind in ("param", "buffer") else 0
        self.plan_s.tensors.append(Tensor(0, mb, tid, 0, tuple(shape), 0,
                                          tuple((0, n) for n in shape), (0, 1, 1)))
        return tid

    def build_single(self) -> Plan:
        s, plan = self.s.low, self.plan_s
        t_of: dict[int, int] = {}

        def tensor(v: int, mb: int, version: int = 0, tid: int | None = None) -> int:
            tid = self.s.tid[v] if tid is None else tid
            shape = self.logical[tid].shape
            plan.tensors.append(Tensor(0, mb, tid, version, tuple(shape), version,
                                       tuple((0, n) for n in shape), (0, 1, 1)))
            return len(plan.tensors) - 1

        for v, (kind, name) in s.inputs.items():
            self.s.tid[v] = self.logical_of(name, s.shapes[v], kind)
            t_of[v] = tensor(v, -1 if kind in ("param", "buffer") else 0)
        param_of = {name: v for v, (kind, name) in s.inputs.items() if kind == "param"}
        updated = {v: param_of[name] for name, v in s.updates.items()}
        state_names = {v: f"{name}.{k}" for name, st in s.states.items() for k, v in st.items()}
        for i, node in enumerate(s.nodes):
            for o in node.outs:
                if o in updated:  # the parameter's next version (the optimizer step)
                    self.s.tid[o] = self.s.tid[updated[o]]
                    self.s.lver[o] = 1
                    t_of[o] = tensor(o, 0, 1)
                elif o >= 0:
                    kind = "loss" if o in s.losses else _kind(node)
                    name = state_names.get(o, f"{_scope(node.name)}.{node.op}.{o}")
                    self.s.tid[o] = self.logical_of(name, s.shapes[o], kind)
                    t_of[o] = tensor(o, 0)
            ins = tuple(-1 if v < 0 else t_of[v] for v in node.ins)
            outs = tuple(-1 if v < 0 else t_of[v] for v in node.outs)
            plan.nodes.append(Node(0, 0, node.op, node.dir, ins, outs, dict(node.kwargs),
                                   _scope(node.name)))
            key = (node.op, node.dir, tuple(-1 if v < 0 else v for v in node.ins),
                   _key_kwargs(node.kwargs))
            self.s.by_key.setdefault(key, []).append(i)
        self.sum_trees(s)
        params = {name: v for v, (kind, name) in s.inputs.items() if kind == "param"}
        for name, v in params.items():
            g = s.grads.get(name)
            if g is None:
                continue
            buf = self.logical_of(f"{name}.grad_buffer", s.shapes[v], "gradbuf")
            self.gradbuf[name] = buf
            zero = tensor(v, -1, 0, buf)
            plan.nodes.append(Node(0, -1, "zeros", "none", (), (zero,),
                                   {"shape": list(s.shapes[v])}, f"{name}.grad_buffer"))
            final = tensor(v, 0, 1, buf)
            plan.nodes.append(Node(0, 0, "local_grad_accumulation", "none", (zero, t_of[g]),
                                   (final,), {}, f"{name}.grad_buffer"))
            plan.grads[self.s.tid[v]] = buf
        plan.logical = self.logical
        plan.loss = self.s.tid[s.losses[0]]
        return plan


    def sum_trees(self, s: Lowered) -> None:
        """Trees of additions (autograd summing gradient contributions), by the
        multiset of their leaves, so that a rank summing the same terms in
        another order is matched (addition is associative in exact arithmetic)."""
        uses: dict[int, int] = {}
        for node in s.nodes:
            for v in node.ins:
                uses[v] = uses.get(v, 0) + 1
        self.s_add: dict[int, LNode] = {}
        leaves: dict[int, list[int]] = {}
        for node in s.nodes:
            if node.op != "add":
                continue
            self.s_add[node.outs[0]] = node
            atoms = []
            for v in node.ins:
                atoms += leaves[v] if v in leaves and uses.get(v) == 1 else [v]
            leaves[node.outs[0]] = atoms
        self.s_trees = {tuple(sorted(a)): v for v, a in leaves.items()}
        self.s_leaves = leaves
        self.s_uses = uses

    def leaves_of(self, sv: int) -> list[int]:
        """The terms of a single-device value as a sum (itself if it is none)."""
        single = sv in self.s_leaves and self.s_uses.get(sv) == 1
        return list(self.s_leaves[sv]) if single else [sv]

    def superset(self, leaves: list[int], accept=lambda root: True) -> int | None:
        """The smallest single-device sum with all these terms and more (and
        that ``accept`` takes)."""
        want: dict[int, int] = {}
        for x in leaves:
            want[x] = want.get(x, 0) + 1
        found = sorted((len(key), root) for key, root in self.s_trees.items()
                       if len(key) > len(leaves) and accept(root)
                       and all(key.count(x) >= n for x, n in want.items()))
        return found[0][1] if found else None


class _Rank:
    """Alignment and claims of one rank's lowered trace."""

    def __init__(self, b: _Builder, low: Lowered, sizes: dict[str, int]):
        self.b, self.low, self.sizes = b, low, sizes
        #: the atomic axes "dp" stands for (HSDP: its sub-axes)
        self.dp = list(DP_SUBAXES) if "dps" in sizes else ["dp"]
        self.axes = (*self.dp, "cp", "tp")
        #: the order of part numbering of a partial sum (microbatches fastest,
        #: as in docs/parallelism.md "Partial-sum part numbering")
        self.part_axes = (*self.dp, "cp", "tp", "step", "mb")
        low.coords.setdefault("cp", 0)
        if "dps" in sizes:
            d = low.coords["dp"]
            low.coords.update(dpr=d // sizes["dps"], dps=d % sizes["dps"])
        self.sv: dict[int, int] = {}  # P value -> S value
        self.claim: dict[int, Claim] = {}
        self.used: set[tuple[int, int]] = set()  # (microbatch, S node) matched
        self.pending: dict[int, list[int]] = {}  # P value -> P leaves of a deferred sum
        self.mb: dict[int, int] = {}  # P value -> its microbatch (-1: none)
        self.fresh = 10**9
        self.own_tid: dict[int, int] = {}  # a constant of this rank only -> its logical tensor
        #: a constant equal to the slice of several single-device constants ->
        #: all of them (each a true claim), until a reader chooses one
        self.alternatives: dict[int, list[tuple[int, Claim]]] = {}
        self.consumers: dict[int, list[LNode]] = {}
        self.producer: dict[int, LNode] = {o: node for node in low.nodes for o in node.outs}
        self.zero_memo: dict[int, bool] = {}  # value -> exactly zero by its making
        for node in low.nodes:
            for v in node.ins:
                if v >= 0:
                    self.consumers.setdefault(v, []).append(node)
        #: exact zeros only all-reduced (a rank that counts no term of a sum:
        #: lowering/norm_sums), no term of the sum (``sum_across``)
        self.zeros = {node.outs[0] for node in low.nodes
                      if node.op == "zeros" and not node.ins and not low.shapes[node.outs[0]]
                      and node.outs[0] not in low.empty_sums and self.consumers.get(node.outs[0])
                      and all(c.op == "all_reduce" for c in self.consumers[node.outs[0]])}
        by_name = {name: v for v, (_, name) in b.s.low.inputs.items()}
        own: list[tuple[int, str]] = []  # constants no single-device one holds
        for v, (kind, name) in low.inputs.items():
            if name not in by_name and v in low.constants:
                try:
                    self.sv[v], self.claim[v] = self.const_piece(v)
                except LoweringError:
                    own.append((v, name))
                continue
            tied = b.s.low.ties.get(name) if kind == "param" else None
            if name not in by_name and tied is not None:
                raise WrongStep(f"rank {low.rank} holds {name} as a parameter of its own, but "
                                f"the single-device model ties it to {tied} (one tensor): the "
                                f"tie is broken, so {tied}'s gradient misses {name}'s part and "
                                f"the two are updated apart")
            if name not in by_name:
                what = "a constant" if name.startswith("const.") else f"the input {name}"
                raise AlignError(f"rank {low.rank} reads {what} of shape {list(low.shapes[v])} "
                                 f"that the single-device step never reads")
            self.sv[v] = by_name[name]
            self.claim[v] = Claim([[a for a in self.atomic(axes) if sizes[a] > 1]
                                   for axes in low.axes[v]])
            if kind == "buffer" and tuple(low.shapes[v]) != self.gshape(v):
                self.claim[v] = self.buffer_piece(v)
            self.check_input(v, name)
            self.whole_where_held(v)
        self.taken = {self.sv[u] for u in self.sv}
        for v, name in own:
            self.sv[v], self.claim[v] = self.own_constant(v, name)

    def own_constant(self, v: int, name: str) -> tuple[int, Claim]:
        """A constant of this rank that is no piece of any single-device
        constant (another pad id on one rank): a plan input of its own, a
        fresh logical tensor no single-device node reads, so nothing ties
        its value to the single-device step's (docs/soundness.md, "Plans
        traced from PyTorch", 23). Its readers are aligned with the
        single-device nodes that read, at the same position, the constant of
        its shape they match; the verifier then judges them for every value
        of both, the real ones included."""
        mine = self.low.constants[v]
        shape = tuple(self.low.shapes[v])
        tied: list[int] = []
        readers = [(node.op, node.dir, node.ins.index(v), _key_kwargs(node.kwargs))
                   for node in self.consumers.get(v, [])]
        best, hits = None, 0
        for sv, full in self.b.s.low.constants.items():
            # of the same shape, or one this rank's would be a piece of
            # (another routing of its rows: docs/soundness.md, "Plans traced
            # from PyTorch", 36)
            if full.ndim != mine.ndim or any(f % m for f, m in zip(full.shape, mine.shape)) \
                    or sv not in self.b.s.low.inputs:
                continue
            n = sum(any(op == k[0] and d == k[1] and len(k[2]) > i and k[2][i] == sv and kw == k[3]
                        for k in self.b.s.by_key) for op, d, i, kw in readers)
            if n and n == hits:
                tied.append(sv)
            if n > hits:
                best, hits, tied = sv, n, [sv]
        if best is None:
            raise LoweringError(f"rank {self.low.rank}: a constant of shape {list(shape)} is no "
                                f"piece of a single-device constant, and no single-device node "
                                f"reads one of its shape where this rank reads it")
        if len(tied) > 1:
            # one per layer: those read by the single-device nodes of this
            # constant's readers' modules
            names = {node.name for node in self.consumers.get(v, [])}
            nodes = self.b.s.low.nodes
            same = {sv: sum(nodes[c].name in names for k, cs in self.b.s.by_key.items()
                            if sv in k[2] for c in cs) for sv in tied}
            top = max(same.values())
            if top:
                tied = [sv for sv in tied if same[sv] == top]
                best = tied[0]
        left = [sv for sv in tied if sv not in self.taken]
        if len(tied) > 1 and left:
            # several read alike (one per expert): the first that no
            # constant of this rank matched by value (both loops run in one
            # order); the claim is its own input's either way
            best = left[0]
            self.taken.add(best)
        full = tuple(self.b.s.low.shapes[best])
        dims: list[list[str]] = [[] for _ in shape]
        if full != shape:
            # the piece at this rank's coordinates of an input of the
            # single-device constant's shape, which no single-device node
            # reads (another routing of its rows)
            dims = [self.guess(m, f, order=self.orders(CONST_CUTS[min(k, 1)]))
                    for k, (m, f) in enumerate(zip(shape, full))]
        self.own_tid[v] = self.b.own_input(f"{name}.ranks_only", full, self.low.inputs[v][0])
        return best, Claim(dims)

    def atomic(self, axes) -> list[str]:
        """Axes with "dp" written as the atomic axes it stands for."""
        return [x for a in axes for x in (self.dp if a == "dp" else [a])]

    def orders(self, order: tuple) -> tuple:
        return tuple(tuple(self.atomic(axes)) for axes in order)

    def check_input(self, v: int, name: str) -> None:
        """An input's claim is assumed, not proved: its local shape must be its
        full shape cut by exactly the claimed axes (a library mesh dim read as
        "dp" that spans only part of the data-parallel ranks, as HSDP's
        shard dim, would not be)."""
        full, local = self.gshape(v), self.low.shapes[v]
        for k, axes in enumerate(self.claim[v].dims):
            if self.extent(axes, full[k]) != local[k]:
                raise LoweringError(f"rank {self.low.rank}: input {name} of shape {list(local)} is "
                                    f"not its {list(full)} cut by {axes or 'no axis'} along dim {k}")

    def const_piece(self, v: int) -> tuple[int, Claim]:
        """The single-device constant this rank's constant is a piece of: the
        one whose slice at the rank's coordinates (each smaller dim cut by mesh
        axes of its ratio, the batch dim by "dp" first) holds exactly its
        contents. The claim is then true by those contents; no match stops
        the run."""
        mine = self.low.constants[v]
        found: list[tuple[int, Claim]] = []
        for sv, full in self.b.s.low.constants.items():
            if full.ndim != mine.ndim or any(f % m for f, m in zip(full.shape, mine.shape)):
                continue
            per_dim = [self.cuts(m, f, CONST_CUTS[min(k, 1)])
                       for k, (m, f) in enumerate(zip(mine.shape, full.shape))]
            for dims in itertools.product(*per_dim):
                index = []
                for axes, m in zip(dims, mine.shape):
                    i = 0
                    for a in axes:
                        i = i * self.sizes[a] + self.low.coords[a]
                    index.append(slice(i * m, (i + 1) * m))
                if np.array_equal(full[tuple(index)], mine):
                    found.append((sv, Claim([list(a) for a in dims])))
                    break
        if found:
            # every match is a true claim; several (two experts' masks equal
            # on this rank's rows) are kept for the first reader to choose
            if len(found) > 1:
                self.alternatives[v] = found
            return found[0]
        raise LoweringError(f"rank {self.low.rank}: a constant of shape {list(mine.shape)} is no "
                            f"piece of a single-device constant")

    def buffer_piece(self, v: int) -> Claim:
        """A module buffer a recipe cut (``context_parallel`` cuts the
        buffers it is given along the sequence): claimed, by its shape, as
        the piece at this rank's coordinates of the first axes of the
        right ratio in ``BUFFER_CUTS`` (a module's state is the same on
        every data-parallel rank: never cut by "dp"). The claim is not
        trusted: ``check.check_loaded`` compares the buffer's values with
        that piece (docs/soundness.md, "Plans traced from PyTorch", 28)."""
        return Claim([self.guess(m, f, order=BUFFER_CUTS)
                      for m, f in zip(self.low.shapes[v], self.gshape(v))])

    def cuts(self, local: int, full: int, order: tuple) -> list[tuple[str, ...]]:
        """Every axes of ``order`` (in its order) cutting ``full`` into
        pieces of ``local`` on this mesh; ``[()]`` when local is full."""
        ratio = full // local if local else 1
        if ratio == 1:
            return [()]
        return [a for a in self.orders(order)
                if math.prod(self.sizes[x] for x in a) == ratio and all(self.sizes[x] > 1 for x in a)]

    def gshape(self, v: int) -> tuple[int, ...]:
        return self.b.s.low.shapes[self.sv[v]]

    def guess(self, local: int, full: int, used: tuple[str, ...] = (),
              order: tuple = (("tp",), ("dp",), ("dp", "tp"))) -> list[str]:
        """Axes cutting a dim by full/local with no tie to say which: the first
        of ``order`` of the right size not already cutting another dim."""
        ratio = full // local if local else 1
        if ratio == 1:
            return []
        order = self.orders(order)
        for axes in [list(a) for a in order if not set(a) & set(used)] + [list(a) for a in order]:
            if math.prod(self.sizes[a] for a in axes) == ratio and all(self.sizes[a] > 1 for a in axes):
                return axes
        raise LoweringError(f"rank {self.low.rank}: a dim of size {local} is not a piece of "
                            f"{full} on this mesh")

    def other_column(self, key: tuple) -> list[int]:
        """The single-device nodes that read another column of the same
        one-hot ids (``ids != pad`` for another pad id): the same slice
        along the same dim from another start. Aligned with them, the rank's
        column is claimed to be theirs, which the verifier refutes unless it
        is (docs/soundness.md, "Plans traced from PyTorch", 23)."""
        op, d, ins, kwargs = key
        rest = tuple(kv for kv in kwargs if kv[0] != "start")
        return [c for k, cs in self.b.s.by_key.items() if k[:3] == (op, d, ins)
                and tuple(kv for kv in k[3] if kv[0] != "start") == rest for c in cs]

    def align(self, node: LNode) -> list[int]:
        """The single-device node this compute node runs, or AlignError."""
        ins = []
        for v in node.ins:
            ins.append(-1 if v < 0 else self.sv[v])
        key = (node.op, node.dir, tuple(ins), _key_kwargs(node.kwargs))
        cands = self.b.s.by_key.get(key)
        if not cands and node.op in BLOCK_OPS:
            # a block of the attention: the kernel as called on it (its own
            # causal flag), over pieces of the single-device tensors
            cands = [c for k, cs in self.b.s.by_key.items() if k[:3] == key[:3] for c in cs]
        if not cands:
            key, cands = self.choose_constants(node, key)
        for v in node.ins:
            self.alternatives.pop(v, None)  # chosen by this reader
        self.applied = Fraction(1)
        self.padded = None
        if not cands and node.op == "narrow" and node.dir == "bw":
            cands = self.padded_piece(node, ins)
        if not cands and node.op == "narrow" and node.dir == "fw" and len(ins) == 1 \
                and self.low.inputs.get(node.ins[0], ("",))[0] == "tokens":
            cands = self.other_column(key)
        if not cands and node.op in SCALINGS and len(node.ins) == 1:
            # a rescaling the single-device step does not do (a divide factor):
            # it claims to be what it rescales, times the factor it applies
            self.applied = _factor(node.kwargs["value"])
            if node.op == "div":
                self.applied = 1 / self.applied
            return [self.sv[node.ins[0]]]
        if not cands and node.op != "add" and len(node.ins) == 1 and node.ins[0] >= 0:
            # a function of a partial sum used as if it were the whole sum (a
            # stage's own gradient norm): matched with that function of the
            # whole, so the verifier judges it
            def key_of(root: int) -> tuple:
                return (node.op, node.dir, (root,), _key_kwargs(node.kwargs))

            whole = self.b.superset(self.b.leaves_of(self.sv[node.ins[0]]),
                                    lambda root: key_of(root) in self.b.s.by_key)
            if whole is not None:
                cands = self.b.s.by_key[key_of(whole)]
        if not cands:
            raise AlignError(f"rank {self.low.rank} runs {node.op} ({node.dir}) at "
                             f"{_scope(node.name)} on values the single-device step never "
                             f"combines that way")
        # several single-device nodes compute the same value (e.g. a buffer
        # expanded in every layer): prefer the one of the same module, not yet
        # matched in this microbatch
        nodes = self.b.s.low.nodes
        pick = min(cands, key=lambda c: (nodes[c].name != node.name, (node.mb, c) in self.used,
                                         nodes[c].kwargs != node.kwargs))
        self.used.add((node.mb, pick))
        if node.op in SCALINGS and nodes[pick].kwargs.get("value") != node.kwargs.get("value"):
            # the single-device step scales by another constant (a mean over
            # the rank's own tokens where the step divides by all of them)
            ratio = _factor(node.kwargs["value"]) / _factor(nodes[pick].kwargs["value"])
            self.applied = 1 / ratio if node.op == "div" else ratio
        return self.b.s.low.nodes[pick].outs

    def choose_constants(self, node: LNode, key: tuple) -> tuple[tuple, list[int] | None]:
        """A reader of constants that match several single-device ones (each
        claim true by the values): the first choice under which the
        single-device step runs this node; the choice then holds for every
        later reader."""
        slots = [(i, v) for i, v in enumerate(node.ins) if v in self.alternatives]
        if not slots:
            return key, None
        choices = [self.alternatives[v] for _, v in slots]
        for pick in itertools.product(*choices):
            ins = list(key[2])
            for (i, _), (sv, _) in zip(slots, pick):
                ins[i] = sv
            trial = (key[0], key[1], tuple(ins), key[3])
            if self.b.s.by_key.get(trial):
                for (_, v), (sv, claim) in zip(slots, pick):
                    self.sv[v], self.claim[v] = sv, claim
                    del self.alternatives[v]
                return trial, self.b.s.by_key[trial]
        return key, None

    def padded_piece(self, node: LNode, ins: list[int]) -> list[int] | None:
        """The backward of a slice that took this rank's piece of a dim cut by
        mesh axes (zeros outside the piece) is one term of the sum of the
        pieces: matched with the single-device backward of the slice of the
        whole dim, and claimed partial over those axes (``self.padded``)."""
        g = node.ins[-1]
        d = node.kwargs["dim"] % len(self.low.shapes[g])
        axes = self.claim[g].dims[d]
        if not axes:
            return None
        # the claim (this rank's piece, by its coordinates) is proved, not
        # assumed: a rank that took another piece fails
        whole = node.kwargs["length"] * math.prod(self.sizes[a] for a in axes)
        key = (node.op, node.dir, tuple(ins),
               _key_kwargs({**node.kwargs, "start": 0, "length": whole}))
        cands = self.b.s.by_key.get(key)
        if cands:
            self.padded = (d, list(axes))
        return cands

    def sliced_alike(self, node: LNode) -> bool:
        """The single-device step has a backward of a slice this ``narrow``
        backward can be matched with (``padded_piece``, item 13)."""
        ins = [-1 if v < 0 else self.sv[v] for v in node.ins]
        found = self.padded_piece(node, ins)
        self.padded = None
        return bool(found)

    def axis_of(self, group: tuple[int, ...], coords: dict[int, dict[str, int]]) -> list[str]:
        """The mesh axes a collective's group runs along, outer first: one
        axis, or under HSDP both data-parallel sub-axes (the whole of "dp");
        none for a group of one rank (a mesh dim of size 1), where every
        collective is the identity."""
        if len(group) == 1:
            return []
        varying = [a for a in self.axes if len({coords[r][a] for r in group}) > 1]
        if len(varying) != 1 and varying != self.dp:
            raise LoweringError(f"rank {self.low.rank}: a collective over ranks {list(group)} "
                                f"is not along one mesh axis")
        return varying

    def step(self, node: LNode, coords: dict[int, dict[str, int]]) -> list[LNode]:
        """The nodes to emit for this node (additions may be deferred and
        regrouped in the single-device order)."""
        if node.op == "send" or (node.outs and node.outs[0] in self.zeros):
            return []
        ring = self.ring_step(node)
        if ring is not None:
            return self.anchored(ring)
        if node.op == "add":
            ready = [self.root_of(v) for v in node.ins]
            if None not in ready and ready[0] == ready[1]:
                emitted = [n for v in node.ins if v in self.pending for n in self.materialize(v)]
                if self.accumulates(node):
                    self.accumulate(node)
                    return [*emitted, node]
                if emitted:
                    self.one(node, coords)
                    return [*emitted, node]
        if node.op == "add" and (any(v in self.pending for v in node.ins)
                                 or not self.aligns(node)):
            leaves = []
            for v in node.ins:
                leaves += self.pending.pop(v, [v])
            self.pending[node.outs[0]] = leaves
            return []
        emitted: list[LNode] = []
        for v in node.ins:
            if v in self.pending:
                emitted += self.materialize(v)
        node, zeros = self.zeros_at_common_scale(node)
        self.one(node, coords)
        return self.anchored([*emitted, *zeros, node])

    def zeros_at_common_scale(self, node: LNode) -> tuple[LNode, list[LNode]]:
        """``node`` reading, in place of each exact zero whose factor is not
        the one factor of its other inputs, fresh zeros claimed at that
        factor (zeros are every multiple of themselves; a ``cat`` of a block
        of zeros and a gradient scaled by a per-rank mean): the zeros made
        first. Each claim is proved like any other (docs/soundness.md,
        "Plans traced from PyTorch", 40)."""
        ins = [v for v in node.ins if v >= 0]
        zero = {v for v in ins if self.is_zero(v)}
        others = {self.claim[v].scale for v in ins if v not in zero}
        if len(others) != 1:
            return node, []
        scale = others.pop()
        made, swap = [], {}
        for v in zero:
            if self.claim[v].scale == scale:
                continue
            target = self.fresh
            self.fresh += 1
            c = self.claim[v]
            self.low.shapes[target] = self.low.shapes[v]
            self.sv[target], self.mb[target] = self.sv[v], self.mb.get(v, -1)
            self.claim[target] = Claim([list(d) for d in c.dims], c.partial, c.mbs, scale, c.at)
            zeros = LNode("zeros", "none", [], [target],
                          {"shape": list(self.low.shapes[v])}, node.name)
            self.producer[target], self.zero_memo[target] = zeros, True
            made.append(zeros)
            swap[v] = target
        if not swap:
            return node, []
        return replace(node, ins=[swap.get(v, v) for v in node.ins]), made

    def root_of(self, v: int) -> int | None:
        """The single-device value of v, also for a deferred sum whose terms
        make a single-device sum (None if they do not)."""
        if v not in self.pending:
            return self.sv[v]
        s_leaves = []
        for p in self.pending[v]:
            sv = self.sv[p]
            single = sv in self.b.s_leaves and self.b.s_uses.get(sv) == 1
            s_leaves += self.b.s_leaves[sv] if single else [sv]
        return self.b.s_trees.get(tuple(sorted(s_leaves)))

    def accumulates(self, node: LNode) -> bool:
        """An addition of two pieces of one single-device value that sum
        adjacent microbatches (autograd accumulating a parameter's gradient
        over a pipeline's microbatches)."""
        a, c = node.ins
        if a in self.pending or c in self.pending or self.sv[a] != self.sv[c]:
            return False
        ra, rc = self.mb_range(a), self.mb_range(c)
        ca, cc = self.claim[a], self.claim[c]
        return (ra is not None and rc is not None and (ra[1] == rc[0] or rc[1] == ra[0])
                and ca.dims == cc.dims and ca.partial == cc.partial)

    def mb_range(self, v: int) -> tuple[int, int] | None:
        c = self.claim[v]
        if "mb" not in c.partial:
            return None
        return c.mbs or (self.mb[v], self.mb[v] + 1)

    def accumulate(self, node: LNode) -> None:
        a, c = node.ins
        out = node.outs[0]
        (la, ha), (lc, hc) = self.mb_range(a), self.mb_range(c)
        lo, hi = min(la, lc), max(ha, hc)
        claim = self.claim[a]
        partial = set(claim.partial)
        mbs: tuple[int, int] | None = (lo, hi)
        if (lo, hi) == (0, self.sizes["mb"]):
            partial.discard("mb")
            mbs = None
        self.sv[out] = self.sv[a]
        self.mb[out] = self.mb[c]
        self.claim[out] = Claim([list(d) for d in claim.dims], frozenset(partial), mbs,
                                claim.scale)

    def receive(self, node: LNode, peer: _Rank, x: int) -> None:
        """A value received from ``peer``: the value it sent, the same piece
        (its axes read at the coordinates the peer reads them at, where they
        differ from this rank's; a dim the peer holds whole is whole)."""
        out = node.outs[0]
        self.sv[out] = peer.sv[x]
        self.mb[out] = peer.mb.get(x, -1)
        c = peer.claim[x]
        full = peer.gshape(x)
        dims = [[] if peer.extent(d, n) == n else list(d) for d, n in zip(c.dims, full)]
        # read at the peer's coordinates, or at those its own claim names (a
        # piece it received and passes on: a ring's keys)
        held = {**peer.low.coords, **(c.at or {})}
        at = {a: held[a] for d in dims for a in d
              if a != "mb" and held[a] != self.low.coords[a]}
        self.claim[out] = Claim(dims, c.partial, c.mbs, c.scale, at or None, c.steps)

    def aligns(self, node: LNode) -> bool:
        key = (node.op, node.dir, tuple(-1 if v < 0 else self.sv[v] for v in node.ins),
               _key_kwargs(node.kwargs))
        return bool(self.b.s.by_key.get(key))

    def materialize(self, v: int) -> list[LNode]:
        leaves = self.pending.pop(v)
        by_s: dict[int, list[int]] = {}
        for p in leaves:
            by_s.setdefault(self.sv[p], []).append(p)
        s_leaves = []
        for p in leaves:
            sv = self.sv[p]
            single = sv in self.b.s_leaves and self.b.s_uses.get(sv) == 1
            s_leaves += self.b.s_leaves[sv] if single else [sv]
        root = self.b.s_trees.get(tuple(sorted(s_leaves)))
        if root is None:
            return self.partial_tree(v, leaves, s_leaves)
        out: list[LNode] = []

        def emit(sv: int, target: int | None) -> int:
            if by_s.get(sv):
                return by_s[sv].pop()
            node = self.b.s_add[sv]
            a = emit(node.ins[0], None)
            c = emit(node.ins[1], None)
            if target is None:
                target = self.fresh
                self.fresh += 1
                self.low.shapes[target] = self.low.shapes[a]
            new = LNode("add", node.dir, [a, c], [target], {}, node.name)
            self.one(new, {})
            out.append(new)
            return target

        emit(root, v)
        return out

    def partial_tree(self, v: int, leaves: list[int], s_leaves: list[int]) -> list[LNode]:
        """A sum of some of the terms of a single-device sum (a pipeline
        stage's share of a gradient norm, used as if it were the whole):
        each of its additions is claimed to be the whole sum, which the
        verifier refutes at the first of them. AlignError if no
        single-device sum has all these terms."""
        root = self.b.superset(s_leaves)
        if root is None:
            raise AlignError(f"rank {self.low.rank} sums gradient terms the single-device step "
                             f"never sums together")
        out: list[LNode] = []
        acc = leaves[0]
        for k, p in enumerate(leaves[1:]):
            target = v if k == len(leaves) - 2 else self.fresh
            if target != v:
                self.fresh += 1
                self.low.shapes[target] = self.low.shapes[acc]
            new = LNode("add", "fw", [acc, p], [target], {}, self.b.s_add[root].name)
            partial = self.claim[acc].partial | self.claim[p].partial
            self.sv[target] = root
            self.mb[target] = max(self.mb.get(acc, -1), self.mb.get(p, -1))
            self.claim[target] = Claim([[] for _ in self.gshape(target)], partial)
            self.check(target)
            out.append(new)
            acc = target
        return out

    def units(self, x: int) -> list[int]:
        """The values a sum is made of on this rank: its deferred terms, or x."""
        return list(self.pending[x]) if x in self.pending else [x]

    def terms(self, x: int) -> list[int]:
        """The terms of a scalar sum on this rank: its deferred terms, and the
        terms of each scalar addition it was computed by (x = a + b has the
        terms of a and of b), in order; x itself when it is no sum."""
        out: list[int] = []
        todo = [x]
        while todo:
            v = todo.pop()
            node = self.producer.get(v)
            if v in self.pending:
                todo.extend(reversed(self.pending[v]))
            elif node is not None and node.op == "add" and not self.low.shapes[v] \
                    and all(not self.low.shapes[a] for a in node.ins):
                todo.extend(reversed(node.ins))
            else:
                out.append(v)
        return out

    def computed_split(self, node: LNode, cut: bool = False) -> list[int] | None:
        """The single-device split this split computes (the same piece of the
        aligned input), or None: then it is a cut by a mesh axis. With
        ``cut``, also of a dim that mesh axes cut already (the model's own
        split of a sharded value, e.g. a fused projection's chunk)."""
        if node.op != "split" or node.ins[0] not in self.sv:
            return None
        key = (node.op, node.dir, (self.sv[node.ins[0]],), _key_kwargs(node.kwargs))
        nodes = self.b.s.low.nodes
        for c in self.b.s.by_key.get(key, []):
            if nodes[c].kwargs == node.kwargs and (
                    cut or not self.claim[node.ins[0]].dims[node.kwargs["dim"]]):
                return nodes[c].outs
        return None

    def split_as_single(self, node: LNode, souts: list[int]) -> None:
        """Claim a split's piece as the single-device split's piece it stands
        for (the claim is proved: a split that does not follow the shards
        fails at this node)."""
        self.sv[node.outs[0]] = souts[0]
        self.mb[node.outs[0]] = node.mb if node.mb >= 0 else self.mb.get(node.ins[0], -1)
        self.infer(node)
        self.applied = Fraction(1)
        self.claim[node.outs[0]].scale = self.scales_of(node)[0]

    def one(self, node: LNode, coords: dict[int, dict[str, int]]) -> None:
        souts = self.computed_split(node)
        if souts is not None:
            self.split_as_single(node, souts)
            return
        if node.group is not None or node.op == "split":
            x = node.ins[0]
            out = node.outs[0]
            self.sv[out] = self.sv[x]
            self.mb[out] = node.mb if node.mb >= 0 else self.mb.get(x, -1)
            c = self.claim[x]
            dims = [list(d) for d in c.dims]
            partial = set(c.partial)
            if node.op == "split" and self.low.inputs.get(x, ("",))[0] == "tokens" \
                    and node.kwargs["dim"] == 0:
                # a pipeline schedule's microbatch of the batch
                if node.kwargs["parts"] != self.sizes["mb"]:
                    raise LoweringError(f"rank {self.low.rank} cuts the batch in "
                                        f"{node.kwargs['parts']}, not in its "
                                        f"{self.sizes['mb']} microbatches")
                dims[0].append("mb")
                self.mb[out] = node.kwargs["index"]
            elif node.op == "split":
                try:
                    dims[node.kwargs["dim"]] += self.guess(1, node.kwargs["parts"])
                except LoweringError:
                    souts = self.computed_split(node, cut=True)
                    if souts is None:
                        raise
                    self.split_as_single(node, souts)
                    return
            else:
                axes = self.axis_of(node.group, coords)
                if node.op in ("all_reduce", "all_reduce_avg"):
                    partial -= set(axes)
                elif node.op == "all_gather":
                    d = dims[node.kwargs["dim"]]
                    for axis in axes:
                        if axis in d:
                            d.remove(axis)
                elif node.op in ("reduce_scatter", "reduce_scatter_avg"):
                    partial -= set(axes)
                    dims[node.kwargs["dim"]].extend(axes)
            scale = c.scale / len(node.group) if node.op in AVERAGES else c.scale
            self.claim[out] = Claim(dims, frozenset(partial), c.mbs, scale,
                                    steps=c.steps if "step" in partial else None)
            self.check(out, uneven=True)
            return
        if node.op == "cat" and not self.aligns(node) and self.joins(node):
            return
        if node.op == "zeros" and node.outs[0] in self.low.empty_sums:
            self.empty_sum(node, coords)
            return
        if node.outs[0] in self.low.row_cuts:
            self.cut_rows(node, coords)
            return
        if node.op == "narrow" and node.dir == "fw" and not self.aligns(node) \
                and self.takes_piece(node):
            return
        if node.op == "narrow" and node.dir == "bw" and not self.aligns(node) \
                and not self.sliced_alike(node) and self.pads_piece(node):
            return
        if node.op == "zeros" and not node.ins and not self.aligns(node) \
                and all(c.op == "add" for c in self.consumers.get(node.outs[0], [None])):
            self.make_loose(node)  # a ring's accumulator or skipped block (ring_step)
            return
        souts = self.align(node)
        mb = node.mb if node.mb >= 0 else max((self.mb.get(v, -1) for v in node.ins), default=-1)
        for o, so in zip(node.outs, souts):
            if o >= 0:
                self.sv[o] = so
                self.mb[o] = mb
        if node.op == "attention" and not self.whole_rows(node.ins[1]):
            self.make_loose(node, souts)  # a block over some of the keys: a piece of nothing
            return
        if node.op == "attention_grad":
            self.infer_attention_grad(node)
        else:
            self.infer(node)
        if self.padded is not None:
            d, axes = self.padded
            c = self.claim[node.outs[0]]
            c.dims[d] = []
            self.claim[node.outs[0]] = Claim(c.dims, c.partial | frozenset(axes), c.mbs, c.scale)
            self.check(node.outs[0])
        for o, f in zip(node.outs, self.scales_of(node)):
            if o >= 0:
                self.claim[o].scale = f * self.applied

    # -- ring attention (docs/soundness.md, "Plans traced from PyTorch", 4X-ring31) --
    def is_loose(self, v: int) -> bool:
        return v >= 0 and v in self.claim and self.claim[v].loose

    def make_loose(self, node: LNode, bases: list[int] | None = None) -> None:
        """Every output of ``node`` a loose value (4X-ring31 (e)): claimed as
        the leading corner of a single-device tensor its shape fits in (its
        base: ``bases``, else a loose input's or its producer's other
        output, else the first that fits),
        with a part that no cover holds. Which tensor it names is no
        statement: the part is never grouped."""
        mb = node.mb if node.mb >= 0 else max((self.mb.get(v, -1) for v in node.ins), default=-1)
        # the loose inputs' single-device tensors and their producers' other
        # outputs (a block's lse unsqueezed fits in the attention's out): its
        # stage is the one that reads the loose inputs' producers
        near = []
        for v in node.ins:
            if self.is_loose(v):
                made = self.b.s_made.get(self.sv[v])
                near += [self.sv[v], *(o for o in (made.outs if made else ()) if o >= 0)]
        for i, o in enumerate(node.outs):
            if o < 0:
                continue
            shape = tuple(self.low.shapes[o])
            tries = ([bases[i]] if bases else []) + near
            base = next((t for t in tries if self.fits_in(shape, t)), None)
            if base is None:
                base = next((t for t in self.b.s.low.shapes if self.fits_in(shape, t)), None)
            if base is None:
                raise AlignError(f"rank {self.low.rank} runs {node.op} at {_scope(node.name)} "
                                 f"on values of no single-device tensor, into a shape "
                                 f"{list(shape)} no single-device value holds")
            self.sv[o], self.mb[o] = base, mb
            self.claim[o] = Claim([[] for _ in shape], loose=self.b.loose_number())

    def fits_in(self, shape: tuple[int, ...], sv: int) -> bool:
        """A value of ``shape`` fits in the leading corner of single-device
        value sv (which the single-device plan writes)."""
        full = self.b.s.low.shapes.get(sv)
        return (sv in self.b.s.tid and full is not None and len(full) == len(shape)
                and all(a <= b for a, b in zip(shape, full)))

    def whole_rows(self, v: int) -> bool:
        """Value v holds every row (dim -2: the keys or queries) of its
        single-device tensor."""
        rows = self.view(v)[0][-2]
        return rows == (0, self.gshape(v)[-2])

    def ring_step(self, node: LNode) -> list[LNode] | None:
        """The nodes to emit for a node a ring runs outside the single-device
        step's operators: a reader of a loose value that the single-device
        step does not run (the merge's arithmetic: loose too), or an
        addition accumulating a ring's parts (``accumulates_steps``); None
        for any other node."""
        if node.group is not None:
            return None
        if any(self.is_loose(v) and not self.is_zero(v) for v in node.ins):
            emitted: list[LNode] = []
            for v in node.ins:
                if v in self.pending:
                    emitted += self.materialize(v)
            self.make_loose(node)
            return [*emitted, node]
        if node.op == "add" and len(node.ins) == 2 \
                and not any(v in self.pending for v in node.ins) and self.accumulates_steps(node):
            return [node]
        return None

    def accumulates_steps(self, node: LNode) -> bool:
        """An addition of a ring's parts (4X-ring31 (f)): exact zeros plus a
        value (the accumulator's start: the value's claim); a value summing
        steps [lo, hi) plus exact zeros (a skipped block: step hi); two
        pieces of one single-device value with the same dims, summing
        adjacent steps (their union, whole once it holds every step)."""
        a, b = node.ins
        out = node.outs[0]
        za, zb = self.is_zero(a), self.is_zero(b)
        ca, cb = self.claim.get(a), self.claim.get(b)
        if za and not zb and cb is not None and not cb.loose and cb.steps is not None:
            self.sv[out], self.mb[out] = self.sv[b], self.mb.get(b, -1)
            self.claim[out] = replace(cb, dims=[list(d) for d in cb.dims])
            return True
        if ca is None or cb is None or ca.loose or ca.steps is None:
            return False
        lo, hi, n = ca.steps
        if zb and not za:
            if hi >= n:
                return False
            hi += 1
        elif not cb.loose and cb.steps is not None and self.sv[a] == self.sv[b] \
                and ca.dims == cb.dims and ca.at == cb.at and ca.partial == cb.partial \
                and ca.scale == cb.scale and cb.steps[2] == n and hi == cb.steps[0]:
            hi = cb.steps[1]
        else:
            return False
        partial = set(ca.partial)
        if (lo, hi) == (0, n):
            partial.discard("step")
        self.sv[out], self.mb[out] = self.sv[a], self.mb.get(a, -1)
        self.claim[out] = Claim([list(d) for d in ca.dims], frozenset(partial), ca.mbs, ca.scale,
                                ca.at, None if (lo, hi) == (0, n) else (lo, hi, n))
        return True

    def anchored(self, nodes: list[LNode]) -> list[LNode]:
        """``nodes``, with the ring's merged out and lse among their outputs
        claimed as the single-device attention's (4X-ring31 (d))."""
        for node in nodes:
            for o in node.outs:
                if o in self.low.anchors:
                    self.anchor(o)
        return nodes

    def anchor(self, o: int) -> None:
        kind, q, k, v = self.low.anchors[o]
        nodes = self.b.s.low.nodes
        cands = [n for n in nodes if n.op == "attention" and n.dir == "fw"
                 and n.ins[0] == self.sv.get(q)]
        cands.sort(key=lambda n: (n.ins[1] != self.sv.get(k), n.ins[2] != self.sv.get(v)))
        if not cands:
            raise AlignError(f"rank {self.low.rank}: a ring attention's result whose query the "
                             f"single-device step never attends with")
        cq, cv = self.claim[q], self.claim[v]
        dims = [list(d) for d in cq.dims[:-1]]
        if kind == "out":
            dims.append(list(cv.dims[-1]))
        self.sv[o] = cands[0].outs[0 if kind == "out" else 1]
        self.mb[o] = self.mb.get(q, -1)
        self.claim[o] = Claim(dims, frozenset(cq.partial), cq.mbs, cq.scale, cq.at)
        self.check(o)

    def infer_attention_grad(self, node: LNode) -> None:
        """dq has the query's layout, dk and dv the keys' and values'. A block
        of a ring (query rows and key rows both pieces) gives parts of the
        ring step (query chunk - key chunk) mod cp (4X-ring31 (f)); with all
        keys and a piece of the queries, dk and dv are partial over the axes
        cutting the queries' rows (and dq, with all queries and a piece of
        the keys, over the keys')."""
        dout, q, k, v = node.ins[:4]
        partial: set[str] = set()
        mbs = None
        for x in node.ins:
            if x >= 0:
                partial |= self.claim[x].partial
                mbs = mbs or self.claim[x].mbs
        cq, ck = self.claim[q], self.claim[k]
        q_whole, k_whole = self.whole_rows(q), self.whole_rows(k)
        for_q, for_kv = set(partial), set(partial)
        step_q = step_kv = None
        if not q_whole and not k_whole:
            step_q, step_kv = self.block_steps(node)
            for_q |= {"step"} if step_q[2] > 1 else set()
            for_kv |= {"step"} if step_kv[2] > 1 else set()
        elif not q_whole:
            for_kv |= set(cq.dims[-2])
        elif not k_whole:
            for_q |= set(ck.dims[-2])
        mb = node.mb if node.mb >= 0 else max((self.mb.get(x, -1) for x in node.ins), default=-1)
        for o, like, part, steps in zip(node.outs, (q, k, v), (for_q, for_kv, for_kv),
                                        (step_q, step_kv, step_kv)):
            if o < 0:
                continue
            c = self.claim[like]
            self.mb[o] = mb
            self.claim[o] = Claim([list(d) for d in c.dims], frozenset(part),
                                  mbs if "mb" in part else None, c.scale, c.at,
                                  steps if "step" in part else None)
            self.check(o)

    def block_steps(self, node: LNode) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The parts a ring block's dq and dk (dv) are, (label, label + 1, n):
        chunks qc of the queries and kc of the keys, of C equal chunks. With
        the single-device attention causal, the key chunks a query chunk
        sees are kc <= qc: dq is part qc - kc of qc + 1, dk part qc - kc of
        C - kc (the query chunks that see it); else part (qc - kc) mod C of
        C. The label is the ring step the block runs at, so a ring's sums
        cover adjacent ranges (4X-ring31 (f))."""
        q, k = node.ins[1], node.ins[2]
        qr, kr = self.view(q)[0][-2], self.view(k)[0][-2]
        chunk = self.low.shapes[q][-2]
        full = self.gshape(q)[-2]
        if self.low.shapes[k][-2] != chunk or qr[0] % chunk or kr[0] % chunk or full % chunk:
            raise AlignError(f"rank {self.low.rank} runs attention_grad at {_scope(node.name)} "
                             f"on query and key pieces of unequal chunks")
        qc, kc, chunks = qr[0] // chunk, kr[0] // chunk, full // chunk
        single = self.b.s_made[self.sv[node.outs[0]]]
        if not single.kwargs.get("causal"):
            label = (qc - kc) % chunks
            return (label, label + 1, chunks), (label, label + 1, chunks)
        if kc > qc:
            raise AlignError(f"rank {self.low.rank} runs attention_grad at {_scope(node.name)} "
                             f"on a key block wholly after its queries (every score masked)")
        label = qc - kc
        return (label, label + 1, qc + 1), (label, label + 1, chunks - kc)

    def joins(self, node: LNode) -> bool:
        """A ``cat`` of pieces of one value (FSDP2's padded shards gathered
        from their ranks) whose sizes along the dim add up to the whole dim:
        claimed to be the whole along it (the claim is proved; pieces in
        the wrong order or overlapping fail). False when it is not one."""
        d, out = node.kwargs["dim"], node.outs[0]
        if len({self.sv[v] for v in node.ins}) != 1:
            return False
        full = self.gshape(node.ins[0])
        views = [self.view(v) for v in node.ins]
        first = self.claim[node.ins[0]]
        if any(self.claim[v].partial or self.claim[v].scale != first.scale for v in node.ins) \
                or len({tuple(s for k, s in enumerate(sl) if k != d) for sl, _ in views}) != 1 \
                or sum(sl[d][1] - sl[d][0] for sl, _ in views) != full[d]:
            return False
        dims = [[] if k == d else list(axes) for k, axes in enumerate(first.dims)]
        self.sv[out], self.mb[out] = self.sv[node.ins[0]], self.mb.get(node.ins[0], -1)
        self.claim[out] = Claim(dims, frozenset(), None, first.scale)
        want = tuple((0, full[d]) if k == d else s for k, s in enumerate(views[0][0]))
        if self.view(out)[0] != want:
            raise LoweringError(f"rank {self.low.rank}: a cat at {_scope(node.name)} joins "
                                f"pieces cut along other dims than this rank's")
        return True

    def empty_sum(self, node: LNode, coords: dict[int, dict[str, int]]) -> None:
        """The square sum (a zero) of a gradient's empty shard: this rank's
        part of the partial square sum of the gradient over the group that
        cuts it (a sum over no rows; the parts are proved to add up to the
        single-device square sum)."""
        g, group = self.low.empty_sums[node.outs[0]]
        whole = self.sv[g]
        by_key, nodes = self.b.s.by_key, self.b.s.low.nodes
        sums = [nodes[m].outs[0] for m in by_key.get(("mul", "fw", (whole, whole), ()), [])]
        sums = [nodes[c].outs[0] for sq in sums for c in by_key.get(
            ("sum", "fw", (sq,), _key_kwargs({"dim": None, "keepdim": False})), [])]
        if not sums:
            raise AlignError(f"rank {self.low.rank} takes the norm of a gradient shard it holds "
                             f"no rows of, whose square sum the single-device step never takes")
        out = node.outs[0]
        self.sv[out], self.mb[out] = sums[0], -1
        self.claim[out] = Claim([], frozenset(self.axis_of(group, coords)))

    def cut_rows(self, node: LNode, coords: dict[int, dict[str, int]]) -> None:
        """A ``narrow`` of a padded gradient, whole along the dim, to the rows
        this rank holds of it: claimed cut by the axes of the group whose
        reduction cuts it (FSDP2's shard group), whose piece at this rank's
        coordinates these rows must be (the claim is then proved like any)."""
        x, out = node.ins[0], node.outs[0]
        c, d = self.claim[x], node.kwargs["dim"]
        axes = self.axis_of(self.low.row_cuts[out], coords)
        full = self.gshape(x)[d]
        rows = (node.kwargs["start"], node.kwargs["start"] + node.kwargs["length"])
        if c.dims[d] or c.at or not axes or self.piece(axes, full, self.low.coords) != rows:
            raise LoweringError(f"rank {self.low.rank}: rows [{rows[0]}, {rows[1]}) of a "
                                f"gradient at {_scope(node.name)} are not its piece over the "
                                f"ranks {list(self.low.row_cuts[out])}")
        self.sv[out], self.mb[out] = self.sv[x], self.mb.get(x, -1)
        self.claim[out] = Claim([list(axes) if k == d else list(a) for k, a in enumerate(c.dims)],
                                c.partial, c.mbs, c.scale)

    def takes_piece(self, node: LNode) -> bool:
        """A ``narrow`` of a value whole along the dim to this rank's piece of
        it by tensor-parallel (else data-parallel) axes, torch.chunk's for a
        size they do not divide (DTensor's uneven ``Shard``: the gradient of
        a gathered piece): claimed cut by those axes (proved like any
        claim). False when no axes give these rows."""
        x, out = node.ins[0], node.outs[0]
        c, d = self.claim[x], node.kwargs["dim"] % len(self.low.shapes[x])
        if c.dims[d] or c.at:
            return False
        full = self.gshape(x)[d]
        rows = (node.kwargs["start"], node.kwargs["start"] + node.kwargs["length"])
        cuts = [axes for axes in (["tp"], list(self.dp), [*self.dp, "tp"])
                if math.prod(self.sizes[a] for a in axes) > 1]
        # the axes whose piece these rows are; else (rows of a piece's width
        # read at another offset, docs/soundness.md, "Plans traced from
        # PyTorch", 27) the tensor-parallel axis of that width: a claim the
        # verifier refutes
        found = [a for a in cuts if self.piece(a, full, self.low.coords) == rows] or \
            [a for a in cuts[:1] if a == ["tp"] and self.extent(a, full) == rows[1] - rows[0]]
        if not found:
            return False
        self.sv[out], self.mb[out] = self.sv[x], self.mb.get(x, -1)
        self.claim[out] = Claim([list(found[0]) if k == d else list(a)
                                 for k, a in enumerate(c.dims)], c.partial, c.mbs, c.scale)
        return True

    def pads_piece(self, node: LNode) -> bool:
        """The backward of ``takes_piece``'s slice: g, this rank's piece of a
        single-device value along the dim, padded with zeros to the whole
        dim, is this rank's term of the sum of the pieces over the axes that
        cut it: claimed so (proved like any claim; rows padded at another
        offset than the piece's fail). False when g is not such a piece."""
        g, out = node.ins[-1], node.outs[0]
        c, d = self.claim[g], node.kwargs["dim"] % len(self.low.shapes[g])
        full = self.gshape(g)[d]
        if not c.dims[d] or c.at or c.partial or self.low.shapes[out][d] != full:
            return False
        self.sv[out], self.mb[out] = self.sv[g], self.mb.get(g, -1)
        self.claim[out] = Claim([[] if k == d else list(a) for k, a in enumerate(c.dims)],
                                frozenset(c.dims[d]), c.mbs, c.scale)
        return True

    def scales_of(self, node: LNode) -> list[Fraction]:
        """The factor of each output, from its inputs' factors: a sum keeps
        its terms' common factor (a replicated term divided by n counts as a
        part of an n-way partial sum, DTensor's bias on a Partial value);
        any other operator is probed (``probe_scale``)."""
        ins = [v for v in node.ins]
        scales = [Fraction(1) if v < 0 else self.claim[v].scale for v in ins]
        if node.op == "mean" and min(node.ins[0], node.outs[0]) >= 0:
            # a mean over a dim cut by mesh axes divides by the local count:
            # the product of those axes' sizes times its share
            x = node.ins[0] if node.dir != "bw" else node.outs[0]
            nd = len(self.low.shapes[x])
            dims = node.kwargs.get("dim")
            dims = range(nd) if dims is None else [d % nd for d in (
                dims if isinstance(dims, (list, tuple)) else [dims])]
            axes = {a for d in dims for a in self.claim[x].dims[d]}
            cut = math.prod(self.sizes[a] for a in axes)
            return [scales[-1] * cut] * len(node.outs)
        if all(f == 1 for f in scales):
            return [Fraction(1)] * len(node.outs)
        if node.op in ADDITIONS:
            partial = [set() if v < 0 else set(self.claim[v].partial) for v in ins]
            union = set().union(*partial)
            lifted = set()
            for v, f, own in zip(ins, scales, partial):
                if v >= 0:
                    lifted.add(f * math.prod(self.sizes[a] for a in union - own))
            if len(lifted) == 1:
                return [lifted.pop()] * len(node.outs)
            return [Fraction(1)] * len(node.outs)
        return probe_scale(node, self.low.shapes, scales)

    def is_zero(self, v: int) -> bool:
        """Value v is exactly zero by its making in the plan: a ``zeros``
        node, or an operator that gives zeros on zeros (a reshape, a slice,
        a ``cat``: ``maps_zero_to_zero``) of zeros. A loaded constant is not
        zero by making even when its traced value is: the verifier reads it
        as any value, so a claim that fresh zeros are a multiple of it could
        never be proved. Its makers are walked with a stack, not by
        recursion (a long chain of values deferred as sums is never asked
        one by one)."""
        memo, stack, opened = self.zero_memo, [v], set()
        while stack:
            u = stack[-1]
            if u in memo:
                stack.pop()
                continue
            made = self.producer.get(u)
            if made is None:
                memo[u] = False
            elif made.op == "zeros" and not made.ins:
                memo[u] = True
            else:
                ins = [w for w in made.ins if w >= 0]
                todo = [w for w in ins if w not in memo]
                if todo and u not in opened:
                    opened.add(u)
                    stack.extend(todo)
                    continue
                if todo:  # a value read by its own maker: not zero by making
                    memo[u] = False
                    stack.pop()
                    continue
                memo[u] = bool(ins) and all(memo[w] for w in ins) \
                    and maps_zero_to_zero(made, self.low.shapes)
            stack.pop()
        return memo[v]

    def infer(self, node: LNode) -> None:
        ins = [v for v in node.ins]
        shapes_in = [None if v < 0 else self.low.shapes[v] for v in ins]
        outs = [o for o in node.outs]
        partial: set[str] = set()
        mbs = None
        steps = None
        for v in ins:
            if v >= 0:
                partial |= self.claim[v].partial
                mbs = mbs or self.claim[v].mbs
                steps = steps or self.claim[v].steps
        if node.op in ("ones", "zeros"):
            partial = set()
        if node.dir == "bw":
            self.infer_backward(node, partial, mbs)
            for o in outs:
                if o >= 0 and "step" in self.claim[o].partial:
                    self.claim[o].steps = steps
            return
        shapes_out = [self.low.shapes[o] for o in outs]
        rel = get_op(node.op).relations(shapes_in, shapes_out, node.kwargs)
        tied_in: set[tuple[int, int]] = set()
        dims_out = [[None] * len(s) for s in shapes_out]
        source: dict[tuple[int, int], int] = {}  # an output dim -> the full size it came from
        for r in rel:
            if r[0] == "eq":
                a, c = r[1], r[2]
                if a[0] == "i":
                    a, c = c, a
                if a[0] == "o" and c[0] == "i":
                    tied_in.add((c[1], c[2]))
                    axes = self.claim[ins[c[1]]].dims[c[2]]
                    if dims_out[a[1]][a[2]] is None or (axes and not dims_out[a[1]][a[2]]):
                        dims_out[a[1]][a[2]] = list(axes)
                        source[(a[1], a[2])] = self.gshape(ins[c[1]])[c[2]]
            elif r[0] == "mul":
                target, factors = r[1], r[2]
                if target[0] == "o":  # flatten: the output dim is the product
                    axes = []
                    for f in factors:
                        tied_in.add((f[1], f[2]))
                        axes += self.claim[ins[f[1]]].dims[f[2]]
                    dims_out[target[1]][target[2]] = axes
                else:  # unflatten: the input dim is the product of output dims
                    tied_in.add((target[1], target[2]))
                    axes = list(self.claim[ins[target[1]]].dims[target[2]])
                    for f in factors:
                        if f[0] != "o":
                            continue
                        o, d = f[1], f[2]
                        full = self.b.s.low.shapes[self.sv[outs[o]]][d]
                        local = self.low.shapes[outs[o]][d]
                        if axes and local < full:
                            # the outer axes first, as many as cut this dim (a merged
                            # batch and heads dim cut by "mb" and "tp" splits into both)
                            take = 1
                            while take < len(axes) and math.prod(
                                    self.sizes.get(a, 1) for a in axes[:take]) * local < full:
                                take += 1
                            if math.prod(self.sizes.get(a, 1) for a in axes[:take]) * local != full:
                                take = len(axes)
                            dims_out[o][d], axes = axes[:take], axes[take:]
                        elif dims_out[o][d] is None:
                            dims_out[o][d] = []
        parent: dict[tuple, tuple] = {}

        def find(x: tuple) -> tuple:
            while parent.get(x, x) != x:
                x = parent[x]
            return x

        for r in rel:
            refs = [r[1], r[2]] if r[0] == "eq" else ([r[1], *r[2]] if r[0] == "mul" else [])
            for x in refs[1:]:
                parent[find(tuple(x))] = find(tuple(refs[0]))
        reaches_out = {find(("o", o, d)) for o, sh in enumerate(shapes_out) for d in range(len(sh))}
        for i, v in enumerate(ins):
            if v < 0:
                continue
            for d, axes in enumerate(self.claim[v].dims):
                if axes and find(("i", i, d)) not in reaches_out:
                    partial |= set(axes)
        for o, v in enumerate(outs):
            full = self.gshape(v)
            dims = [axes if axes is not None and self.fits(axes, full[d], self.low.shapes[v][d],
                                                           source.get((o, d)))
                    else None for d, axes in enumerate(dims_out[o])]
            for d, axes in enumerate(dims):
                if axes is None:
                    dims[d] = self.hint(v, d, self.low.shapes[v][d], full[d])
            for d, axes in enumerate(dims):
                if axes is None:
                    used = tuple(a for x in dims if x for a in x)
                    # dim 0 is the batch (data-parallel rows, then microbatches)
                    order = ((("dp",), ("mb",), ("dp", "mb"), ("tp",), ("dp", "tp")) if d == 0
                             else (("dp",), ("tp",), ("dp", "tp"), ("mb",), ("dp", "mb")))
                    dims[d] = self.guess(self.low.shapes[v][d], full[d], used, order)
            self.claim[v] = Claim(dims, frozenset(partial), mbs if "mb" in partial else None,
                                  steps=steps if "step" in partial else None)
            self.check(v, uneven=True)

    def hint(self, v: int, d: int, local: int, full: int) -> list[str] | None:
        """The axes cutting dim d of v as its consumers see it: a dim of another
        input of a consumer that the consumer's dims relations tie to it (a
        broadcast constant expanded for a batched matmul is cut as the other
        operand is; an optimizer state as its parameter), when those axes
        give the local size; None if none does."""
        for node in self.consumers.get(v, []):
            if node.group is not None or node.dir == "bw":
                continue
            shapes_in = [None if x < 0 else self.low.shapes[x] for x in node.ins]
            shapes_out = [self.low.shapes[o] for o in node.outs if o >= 0]
            try:
                rel = get_op(node.op).relations(shapes_in, shapes_out, node.kwargs)
            except Exception:  # a consumer whose relations need other kwargs: no hint
                continue
            parent: dict[tuple, tuple] = {}
            for r in rel:
                if r[0] == "eq":
                    parent[_find(parent, tuple(r[1]))] = _find(parent, tuple(r[2]))
            mine = {_find(parent, ("i", i, d)) for i, x in enumerate(node.ins) if x == v}
            for i, x in enumerate(node.ins):
                if x < 0 or x == v or x not in self.claim:
                    continue
                for e, axes in enumerate(self.claim[x].dims):
                    if axes and _find(parent, ("i", i, e)) in mine \
                            and self.extent(axes, full) == local:
                        return list(axes)
        return None

    def infer_backward(self, node: LNode, partial: set[str], mbs) -> None:
        grad = self.claim[node.ins[-1]]
        for o in node.outs:
            if o < 0:
                continue
            if node.op == "embedding":
                tokens = self.claim[node.ins[0]]
                dims = [list(tokens.dims[-1]), list(grad.dims[-1])]
                extra = {a for d in grad.dims[:-1] for a in d}
                self.claim[o] = Claim(dims, frozenset(partial | extra), mbs)
            elif node.op == "max":  # the gradient has the shape, and the layout, of the input
                self.claim[o] = Claim([list(d) for d in self.claim[node.ins[0]].dims],
                                      frozenset(partial), mbs)
            else:
                self.claim[o] = Claim([list(d) for d in grad.dims], frozenset(partial), mbs)
            self.check(o)

    def fits(self, axes: list[str], full: int, local: int, source: int | None) -> bool:
        """Axes carried to an output dim give its local size: in equal pieces,
        or in torch.chunk's only when carried from an input dim of the same
        size (a padded shard through an elementwise op), never when they
        cut a dim of another size (a reshape) that they do not divide."""
        if full % math.prod(self.sizes[a] for a in axes) == 0 or source == full:
            return self.extent(axes, full) == local
        return False

    def extent(self, axes: list[str], full: int) -> int:
        """The size of this rank's piece of a dim of ``full`` cut by ``axes``."""
        lo, hi = self.piece(axes, full, self.low.coords)
        return hi - lo

    def piece(self, axes: list[str], full: int, coords: dict[str, int]) -> tuple[int, int]:
        """The [lo, hi) of a dim of ``full`` cut by ``axes`` at ``coords``:
        equal pieces, or (a size the axes do not divide) torch.chunk's."""
        n = math.prod(self.sizes[a] for a in axes)
        index = 0
        for a in axes:
            index = index * self.sizes[a] + coords.get(a, 0)
        if full % n:
            return padded_rows(full, n, index)
        return index * (full // n), (index + 1) * (full // n)

    def check(self, v: int, uneven: bool = False) -> None:
        """Axes that do not give a dim's local size are replaced by a guess.
        A dim the axes do not divide keeps them (torch.chunk's pieces) only
        when ``uneven``: the axes were carried from a dim of the same size
        (``fits``, a collective's input)."""
        full, local = self.gshape(v), self.low.shapes[v]
        c = self.claim[v]
        for d, n in enumerate(local):
            if d < len(full) and n > full[d]:
                node = self.producer.get(v)
                where = f"{node.op} at {_scope(node.name)}" if node is not None else "a value"
                raise WrongStep(f"rank {self.low.rank}: {where} makes {n} entries along dim {d} "
                                f"where the single-device step's value has {full[d]}: no piece "
                                f"of it (a layout that takes whole values for pieces counts "
                                f"them more than once)")
        for d, axes in enumerate(c.dims):
            even = full[d] % math.prod(self.sizes[a] for a in axes) == 0
            if self.extent(axes, full[d]) != local[d] or not (even or uneven):
                c.dims[d] = self.guess(local[d], full[d])
        self.whole_where_held(v)

    def whole_where_held(self, v: int) -> None:
        """A dim whose piece is all of it (the only member holding rows of a
        padded dim) is claimed whole: its axes cut nothing, and no axis may
        reach another dim through it."""
        c = self.claim[v]
        if c.at is None:
            c.dims = [[] if axes and self.extent(axes, n) == n else axes
                      for axes, n in zip(c.dims, self.gshape(v))]

    def view(self, v: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, int, int]]:
        c, local = self.claim[v], self.low.shapes[v]
        if c.loose:
            return tuple((0, n) for n in local), (0, 1, -(c.loose + 1))
        coords = {**self.low.coords, **(c.at or {}), "mb": self.mb.get(v, -1)}
        full = self.gshape(v)
        slices = []
        for d, axes in enumerate(c.dims):
            index = 0
            for a in axes:
                index = index * self.sizes[a] + coords[a]
            if full[d] % math.prod(self.sizes[a] for a in axes):
                slices.append(self.piece(axes, full[d], coords))
            else:
                slices.append((index * local[d], (index + 1) * local[d]))
        n, lo, hi = 1, 0, 1
        for a in self.part_axes:
            size = c.steps[2] if a == "step" and c.steps else self.sizes[a]
            if a in c.partial and size > 1:
                first, last = (c.mbs if a == "mb" and c.mbs else c.steps[:2] if a == "step"
                               else (coords[a], coords[a] + 1))
                n *= size
                lo, hi = lo * size + first, (hi - 1) * size + last
        cut = any("mb" in d for d in c.dims) or ("mb" in c.partial and c.mbs is None)
        if cut and coords["mb"] < 0:
            raise LoweringError(f"rank {self.low.rank}: a value outside the schedule's "
                                f"microbatches is cut by microbatches")
        return tuple(slices), (lo, hi, n)


def _order(ranks: list[Lowered]) -> list[tuple[int, int, int]]:
    """(rank position, node index, collective number) in an order where every
    collective runs after all its group members reached it, and every
    receive after its send (the k-th receive from a rank matches the k-th
    send to it: a pipeline's sends carry no microbatch id)."""
    pos = [0] * len(ranks)
    count: list[dict[tuple, int]] = [dict() for _ in ranks]
    sent: dict[tuple, int] = {}
    index = {low.rank: i for i, low in enumerate(ranks)}
    out = []

    def local(i: int) -> bool:
        """Run rank i up to its next collective (or a receive not sent yet)."""
        moved = False
        nodes = ranks[i].nodes
        while pos[i] < len(nodes):
            node = nodes[pos[i]]
            k = count[i].get(_channel(node), 0) if node.group is not None else -1
            if node.op == "send":
                sent[node.group] = sent.get(node.group, 0) + 1
            elif (node.op == "send_recv" and sent.get(node.group, 0) <= k) or \
                    (node.group is not None and node.op not in P2P):
                return moved
            if node.group is not None:
                count[i][_channel(node)] = k + 1
            out.append((i, pos[i], k))
            pos[i] += 1
            moved = True
        return moved

    while True:
        progressed = False
        for i in range(len(ranks)):
            progressed |= local(i)
        waiting = [i for i, low in enumerate(ranks) if pos[i] < len(low.nodes)]
        if not waiting:
            return out
        for i in waiting:
            node = ranks[i].nodes[pos[i]]
            if node.op in P2P:
                continue
            k = count[i].get(node.group, 0)
            members = [index[r] for r in node.group]
            if all(pos[j] < len(ranks[j].nodes) and ranks[j].nodes[pos[j]].group == node.group
                   and count[j].get(node.group, 0) == k for j in members):
                for j in members:
                    out.append((j, pos[j], k))
                    pos[j] += 1
                    count[j][node.group] = k + 1
                progressed = True
                break
        if not progressed:
            raise LoweringError("the ranks' collectives do not match in order within their "
                                "groups, or a receive has no send")


def build_plans(single: Lowered, ranks: list[Lowered], world: dict) -> tuple[Plan, Plan]:
    """The single-device plan and the parallel plan of the lowered traces."""
    b = _Builder(single, world)
    plan_s = b.build_single()
    writer = _Writer(b, ranks, world, plan_s)
    writer.walk()
    writer.materialize_finals()
    writer.refuse_loose_finals()
    writer.grad_buffers()
    return plan_s, writer.plan


def _rank_sizes(ranks: list[Lowered], world: dict) -> dict[str, int]:
    """The mesh sizes the ranks' claims read (``dpr`` and ``dps`` when the
    parameters are sharded over groups of the data-parallel ranks)."""
    sizes = {"dp": world["dp"], "cp": world.get("cp", 1), "tp": world["tp"], "mb": world["nm"],
             "step": world.get("cp", 1)}
    shards = {low.split["dps"] for low in ranks if "dps" in low.split}
    if len(shards) > 1:
        raise LoweringError(f"the ranks shard their parameters over data-parallel groups of "
                            f"different sizes {sorted(shards)}")
    if shards:
        s = shards.pop()
        sizes.update(dpr=world["dp"] // s, dps=s)
    return sizes


class _Writer:
    """The parallel plan, written node by node in the ranks' joint order:
    each rank's claims inferred (``_Rank``), its tensors numbered in
    versions, collectives wired to their peers' inputs."""

    def __init__(self, b: _Builder, ranks: list[Lowered], world: dict, plan_s: Plan) -> None:
        self.b = b
        self.ranks = ranks
        sizes = _rank_sizes(ranks, world)
        self.rs = {low.rank: _Rank(b, low, sizes) for low in ranks}
        self.channels = _Channels(ranks)
        self.coords = {low.rank: low.coords for low in ranks}
        self.plan = Plan(world=dict(world), logical=list(b.logical), loss=plan_s.loss,
                         grads=dict(plan_s.grads))
        self.versions: dict[tuple[int, int, int], int] = {}
        self.t_of: dict[tuple[int, int], int] = {}
        for r in self.rs.values():
            for v, (kind, _) in r.low.inputs.items():
                self.t_of[(r.low.rank, v)] = self.tensor(
                    r, v, -1 if kind in ("param", "buffer") else 0, tid=r.own_tid.get(v))

    def tensor(self, r: _Rank, v: int, mb: int, tid: int | None = None,
               lver: int | None = None) -> int:
        """A new version of rank r's value v as a tensor of the plan."""
        b = self.b
        tid = b.s.tid[r.sv[v]] if tid is None else tid
        lver = b.s.lver.get(r.sv[v], 0) if lver is None else lver
        key = (r.low.rank, mb, tid)
        version = self.versions.get(key, 0)
        self.versions[key] = version + 1
        slices, parts = r.view(v)
        f = r.claim[v].scale
        self.plan.tensors.append(Tensor(r.low.rank, mb, tid, version, tuple(r.low.shapes[v]),
                                        lver, slices, parts, (f.numerator, f.denominator)))
        return len(self.plan.tensors) - 1

    def peer_input(self, q: int, node: LNode, k: int) -> int:
        """The value rank q gives to the collective ``node`` (its k-th)."""
        peer = self.rs[q]
        return peer.low.nodes[self.channels.nth(peer.low, node, k)].ins[0]

    def emit(self, r: _Rank, node: LNode, k: int) -> None:
        low, t_of = r.low, self.t_of
        for o in node.outs:
            if o >= 0:
                t_of[(low.rank, o)] = self.tensor(r, o, max(r.mb.get(o, -1), 0))
        if node.op == "send_recv":
            src = node.group[0]
            ins = (t_of[(src, self.peer_input(src, node, k))],)
            kwargs = dict(node.kwargs)
        elif node.group is None:
            ins = tuple(-1 if v < 0 else t_of[(low.rank, v)] for v in node.ins)
            kwargs = dict(node.kwargs)
        else:
            ins = tuple(t_of[(q, self.peer_input(q, node, k))] for q in node.group)
            kwargs = {**node.kwargs, "index": node.group.index(low.rank)}
        outs = tuple(-1 if v < 0 else t_of[(low.rank, v)] for v in node.outs)
        mb = max((r.mb.get(o, -1) for o in node.outs if o >= 0), default=-1)
        self.plan.nodes.append(Node(low.rank, max(mb, 0), node.op, node.dir, ins, outs, kwargs,
                                    _scope(node.name)))

    def materialize(self, r: _Rank, x: int) -> None:
        """Rank r's pending value x written out, if it is pending."""
        if x in r.pending:
            for extra in r.materialize(x):
                self.emit(r, extra, -1)

    def walk(self) -> None:
        """Every rank's nodes in the joint order."""
        for i, n, k in _order(self.ranks):
            low = self.ranks[i]
            r = self.rs[low.rank]
            node = low.nodes[n]
            if node.op == "send_recv":
                peer = self.rs[node.group[0]]
                x = self.peer_input(peer.low.rank, node, k)
                self.materialize(peer, x)
                r.receive(node, peer, x)
                self.emit(r, node, k)
                continue
            if node.op == "all_reduce" and self.sum_across(r, node, k):
                continue
            if node.group is not None and node.op != "send":
                for q in node.group:
                    self.materialize(self.rs[q], self.peer_input(q, node, k))
            for out in r.step(node, self.coords):
                self.emit(r, out, k)

    def materialize_finals(self) -> None:
        """The gradients and losses the ranks end with, written out."""
        for r in self.rs.values():
            for name in list(r.low.grads):
                self.materialize(r, r.low.grads[name])
            for loss in r.low.losses:
                self.materialize(r, loss)

    def refuse_loose_finals(self) -> None:
        """A loss or gradient a rank ends with that is loose (computed from
        attention over part of the keys whose merge no ring result names:
        a ring written by hand, outside the CP shim) is refused in one line:
        it names no single-device value, so no claim about it could be
        proved (docs/soundness.md, "Plans traced from PyTorch", 4X-ring31 (e))."""
        for r in self.rs.values():
            finals = [*r.low.losses, *(g for g in r.low.grads.values() if g is not None)]
            if any(r.is_loose(v) for v in finals):
                raise AlignError(f"rank {r.low.rank} runs attention over part of the keys and "
                                 f"merges the blocks into a value the single-device step never "
                                 f"combines that way (a ring is verified when its merged result "
                                 f"is named: backends/torch/zoo/cp_shim.py ring_result)")

    def grad_buffers(self) -> None:
        """Each held parameter's gradient accumulated into its zeroed
        buffer, the final gradient of the plan."""
        for r in self.rs.values():
            held = {n: v for v, (kind, n) in r.low.inputs.items() if kind == "param"}
            for name, buf in self.b.gradbuf.items():
                if name not in held:
                    continue  # another pipeline stage's parameter
                g = r.low.grads.get(name)
                param = held[name]
                if g is None:
                    raise LoweringError(f"rank {r.low.rank} ends with no gradient for {name}")
                rank = r.low.rank
                zero_claim = r.claim[param]
                r.claim[-1 - buf] = Claim([list(d) for d in zero_claim.dims])
                r.sv[-1 - buf] = r.sv[param]
                r.low.shapes[-1 - buf] = r.low.shapes[param]
                zero = self.tensor(r, -1 - buf, -1, buf, 0)
                self.plan.nodes.append(Node(rank, -1, "zeros", "none", (), (zero,),
                                            {"shape": list(r.low.shapes[param])},
                                            f"{name}.grad_buffer"))
                final = self.tensor(r, g, 0, buf, 1)
                self.plan.nodes.append(Node(rank, 0, "local_grad_accumulation", "none",
                                            (zero, self.t_of[(rank, g)]), (final,), {},
                                            f"{name}.grad_buffer"))

    def sum_across(self, r: _Rank, node: LNode, k: int) -> bool:
        """An all-reduce of sums whose terms together make single-device
        terms, each member holding some of them, whole or as its part (the
        stages' squared gradient norms summed over a pipeline, a trainer's
        squared norms of sharded gradients on every rank and of replicated
        ones on one rank, an exact zero on a rank that counts none): written,
        on each member, as receiving the other members' terms, adding the
        pieces of each single-device term (claimed as the all-reduce claims
        them: partial over fewer axes), and adding those in the
        single-device order, or leaving them a deferred sum when they are
        only some of a single-device sum's terms (addition is associative
        and commutative in exact arithmetic; every member's term is used
        once: docs/soundness.md, "Plans traced from PyTorch", 3 and 29).
        False when the members reduce one value (an ordinary all-reduce)."""
        units, zero = {}, False
        for q in node.group:
            x = self.peer_input(q, node, k)
            units[q] = [] if x in self.rs[q].zeros else self.rs[q].terms(x)
            zero |= x in self.rs[q].zeros
        if not zero and len({self.rs[q].sv[u] for q in node.group for u in units[q]}) <= 1 \
                and all(len(us) == 1 for us in units.values()):
            return False
        by_sv: dict[int, list[tuple[int, int]]] = {}
        for q in node.group:
            for u in units[q]:
                by_sv.setdefault(self.rs[q].sv[u], []).append((q, u))
        s_leaves = sorted(t for sv in by_sv for t in self.b.leaves_of(sv))
        root = self.b.s_trees.get(tuple(s_leaves))
        if root is None and (len(by_sv) < 2 or self.b.superset(s_leaves) is None):
            if zero:
                raise AlignError(f"rank {r.low.rank} all-reduces at {_scope(node.name)} terms "
                                 f"that make no single-device sum")
            return False
        # the mesh axes the group runs along (several for a flattened group;
        # none for pipeline stages, whose terms are whole)
        axes = {a for a in r.axes if len({self.coords[q][a] for q in node.group}) > 1}
        out = node.outs[0]
        avail = {sv: self.combine(r, sv, terms, axes, node) for sv, terms in by_sv.items()}
        if root is None and len(by_sv) == 1:  # the all-reduce's value is that one term's sum
            acc = avail[next(iter(by_sv))]
            self.t_of[(r.low.rank, out)] = self.t_of[(r.low.rank, acc)]
            r.sv[out], r.mb[out], r.claim[out] = r.sv[acc], r.mb.get(acc, -1), r.claim[acc]
            r.low.shapes[out] = r.low.shapes[acc]
            return True
        if root is None:
            r.pending[out] = list(avail.values())
            return True

        def add_tree(sv: int, target: int | None) -> int:
            if sv in avail:
                return avail.pop(sv)
            s_node = self.b.s_add[sv]
            a, c = add_tree(s_node.ins[0], None), add_tree(s_node.ins[1], None)
            if target is None:
                target = r.fresh
                r.fresh += 1
                r.low.shapes[target] = r.low.shapes[a]
            new = LNode("add", s_node.dir, [a, c], [target], {}, s_node.name)
            r.one(new, {})
            self.emit(r, new, -1)
            return target

        add_tree(root, out)
        if avail:  # every member's term is added once, or the sum is not written
            raise AlignError(f"rank {r.low.rank} all-reduces at {_scope(node.name)} terms the "
                             f"single-device sum they stand for does not add")
        return True

    def combine(self, r: _Rank, sv: int, terms: list[tuple[int, int]], axes: set[str],
                node: LNode) -> int:
        """Rank r's sum of the members' pieces of one single-device term,
        summed one mesh axis of the group at a time (innermost first): the
        pieces that differ only along that axis are added, and their sum
        is claimed partial over one axis fewer, at their common
        coordinates (a piece no other member completes keeps its claim;
        the verifier proves or refutes each claim)."""
        items = [(dict(self.coords[q]), u if q == r.low.rank else self.received(r, self.rs[q], u, node))
                 for q, u in terms]
        done: set[str] = set()
        for axis in [a for a in reversed(r.axes) if a in axes]:
            done.add(axis)
            merged: dict[tuple, list[tuple[dict, int]]] = {}
            for at, v in items:
                merged.setdefault(tuple(at[a] for a in r.axes if a not in done),
                                  []).append((at, v))
            items = []
            for same in merged.values():
                at, acc = same[0]
                for _, v in same[1:]:
                    target = r.fresh
                    r.fresh += 1
                    r.low.shapes[target] = r.low.shapes[acc]
                    ca, cv = r.claim[acc], r.claim[v]
                    partial = (ca.partial | cv.partial) - {axis}
                    held = {a for d in ca.dims for a in d} | partial
                    where = {a: at[a] for a in held if a in at and at[a] != r.low.coords[a]}
                    r.sv[target], r.mb[target] = sv, -1
                    r.claim[target] = Claim([list(d) for d in ca.dims], partial, ca.mbs,
                                            ca.scale, where or None)
                    self.emit(r, LNode("add", "fw", [acc, v], [target], {}, node.name), -1)
                    acc = target
                items.append((at, acc))
        if len(items) != 1:
            raise AlignError(f"rank {r.low.rank} all-reduces at {_scope(node.name)} pieces of "
                             f"one term over ranks {list(node.group)} that no mesh axis joins")
        return items[0][1]

    def received(self, r: _Rank, peer: _Rank, u: int, node: LNode) -> int:
        """Rank r's copy of ``peer``'s term u (a ``send_recv``): the same
        piece, its axes read at the peer's coordinates."""
        target = r.fresh
        r.fresh += 1
        c = peer.claim[u]
        at = {a: peer.low.coords[a] for a in [*(a for d in c.dims for a in d), *c.partial]
              if a != "mb" and peer.low.coords[a] != r.low.coords[a]}
        r.sv[target], r.mb[target] = peer.sv[u], -1
        r.claim[target] = Claim([list(d) for d in c.dims], c.partial, c.mbs, c.scale, at or None)
        r.low.shapes[target] = peer.low.shapes[u]
        self.t_of[(r.low.rank, target)] = self.tensor(r, target, 0)
        self.plan.nodes.append(Node(r.low.rank, 0, "send_recv", "fw", (self.t_of[(peer.low.rank, u)],),
                                 (self.t_of[(r.low.rank, target)],),
                                 {"src": peer.low.rank, "dst": r.low.rank}, _scope(node.name)))
        return target


def _find(parent: dict[tuple, tuple], x: tuple) -> tuple:
    """The class of a dim reference in a union-find forest."""
    while parent.get(x, x) != x:
        x = parent[x]
    return x


def _channel(node: LNode) -> tuple:
    """What a node's number k counts along: its group's collectives, or
    (a send or a receive) the messages from one rank to another, which are
    matched apart from the collectives of a group of the same two ranks."""
    return ("p2p", *node.group) if node.op in P2P else node.group


class _Channels:
    """Each rank's collective nodes by channel, indexed once: the k-th node
    of a channel is looked up for every member of every collective."""

    def __init__(self, ranks: list[Lowered]):
        self.of: dict[int, dict[tuple, list[int]]] = {}
        for low in ranks:
            index: dict[tuple, list[int]] = {}
            for i, node in enumerate(low.nodes):
                if node.group is not None:
                    index.setdefault(_channel(node), []).append(i)
            self.of[low.rank] = index

    def nth(self, low: Lowered, like: LNode, k: int) -> int:
        """The index of ``low``'s k-th node on the channel of ``like``."""
        found = self.of[low.rank].get(_channel(like), [])
        if 0 <= k < len(found):
            return found[k]
        raise LoweringError(f"rank {low.rank} has no collective {k} in group {list(like.group)}")
