"""All-reduces of exact zeros on every member of their group, written as
the zeros they give (docs/soundness.md, "Plans traced from PyTorch", 108
(d)).

A gradient buffer's region that no backward writes (a parameter its step
never reads, as the last pipeline stage's output-layer weight when the
output layer reads the embedding's) stays the zeros ``zero_grad_buffer``
wrote; DDP all-reduces it with its bucket. When every member of the group
all-reduces, as its k-th all-reduce over that group, zeros the step made
(a ``zeros`` node of no input) of one shape, the collective's output is
those zeros on every member: a sum of zeros is zeros, and so is their
mean. The k-th all-reduce is then replaced on every member by a ``zeros``
node making its output (so the members' remaining collectives still pair
by order), and the two nodes are dropped where nothing reads them and no
final value is theirs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from backends.torch.lowering.context import LNode, Lowered

#: the all-reduces a gradient bucket's piece goes through (SUM, AVG)
ALL_REDUCES = ("all_reduce", "all_reduce_avg")


def _zero_input(low: Lowered, node: LNode, made: dict[int, LNode]) -> LNode | None:
    """The ``zeros`` node of no input that ``node`` all-reduces, if any."""
    if node.op not in ALL_REDUCES or len(node.ins) != 1:
        return None
    maker = made.get(node.ins[0])
    return maker if maker is not None and maker.op == "zeros" and not maker.ins else None


def _ints(x: Any, out: set[int]) -> None:
    """Every int in ``x`` (nested lists, tuples, dicts): the values a final
    may name, kept conservatively (an offset counted too only keeps a node)."""
    if isinstance(x, bool):
        return
    if isinstance(x, int):
        out.add(x)
    elif isinstance(x, dict):
        for k, v in x.items():
            _ints(k, out)
            _ints(v, out)
    elif isinstance(x, (list, tuple, set, frozenset)):
        for v in x:
            _ints(v, out)


def final_nodes(low: Lowered) -> set[int]:
    """The nodes the step's compared values are read from (losses, gradients,
    updates, states, guards and the other recorded finals)."""
    out: set[int] = set()
    for field in (low.losses, low.grads, low.updates, low.states, low.grad_blocks, low.guards,
                  low.final_runs, low.range_sums, low.anchors, low.empty_sums, low.row_cuts,
                  getattr(low, "mixed", {})):
        _ints(field, out)
    return out


def drop_zero_reductions(lows: list[Lowered]) -> None:
    """Every all-reduce of zeros on every member of its group written as
    those zeros (the module's docstring), in place."""
    by_rank = {low.rank: low for low in lows}
    # each rank's all-reduces per group, in order: (index in nodes, its zeros maker or None)
    seq: dict[int, dict[tuple[int, ...], list[tuple[int, LNode | None]]]] = {}
    for low in lows:
        made = {o: n for n in low.nodes for o in n.outs}
        per: dict[tuple[int, ...], list[tuple[int, LNode | None]]] = defaultdict(list)
        for i, node in enumerate(low.nodes):
            if node.group is not None and node.op in ALL_REDUCES:
                per[tuple(node.group)].append((i, _zero_input(low, node, made)))
        seq[low.rank] = per
    replace: dict[int, set[int]] = defaultdict(set)  # rank -> node indices
    for low in lows:
        for group, reds in seq[low.rank].items():
            if low.rank != min(group) or any(q not in by_rank for q in group):
                continue
            for k in range(len(reds)):
                members = [seq[q][group][k] if k < len(seq[q][group]) else (-1, None)
                           for q in group]
                shapes = {tuple(by_rank[q].shapes[by_rank[q].nodes[i].outs[0]])
                          for q, (i, z) in zip(group, members) if z is not None}
                if all(z is not None for _, z in members) and len(shapes) == 1:
                    for q, (i, _) in zip(group, members):
                        replace[q].add(i)
    for rank, indices in replace.items():
        _replace(by_rank[rank], indices)


def _replace(low: Lowered, indices: set[int]) -> None:
    """Rank ``low``'s all-reduces at ``indices`` as ``zeros`` nodes; those and
    their zeros makers dropped where nothing reads them."""
    made = {o: n for n in low.nodes for o in n.outs}
    makers = {id(made[low.nodes[i].ins[0]]) for i in indices}
    for i in indices:
        node = low.nodes[i]
        out = node.outs[0]
        low.nodes[i] = LNode("zeros", "none", [], [out], {"shape": list(low.shapes[out])},
                             node.name, None, node.mb)
    keep = final_nodes(low)
    candidates = {id(low.nodes[i]) for i in indices} | makers
    changed = True
    while changed:
        read = {v for n in low.nodes for v in n.ins}
        dead = {id(n) for n in low.nodes if id(n) in candidates
                and not read.intersection(n.outs) and not keep.intersection(n.outs)}
        changed = bool(dead)
        low.nodes[:] = [n for n in low.nodes if id(n) not in dead]
