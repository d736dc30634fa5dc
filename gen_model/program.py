"""The sharded program: what the parallelizer's two passes hand each other.

The mesh axes and the orders that number their pieces, the policy (choices
beyond the degrees of parallelism), and the program itself: one SPMD
program of sharded ops, each value in one layout per mesh axis, tagged with
its (virtual) pipeline stage. gen_model/spmd.py makes it; gen_model/emit.py
instantiates it per rank and microbatch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gen_model.config import Parallelism
from gen_model.sharding import Layout, is_split

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
    #: ZeRO: cut each parameter on the dim the plan of this many data-parallel
    #: ranks (a multiple of dp) would cut, not this plan's first dim that its
    #: owners divide (0: this plan's). The array generator's small plans use
    #: it so that their shards are the large plan's (gen_model/replicate.py).
    zero_dims_at: int = 0


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
