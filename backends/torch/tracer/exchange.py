"""Collectives on constants, answered with the members' recorded values
(docs/soundness.md, "Plans traced from PyTorch", 37 a).

Under the fake process group a collective communicates nothing. When every
tensor an all-to-all reads on a rank is a constant (the per-expert token
counts computed from the replayed routing), the values every member sends
are known after one pass: the ranks are traced again, each such collective
answered with what it defines on the members' values of the previous pass,
until every rank sends what it sent in the pass before (``settle``). The
answer is then the value a real run's collective returns for the traced
step, and it is a constant of the step like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from backends.torch.errors import LoweringError

#: the all-to-alls answered: op name -> positions of (output or None, input,
#: output splits, input splits, group) in its arguments (the schemas'
#: ``alltoall_base_(output, input, process_group, output_split_sizes,
#: input_split_sizes)`` and ``all_to_all_single(input, output_split_sizes,
#: input_split_sizes, group_name)``)
ALL_TO_ALL = {
    "c10d.alltoall_base_.default": (0, 1, 3, 4, 2),
    "_c10d_functional.all_to_all_single.default": (None, 0, 1, 2, 3),
}
#: the all-gathers answered (Megatron's dispatcher gathers its per-expert
#: counts over the tensor- and expert-parallel ranks): op name -> positions
#: of (output, input, group); each member's output is every member's input,
#: concatenated along dim 0 in group order
ALL_GATHER = {"c10d._allgather_base_.default": (0, 1, 2)}
#: the broadcasts of one number answered (Megatron's token count, broadcast
#: from the last pipeline stage): op name -> positions of (tensors, group,
#: root's index in the group); a broadcast of anything else (DDP's buffers)
#: is left as it is (its members hold the root's values: ``check_broadcasts``)
BROADCAST = {"c10d.broadcast_.default": (0, 1, 2)}
#: the all-reduces answered when a step asks for them (``Exchanges(reduce=True)``:
#: torchtitan's load-balancing hook sums its per-expert counts over the
#: data-parallel ranks, docs/soundness.md, "Plans traced from PyTorch", 105):
#: op name -> positions of (tensors, group, reduce op); one tensor, SUM only
ALL_REDUCE = {"c10d.allreduce_.default": (0, 1, 2)}
#: every collective of constants answered
ANSWERED = frozenset(ALL_TO_ALL) | frozenset(ALL_GATHER) | frozenset(BROADCAST)
#: passes of the ranks before the sent values must have settled (one per
#: layer whose counts depend on an earlier answer, and one to check)
PASSES = 8


def _splits(sizes: Any) -> list[int] | None:
    if sizes is None:
        return None
    sizes = [int(s) for s in sizes]
    return sizes or None


def _cut(rows: int, splits: list[int] | None, n: int) -> list[tuple[int, int]]:
    """The row ranges an input of ``rows`` rows sends to the n members."""
    if splits is None:
        if rows % n:
            raise LoweringError(f"an all-to-all without split sizes of {rows} rows over {n} "
                                f"members")
        splits = [rows // n] * n
    if len(splits) != n or sum(splits) != rows:
        raise LoweringError(f"an all-to-all's input split sizes {splits} do not cut its {rows} "
                            f"rows among {n} members")
    bounds = np.concatenate([[0], np.cumsum(splits)]).tolist()
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(n)]


class Exchanges:
    """The constant all-to-alls of one rank's step: what it sends (``sent``,
    in call order: group, input, input splits, output splits) and, given
    the members' sends of the pass before (``previous``: rank -> sent), the
    answers."""

    def __init__(self, rank: int, previous: dict[int, list[dict]] | None = None,
                 reduce: bool = False):
        self.rank = rank
        self.previous = previous
        #: answer the SUM all-reduces of one constant tensor too (``ALL_REDUCE``)
        self.reduce = reduce
        self.sent: list[dict] = []
        self.count: dict[tuple[int, ...], int] = {}  # per group: constant all-to-alls so far
        self.unanswered = 0  # constant all-to-alls left as the fake group returned them
        self.answered: list[float] = []  # the numbers written by answered broadcasts, in order

    def handles(self, name: str) -> bool:
        return name in ANSWERED or self.reduce and name in ALL_REDUCE

    def input_of(self, name: str, args: tuple) -> Any:
        """The tensor an answered collective sends (a broadcast: its one
        tensor, None when it broadcasts anything but one number; an
        all-reduce: its one tensor, None for several or another op than SUM)."""
        if name in ALL_REDUCE:
            at_tensors, _, at_op = ALL_REDUCE[name]
            tensors, op = args[at_tensors], args[at_op]
            op = int(op.op()) if isinstance(op, torch.ScriptObject) else None
            return tensors[0] if len(tensors) == 1 and op == 0 else None  # 0: ReduceOp.SUM
        if name in BROADCAST:
            tensors = args[BROADCAST[name][0]]
            one = len(tensors) == 1 and tensors[0].numel() == 1
            return tensors[0] if one else None
        return args[1] if name.startswith("c10d.") else args[0]

    def broadcast(self, name: str, args: tuple, constant: bool,
                  group_of: Callable[[Any], tuple[int, ...]]) -> bool | None:
        """Record a broadcast of one number (``constant``: a constant of the
        step on this rank); write the root's number into it when the
        root's send is known. Whether the result is a constant (the
        root's), None while unanswered."""
        at_tensors, at_group, at_root = BROADCAST[name]
        x = args[at_tensors][0]
        group = group_of(args[at_group])
        k = self.count.get(group, 0)
        self.count[group] = k + 1
        root = group[int(args[at_root])]
        self.sent.append({"group": list(group), "k": k, "input": x.detach().cpu().numpy().copy(),
                          "in_splits": None, "out_splits": None, "whole": True, "root": root,
                          "constant": constant})
        sends = [] if self.previous is None else \
            [s for s in self.previous.get(root, []) if tuple(s["group"]) == group]
        if k >= len(sends):
            self.unanswered += 1
            return None
        with torch.no_grad():
            x.copy_(torch.as_tensor(sends[k]["input"], dtype=x.dtype).reshape(x.shape))
        self.answered.append(float(sends[k]["input"].reshape(())))
        return bool(sends[k]["constant"])

    def call(self, name: str, args: tuple, kwargs: dict, out: Any,
             group_of: Callable[[Any], tuple[int, ...]]) -> bool:
        """Record a constant all-to-all's (or all-gather's) send; write the
        answer into its output when the members' sends are known (True
        then). An all-gather is an all-to-all sending its whole input to
        every member."""
        if name in ALL_REDUCE:
            return self.all_reduce(name, args, group_of)
        gather = name in ALL_GATHER
        if gather:
            at_out, at_in, at_group = ALL_GATHER[name]
            x = args[at_in]
            group = group_of(args[at_group])
            args = (args[at_out], x, None, None)
            at_osplit = at_isplit = 2
            at_out, at_in = 0, 1
        else:
            at_out, at_in, at_osplit, at_isplit, at_group = ALL_TO_ALL[name]
            x = args[at_in]
            group = group_of(args[at_group])
        k = self.count.get(group, 0)
        self.count[group] = k + 1
        record = {"group": list(group), "k": k, "input": x.detach().cpu().numpy().copy(),
                  "in_splits": _splits(args[at_isplit]), "out_splits": _splits(args[at_osplit]),
                  "whole": gather}
        self.sent.append(record)
        target = out if at_out is None else args[at_out]
        answer = None if self.previous is None else self.answer(group, k, tuple(target.shape))
        if answer is None:  # a member did not get this far in the pass before
            self.unanswered += 1
            return False
        with torch.no_grad():
            target.copy_(torch.as_tensor(answer, dtype=target.dtype))
        return True

    def all_reduce(self, name: str, args: tuple,
                   group_of: Callable[[Any], tuple[int, ...]]) -> bool:
        """Record a SUM all-reduce of one constant tensor; write the sum of
        the members' sends of the pass before into it when every member's
        is known (True then)."""
        at_tensors, at_group, _ = ALL_REDUCE[name]
        x = args[at_tensors][0]
        group = group_of(args[at_group])
        k = self.count.get(group, 0)
        self.count[group] = k + 1
        self.sent.append({"group": list(group), "k": k, "input": x.detach().cpu().numpy().copy(),
                          "in_splits": None, "out_splits": None, "whole": True, "sum": True})
        total = None if self.previous is None else self.total(group, k, tuple(x.shape))
        if total is None:  # a member did not get this far in the pass before
            self.unanswered += 1
            return False
        with torch.no_grad():
            x.copy_(torch.as_tensor(total, dtype=x.dtype))
        return True

    def total(self, group: tuple[int, ...], k: int, shape: tuple[int, ...]) -> np.ndarray | None:
        """The sum of the members' inputs to the k-th collective on
        ``group`` (in float64, then written in the output's type: the
        counts summed are integers), None when a member's pass before
        stopped short of it."""
        out = np.zeros(shape, dtype=np.float64)
        for member in group:
            sends = [s for s in self.previous.get(member, []) if tuple(s["group"]) == group]
            if k >= len(sends) or not sends[k].get("sum"):
                return None
            if tuple(sends[k]["input"].shape) != shape:
                raise LoweringError(f"rank {self.rank}'s all-reduce on group {list(group)} of "
                                    f"{list(shape)} meets a member's of "
                                    f"{list(sends[k]['input'].shape)}")
            part = sends[k]["input"].astype(np.float64)
            if not np.array_equal(part, np.round(part)):
                raise LoweringError(f"rank {member}'s all-reduce of constants on group "
                                    f"{list(group)} sums numbers that are not integers: only "
                                    f"counts are answered (their sum is exact in any order)")
            out += part
        return out

    def answer(self, group: tuple[int, ...], k: int, shape: tuple[int, ...]) -> np.ndarray | None:
        """Member ``self.rank``'s output of the k-th constant all-to-all on
        ``group``: the rows every member's input sends it, in group order
        (None when some member's pass before stopped short of it)."""
        me = group.index(self.rank)
        pieces = []
        for member in group:
            sends = [s for s in self.previous.get(member, []) if tuple(s["group"]) == group]
            if k >= len(sends):
                return None
            s = sends[k]
            if s.get("whole"):
                pieces.append(s["input"].reshape(-1, *s["input"].shape[1:]) if s["input"].ndim
                              else s["input"].reshape(1))
                continue
            lo, hi = _cut(s["input"].shape[0], s["in_splits"], len(group))[me]
            pieces.append(s["input"][lo:hi])
        out = np.concatenate(pieces, axis=0)
        if tuple(out.shape) != shape:
            raise LoweringError(f"rank {self.rank}'s all-to-all on group {list(group)} expects "
                                f"{list(shape)}, its members send {list(out.shape)}")
        return out


