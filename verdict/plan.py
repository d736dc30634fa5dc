"""Execution plans in memory: the SSA DAG of one training step.

A plan is a list of logical tensors (the full, single-device tensors), a list
of plan tensors (each one piece of a logical tensor on one rank for one
microbatch) and a list of nodes in execution order. docs/plan-format.md
describes the on-disk form; :func:`Plan.to_data` and :func:`Plan.from_data`
convert between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

FORMAT = "verdict-plan"
#: The newest version; version 2 adds the world keys of a folded plan
#: (FOLD_KEYS), version 3 a tensor's optional scale (a 9th column). A plan is
#: written with the lowest version that holds it, so older files read alike.
VERSION = 3
VERSIONS = (1, 2, 3)
#: The factor of a tensor that is not scaled.
UNIT = (1, 1)
#: World keys of a folded plan: the real replicas, microbatches and batch
#: (docs/soundness.md, "Folded plans"); ``dp``, ``nm``, ``gbs`` are the shown ones.
FOLD_KEYS = ("fold_dp", "fold_nm", "fold_gbs")

class InputError(ValueError):
    """A plan the verifier refuses as input (exit 2): it claims what no stage
    can prove and the verifier will not assume."""


def lowest(num: int, den: int) -> tuple[int, int]:
    """A factor as (num, den) in lowest terms, den > 0."""
    f = Fraction(num, den)
    return (f.numerator, f.denominator)


#: Kinds of logical tensor. Inputs (no producer) are data, tokens (one-hot
#: data), params and buffers; everything else is computed.
INPUT_KINDS = ("data", "tokens", "param", "buffer")
KINDS = (*INPUT_KINDS, "act", "grad", "gradbuf", "loss")
DIRECTIONS = ("fw", "bw", "none")

Slices = tuple[tuple[int, int], ...]

#: Inputs tuples at least this long that nodes share are stored once.
SHARED_MIN = 16


class Logical(NamedTuple):
    name: str
    shape: tuple[int, ...]
    kind: str


class Tensor(NamedTuple):
    """One SSA value: logical tensor ``tid`` at ``version`` on (rank, mb).

    Its lineage view says which piece of logical tensor ``tid`` at logical
    version ``lver`` it holds: the ``slices`` ([start, end) per dim, in full
    coordinates) and the parts [lo, hi) of an ``n``-way partial sum (of an
    ``|n|``-way partial maximum when ``n`` is negative), times ``scale``, an
    exact rational (num, den) in lowest terms (docs/soundness.md, "Scaled
    claims").
    """

    rank: int
    mb: int
    tid: int
    version: int
    shape: tuple[int, ...]
    lver: int
    slices: Slices
    parts: tuple[int, int, int]
    scale: tuple[int, int] = UNIT

    def factor(self) -> Fraction:
        return Fraction(*self.scale)

    def key(self) -> tuple[int, int, int, int]:
        return (self.rank, self.mb, self.tid, self.version)

    def is_whole(self) -> bool:
        return self.parts == (0, 1, 1)


class Node(NamedTuple):
    """One operator on one rank for one microbatch (-1: outside microbatches).

    A backward node is laid out by primal position (see docs/plan-format.md);
    -1 marks an absent slot. ``name`` is the model scope it came from.
    """

    rank: int
    mb: int
    op: str
    dir: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    kwargs: dict[str, Any]
    name: str = ""


@dataclass
class Plan:
    world: dict[str, Any]
    logical: list[Logical] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    loss: int = -1
    grads: dict[int, int] = field(default_factory=dict)

    def to_data(self) -> dict[str, Any]:
        """Plain data (dicts, lists, numbers, strings, bools, None) for pickling.

        Nodes that share one long inputs tuple (a replica group's reducers)
        share one list, which the pickle then stores once."""
        lists: dict[int, list[int]] = {}

        def inputs(t: tuple[int, ...]) -> list[int]:
            if len(t) < SHARED_MIN:
                return list(t)
            if id(t) not in lists:
                lists[id(t)] = list(t)
            return lists[id(t)]

        def row(t: Tensor) -> list:
            out = [t.rank, t.mb, t.tid, t.version, list(t.shape), t.lver,
                   [list(s) for s in t.slices], list(t.parts)]
            return out + [list(t.scale)] if t.scale != UNIT else out

        return {
            "format": FORMAT,
            "version": self.lowest_version(),
            "world": dict(self.world),
            "logical": [[t.name, list(t.shape), t.kind] for t in self.logical],
            "tensors": [row(t) for t in self.tensors],
            "nodes": [
                [n.rank, n.mb, n.op, n.dir, inputs(n.inputs), list(n.outputs), dict(n.kwargs),
                 n.name]
                for n in self.nodes
            ],
            "loss": self.loss,
            "grads": [[p, g] for p, g in self.grads.items()],
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Plan:
        """Build a plan from :meth:`to_data` output; the caller validates it.
        A long inputs list shared by several nodes becomes one shared tuple."""
        tuples: dict[int, tuple[int, ...]] = {}

        def inputs(x: list[int]) -> tuple[int, ...]:
            if len(x) < SHARED_MIN:
                return tuple(x)
            if id(x) not in tuples:
                tuples[id(x)] = tuple(x)
            return tuples[id(x)]

        return cls(
            world=dict(data["world"]),
            logical=[Logical(n, tuple(s), k) for n, s, k in data["logical"]],
            tensors=[
                Tensor(r, m, t, v, tuple(shape), lv, tuple(tuple(s) for s in sl), tuple(p),
                       lowest(*rest[0]) if rest else UNIT)
                for r, m, t, v, shape, lv, sl, p, *rest in data["tensors"]
            ],
            nodes=[
                Node(r, m, op, d, inputs(i), tuple(o), dict(kw), name)
                for r, m, op, d, i, o, kw, name in data["nodes"]
            ],
            loss=data["loss"],
            grads={p: g for p, g in data["grads"]},
        )

    def is_folded(self) -> bool:
        return any(k in self.world for k in FOLD_KEYS)

    def lowest_version(self) -> int:
        """3 when a tensor is scaled, else 2 when folded, else 1."""
        if any(t.scale != UNIT for t in self.tensors):
            return 3
        return 2 if self.is_folded() else 1

    def last_writes(self) -> dict[tuple[int, int], int]:
        """(tid, rank) -> the tensor last written for it in execution order:
        what the rank holds at the end of the step (e.g. for the optimizer)."""
        last = {}
        for node in self.nodes:
            for o in node.outputs:
                if o >= 0:
                    last[(self.tensors[o].tid, self.tensors[o].rank)] = o
        return last

    def scaled_load(self) -> str | None:
        """Why the plan is refused for a load that claims a factor, or None.

        A load (a tensor no node writes: a parameter shard, a batch piece) is
        the checkpoint's or the batch's slice itself; nothing in the step
        could prove it to be a multiple of that slice, so a factor other than
        1 on it is refused, never assumed (docs/soundness.md, "What a SUCCESS
        assumes")."""
        scaled = [i for i, t in enumerate(self.tensors) if t.scale != UNIT]
        if not scaled:
            return None
        written = {o for node in self.nodes for o in node.outputs}
        for i in scaled:
            if i not in written:
                return load_factor_message(self, i, self.tensors[i])
        return None

    def producers(self) -> list[int]:
        """For each tensor, the index of the node writing it (-1 for inputs)."""
        prod = [-1] * len(self.tensors)
        for i, node in enumerate(self.nodes):
            for t in node.outputs:
                if t >= 0:
                    prod[t] = i
        return prod


def load_factor_message(plan: Plan | Any, i: int, t: Tensor) -> str:
    """The refusal of a load ``t`` (tensor ``i``) that claims a factor."""
    num, den = t.scale
    factor = str(num) if den == 1 else f"{num}/{den}"
    return (f"tensor {i} ({plan.logical[t.tid].name} v{t.version} on rank {t.rank}, mb "
            f"{t.mb}) is loaded (no node writes it) but claims {factor} x its slice: a load is "
            f"its slice of the checkpoint or batch itself, and only a computed tensor may "
            f"claim a factor")


#: World fields that describe parallelism; all others describe the model.
PARALLEL_FIELDS = ("dp", "tp", "pp", "ep", "nm", "cp", "variant", "vocab_parallel", "schedule",
                   "sequence_parallel", "ulysses", "virtual_stages", "zero", "cp_balance", "grad_blocks",
                   "final_blocks", *FOLD_KEYS)


#: World fields that name a model's sizes, in the order a message lists them.
MODEL_SIZES = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seqlen", "experts",
               "topk", "moe_ffn", "gbs")
DEGREES = ("dp", "tp", "pp", "ep", "nm", "cp")


def describe_model(world: dict[str, Any]) -> str:
    """A model in a user's words: its name and its sizes (those above zero)."""
    sizes = ", ".join(f"{k} {world[k]}" for k in MODEL_SIZES if world.get(k))
    return f"{world.get('model', 'an unnamed model')} ({sizes})" if sizes else str(
        world.get("model", "an unnamed model"))


def pair_problem(single: Plan, parallel: Plan) -> str | None:
    """Why two plans cannot be compared (None when they can): the first must
    be single-device, the second parallel, and both must describe the same
    model."""
    for flag in DEGREES:
        if single.world.get(flag, 1) != 1:
            return f"--sm is not a single-device plan ({flag}={single.world[flag]})"
    if any(t.rank != 0 for t in single.tensors):
        return "--sm has tensors on ranks other than 0"
    if (all(parallel.world.get(flag, 1) == 1 for flag in DEGREES) and not parallel.is_folded()
            and all(t.rank == 0 for t in parallel.tensors)):
        return ("--pm is a single-device plan (dp, tp, pp, ep, nm and cp all 1): there is "
                "nothing parallel to verify; pass a parallel plan as --pm")
    keys = sorted((set(single.world) | set(parallel.world)) - set(PARALLEL_FIELDS))
    for key in keys:
        a, b = single.world.get(key), parallel.world.get(key)
        if a != b:
            return (f"the plans are of different models: --sm is {describe_model(single.world)}"
                    f" and --pm is {describe_model(parallel.world)} ({key} {a} against {b})")
    if len(single.logical) != len(parallel.logical):
        return "the plans are of different models: their logical tensors differ"
    for a, b in zip(single.logical, parallel.logical):
        if a != b:
            return f"the plans are of different models: logical tensor {a.name} vs {b.name}"
    if (single.loss, single.grads) != (parallel.loss, parallel.grads):
        return "the plans are of different models: loss or gradients differ"
    scaled = next((i for i, t in enumerate(single.tensors) if t.scale != UNIT), None)
    if scaled is not None:
        return (f"--sm: tensor {scaled} claims a factor; the single-device plan's tensors are "
                f"its logical tensors themselves")
    problem = parallel.scaled_load()
    return f"--pm: {problem}" if problem else None
