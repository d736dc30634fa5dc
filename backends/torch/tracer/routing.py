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
        #: run the experts the single-device step runs and the rank's rows
        #: route no token to (``hits``): set for a model whose experts loop
        #: skips an expert with no token, without expert parallelism
        self.fill_skipped = False
        #: (router call, expert) the rank's experts loop was given to run
        #: on no token (docs/soundness.md, "Plans traced from PyTorch", 88)
        self.added: list[tuple[int, int]] = []
        #: (router call, expert) of every experts-hit vector read, its
        #: additions included: the experts a loop was given to run
        self.reached: list[tuple[int, int]] = []
        #: the router calls after which an experts-hit vector was read
        self.loops: set[int] = set()
        #: hash lookups (``lookup``) whose choice is not the single-device
        #: step's at the rank's rows: (call, scope, row, mine, single's)
        self.differ: list[tuple[int, str, int, list, list]] = []

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

    def lookup(self, table: torch.Tensor, out: torch.Tensor, scope: str = "") -> None:
        """A hash router's choice (``table[ids]``, ``hash_routing``): a router
        call of its own, recorded as the rank computed it (its experts
        counted as the table's largest entry plus one, the experts the table
        can choose). Nothing is replayed: with a routing to replay, the
        rank's own choice is compared with the single-device call's rows
        the rank holds, and a difference is kept (``differ``: the call,
        its scope, the first row that differs, the rank's experts and the
        single-device step's there) for ``check_lookups``
        (docs/soundness.md, "Plans traced from PyTorch", 128 (b))."""
        mine = out.detach().numpy().copy()
        k = len(self.recorded)
        if self.replay is not None and k < len(self.replay):
            try:
                want = self.rows(np.asarray(self.replay[k]), tuple(mine.shape))
            except RoutingError:
                want = None
            if want is None or want.shape != mine.shape:
                self.differ.append((k, scope, -1, [], []))
            elif not np.array_equal(want, mine):
                flat_m, flat_w = mine.reshape(mine.shape[0], -1), want.reshape(want.shape[0], -1)
                row = int(np.flatnonzero((flat_m != flat_w).any(axis=1))[0])
                self.differ.append((k, scope, row, flat_m[row].tolist(), flat_w[row].tolist()))
        self.recorded.append(mine)
        self.experts.append(int(table.max()) + 1 if table.numel() else 0)

    def hits(self, name: str, args: tuple, out: Any) -> Any:
        """``nonzero`` of a 1-dim bool with one entry per expert of the last
        router call (a sentinel entry past them allowed: the experts a
        loop runs) gives, besides its own entries, the experts the
        single-device routing sends a token to and neither this vector nor
        the rank's replayed routing does: the loop then runs them on the
        empty index of the rank's rows (docs/soundness.md, "Plans traced
        from PyTorch", 88). Any other ``nonzero`` is left as it is."""
        if not self.recorded or name != "aten.nonzero.default" or not args \
                or not isinstance(args[0], torch.Tensor):
            return out
        x, k = args[0], len(self.recorded) - 1
        experts = self.experts[k]
        if x.dim() != 1 or x.dtype != torch.bool or x.shape[0] not in (experts, experts + 1):
            return out
        self.loops.add(k)
        if not self.fill_skipped or self.replay is None:
            return out
        hit = x.numpy().copy()
        routed = np.zeros(x.shape[0], dtype=bool)
        routed[np.unique(self.recorded[k])] = True
        full = np.zeros(x.shape[0], dtype=bool)
        full[np.unique(np.asarray(self.replay[k]))] = True
        added = np.flatnonzero(full & ~routed & ~hit)
        self.reached.extend((k, int(e)) for e in np.flatnonzero(hit | full & ~routed))
        if not len(added):
            return out
        self.added.extend((k, int(e)) for e in added)
        hit[added] = True
        return torch.as_tensor(np.flatnonzero(hit)[:, None], dtype=out.dtype).clone()

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


