"""Top-k routing as recorded data (docs/soundness.md, "Plans traced from
PyTorch", 36).

On one device, the index output of every ``aten.topk`` is recorded as a
constant of the step: the routing. Everything computed from it alone (the
experts' token rows, sort orders, counts, offsets, split sizes) is then a
constant too, by the recorder's own rule. On a rank, the k-th ``topk``
returns the single-device k-th routing at the rank's rows (replay), its
values the rank's own scores picked at those indices; the proof then
checks that this is the routing of the rows the rank holds.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

#: the ops whose index output is a routing
ROUTED = frozenset({"aten.topk.default"})


class RoutingError(ValueError):
    """A rank's router call the recorded routing cannot be replayed into."""


def _dim(args: tuple, kwargs: dict) -> int:
    if len(args) > 2:
        return int(args[2])
    return int(kwargs.get("dim", -1))


class Routing:
    """The routings one step records, in call order; with ``replay`` (the
    single-device step's), each call returns the replayed one. ``block`` is
    the rank's data-parallel block (index, parts) of the flattened rows."""

    def __init__(self, replay: list[np.ndarray] | None = None, block: tuple[int, int] = (0, 1),
                 seq_block: tuple[int, int] = (0, 1), sequence_first: bool = False):
        self.replay = replay
        self.block = block
        self.seq_block = seq_block  # the rank's tensor-parallel block of the positions
        #: the model's token rows are (position, batch row) pairs, position
        #: outer (Megatron-Core's ``[s, b, h]`` flattened), of ``batch`` rows
        self.sequence_first = sequence_first
        self.batch: int | None = None
        self.recorded: list[np.ndarray] = []
        self.experts: list[int] = []

    def rows(self, full: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The replayed routing's rows this call reads: all of them, or the
        rank's block of the leading dim."""
        if tuple(full.shape) == shape:
            return full
        index, parts = self.block
        at, cuts = self.seq_block
        if self.sequence_first and len(shape) == full.ndim and shape[1:] == full.shape[1:] \
                and shape[0] * parts * cuts == full.shape[0]:
            # rows (position, batch row), position outer: the rank's block of
            # the positions (sequence parallelism) at its data-parallel block
            # of the batch rows (not one block of the flattened rows when both
            # are cut: the replay is the routing of exactly the rank's tokens)
            batch = self.batch
            if batch is None or full.shape[0] % batch or batch % parts:
                raise RoutingError(f"a router call of shape {list(shape)} on sequence-first rows "
                                   f"of an unknown batch")
            grid = full.reshape(full.shape[0] // batch, batch, *full.shape[1:])
            s, b = grid.shape[0] // cuts, batch // parts
            return grid[at * s:(at + 1) * s, index * b:(index + 1) * b].reshape(shape)
        if len(shape) == full.ndim and shape[0] * parts == full.shape[0] and shape[1:] == full.shape[1:]:
            return full[index * shape[0]:(index + 1) * shape[0]]
        if len(shape) == full.ndim >= 3 and shape[2:] == full.shape[2:] \
                and shape[0] * parts == full.shape[0] and shape[1] * cuts == full.shape[1]:
            # sequence parallelism: the rank's rows and its block of the positions
            rows = full[index * shape[0]:(index + 1) * shape[0]]
            return rows[:, at * shape[1]:(at + 1) * shape[1]]
        raise RoutingError(f"a router call of shape {list(shape)} reads no rows of the recorded "
                           f"routing {list(full.shape)} (its rows are neither the whole batch nor "
                           f"this rank's data-parallel block, nor that block's tensor-parallel "
                           f"block of the positions)")

    def call(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """``topk``'s result, replayed when there is a routing to replay."""
        values, indices = out
        scores = args[0]
        dim = _dim(args, kwargs) % scores.dim()
        if self.replay is not None:
            k = len(self.recorded)
            if k >= len(self.replay):
                raise RoutingError(f"the rank routes more often ({k + 1} router calls) than the "
                                   f"single-device step ({len(self.replay)})")
            picked = self.rows(np.asarray(self.replay[k]), tuple(indices.shape))
            indices = torch.as_tensor(picked, dtype=indices.dtype).clone()
            values = torch.gather(scores, dim, indices)
        self.recorded.append(indices.detach().numpy().copy())
        self.experts.append(int(scores.shape[dim]))
        return values, indices

    def summary(self) -> list[dict]:
        """Per router call: the routing's shape, the tokens each expert got
        and a digest of the indices (what a SUCCESS names)."""
        out = []
        for idx, experts in zip(self.recorded, self.experts):
            counts = np.bincount(idx.reshape(-1), minlength=experts)
            out.append({"shape": list(idx.shape), "tokens_per_expert": counts.tolist(),
                        "digest": hashlib.sha256(np.ascontiguousarray(idx).tobytes()).hexdigest()[:12]})
        return out


def describe(summary: list[dict]) -> str:
    """The routing a plan pair was traced with, one router call after
    another (the world spec's ``routing``, a string: what a SUCCESS covers)."""
    return "; ".join(f"router call {i}: indices {'x'.join(map(str, s['shape']))} "
                     f"sha256:{s['digest']}, tokens per expert "
                     f"{','.join(map(str, s['tokens_per_expert']))}" for i, s in enumerate(summary))


def check_every_expert_reached(single: dict, traces: list[dict]) -> None:
    """Refuse a step in which some rank's rows send no token to an expert
    the single-device step routes tokens to, for a model whose experts loop
    then runs no code for that expert on the rank (``skips_unrouted_experts``:
    transformers' eager loop; torchtitan's grouped GEMMs run every expert), where the single-device step
    adds a term (zero on the rank's rows, but only by the routing masks'
    values, which the proof treats as symbols: docs/soundness.md, "Plans
    traced from PyTorch", 36 g)."""
    from backends.torch.errors import LoweringError
    for trace in traces:
        for k, (mine, full) in enumerate(zip(trace.get("routing", []), single.get("routing", []))):
            missing = sorted(set(np.unique(full).tolist()) - set(np.unique(mine).tolist()))
            if missing:
                raise LoweringError(f"rank {trace['rank']} routes no token to expert {missing[0]} at "
                                    f"router call {k} (the single-device step does): an expert with "
                                    f"no token on a rank is not traced (docs/soundness.md, \"Plans "
                                    f"traced from PyTorch\", 36 g); another --seed or --batch routes "
                                    f"otherwise")


def check_rows_are_blocks(single: dict, dp: int, tp: int = 1) -> None:
    """Refuse a routed step of a sequence-first model (token rows ``[s, b]``
    flattened, position outer: Megatron-Core's) with data and tensor
    parallelism together: a rank's tokens are then its block of the
    positions at its batch rows, which no claim of a block states and the
    ranks' order of the rows is not written for (docs/soundness.md, "Plans
    traced from PyTorch", 48 g; at tp 1, item 89 writes the single-device
    step in the ranks' order)."""
    from backends.torch.errors import LoweringError
    if single.get("routing") and single.get("sequence_first") and dp > 1 and tp > 1:
        raise LoweringError("a routed mixture of experts in a sequence-first model with data "
                            "and tensor parallelism together is not traced: each rank's token "
                            "rows (its positions at its batch rows) are no block of the "
                            "flattened [s, b] rows; use --tp 1 or --dp 1")