def settled(before: dict[int, list[dict]], after: dict[int, list[dict]]) -> bool:
    """Every rank sent, in the later pass, exactly what it sent before."""
    if before.keys() != after.keys():
        return False
    for rank, sent in after.items():
        old = before[rank]
        if len(old) != len(sent):
            return False
        for a, b in zip(old, sent):
            if (a["group"], a["k"], a["in_splits"], a["out_splits"]) != \
                    (b["group"], b["k"], b["in_splits"], b["out_splits"]) or \
                    a["input"].shape != b["input"].shape or not np.array_equal(a["input"], b["input"]):
                return False
    return True


def _failed(traces: list[dict]) -> dict | None:
    return next((t for t in traces if "failed" in t), None)


def settle(trace: Callable[[dict | None], list[dict]]) -> list[dict]:
    """The ranks' traces (``trace(previous)``) once every constant all-to-all
    is answered with the members' sends of the pass that produced them:
    passes are repeated until the sends of two passes agree and every rank
    ran its step, at most ``PASSES`` (refused past them). A rank whose step
    fails on an unanswered exchange (shapes from the fake group's counts)
    returns what it sent so far (``failed``), which the next pass answers."""
    traces = trace(None)
    sent = {t["rank"]: t.get("exchanges", []) for t in traces}
    if not any(sent.values()):
        failed = _failed(traces)
        if failed is not None:
            raise LoweringError(f"rank {failed['rank']} did not run: {failed['failed']}")
        return traces
    for _ in range(PASSES - 1):
        traces = trace(sent)
        again = {t["rank"]: t.get("exchanges", []) for t in traces}
        failed = _failed(traces)
        if settled(sent, again):
            if failed is None and any(t.get("unanswered") for t in traces):
                failed = {"rank": next(t["rank"] for t in traces if t.get("unanswered")),
                          "failed": "an all-to-all of constants no member's send answers"}
            if failed is not None:
                raise LoweringError(f"rank {failed['rank']} did not run: {failed['failed']}")
            return traces
        sent = again
    raise LoweringError(f"the constants the ranks exchange by all-to-all did not settle in "
                        f"{PASSES} passes (docs/soundness.md, \"Plans traced from PyTorch\", 37 a)")