def describe_added(traces: list[dict]) -> str:
    """The experts each rank's loop ran on no token (``Routing.hits``), for
    the world spec's ``routing`` (what a SUCCESS covers)."""
    runs = [f"rank {t['rank']} expert {e} at router call {k}"
            for t in traces for k, e in t.get("routing_added", [])]
    return "run on no token: " + ", ".join(runs)


def check_every_expert_reached(single: dict, traces: list[dict]) -> None:
    """Refuse a step in which some rank's rows send no token to an expert
    the single-device step routes tokens to and the rank's experts loop was
    not given that expert to run on no token (``Routing.hits``: its loop
    reads no ``nonzero`` of the experts hit), for a model whose experts loop
    skips such an expert (``skips_unrouted_experts``: transformers' eager
    loop; torchtitan's grouped GEMMs run every expert). The rank would lack
    a term the single-device step adds (docs/soundness.md, "Plans traced
    from PyTorch", 36 g, 88)."""
    from backends.torch.errors import LoweringError
    # the router calls an experts loop reads (a group-limited router's
    # calls that pick groups run no expert), or every call when the
    # single-device step reads no experts-hit vector (a loop of another form)
    loops = set(single.get("routing_loops", ())) or set(range(len(single.get("routing", []))))
    for trace in traces:
        added = {tuple(a) for a in trace.get("routing_reached", [])}
        for k, (mine, full) in enumerate(zip(trace.get("routing", []), single.get("routing", []))):
            if k not in loops:
                continue
            missing = sorted(set(np.unique(full).tolist()) - set(np.unique(mine).tolist()))
            missing = [e for e in missing if (k, e) not in added]
            if missing:
                raise LoweringError(f"rank {trace['rank']} routes no token to expert {missing[0]} at "
                                    f"router call {k} (the single-device step does) and its experts "
                                    f"loop reads no nonzero of the experts hit to run it on none: an "
                                    f"expert skipped on a rank is not traced (docs/soundness.md, "
                                    f"\"Plans traced from PyTorch\", 36 g); another --seed or --batch "
                                    f"routes otherwise")


def check_lookups(traces: list[dict]) -> None:
    """A rank whose hash router chose other experts than the single-device
    step's lookup at the rank's rows (``Routing.lookup``): a finding before
    any proof, one line naming the rank, the module, the row and both
    choices (docs/soundness.md, "Plans traced from PyTorch", 128 (b))."""
    from backends.torch.errors import WrongStep
    for trace in traces:
        for k, scope, row, mine, want in trace.get("routing_differ", []):
            where = f"at {scope} " if scope else ""
            if row < 0:
                raise WrongStep(f"rank {trace['rank']} looks its experts up {where}(router call "
                                f"{k}) for rows of the batch the single-device step's call has "
                                f"no block of: its hash routing is not the single-device step's")
            raise WrongStep(f"rank {trace['rank']} routes its token row {row} {where}(router call "
                            f"{k}) to experts {mine}, the single-device step routes that token "
                            f"to {want}: its hash routing is not the single-device step's")


def check_skipped_add_nothing(filled: list[dict], own: list[dict]) -> None:
    """Refuse a rank whose experts loop, given experts to run on no token
    (``Routing.hits``), ran otherwise than its own step (``own``: the ranks
    traced as the code runs them): another sequence of ops outside the
    added iterations shows in the values the step ends with, which must be
    equal (docs/soundness.md, "Plans traced from PyTorch", 88)."""
    from backends.torch.errors import LoweringError
    for mine, real in zip(filled, own):
        if not mine.get("routing_added"):
            continue
        a, b = mine.get("ends") or [], real.get("ends") or []
        if len(a) != len(b) or any(x.shape != y.shape or not np.array_equal(x, y)
                                   for x, y in zip(a, b)):
            k, e = mine["routing_added"][0]
            raise LoweringError(f"rank {mine['rank']}: its experts loop run on no token for expert "
                                f"{e} at router call {k} ends its step with other values than the "
                                f"step as the code runs it (the added iteration is no empty one; "
                                f"docs/soundness.md, \"Plans traced from PyTorch\", 88)")
