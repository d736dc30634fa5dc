"""Branches a rank takes on a number the single-device step never tests
(rank-only guards), settled when their outcome is the same on every input
of the proof's domain but a named, checked assumption (docs/soundness.md,
"Plans traced from PyTorch", 113 (f)).

Megatron's ``ChainedOptimizer.get_grad_norm`` (a MoE's dense and expert
optimizers) reads each part's gradient norm and keeps it only if it is
true (``_grad_norm if _grad_norm else 0.0``): Python reads the truth
value of a traced number, a guard ``number != 0`` the single-device step
(torch's optimizer) has no counterpart of. A norm is a square root of a
sum of squares: it is 0 exactly when every value squared is 0, so the
branch taken (true) is the branch of every input on which the values it
squares are not all zero. That is the assumption such a SUCCESS adds to
the branches it covers, printed with them; any other rank-only guard is
refused, named."""

from __future__ import annotations

from backends.torch.lowering import LNode, Lowered

#: ops whose output is zero everywhere exactly when their inputs are
#: (sums of nonnegative terms, moves and views of them)
SUMS = {"add", "sum", "all_reduce", "cat", "stack", "reshape", "view", "expand", "clone",
        "squeeze", "unsqueeze", "contiguous", "alias", "detach"}


def _producers(low: Lowered) -> dict[int, LNode]:
    return {o: n for n in low.nodes for o in n.outs}


def squared_values(low: Lowered, v: int) -> list[int] | None:
    """The values a number squares and adds up, when it is such a norm:
    built from squares (``x * x``, ``x ** 2``) by sums, sum all-reduces,
    moves and nonnegative powers of such sums (a square root); it is then
    nonnegative and zero exactly when every value listed is zero. None
    when it is not built so."""
    made = _producers(low)
    leaves: list[int] = []

    def walk(x: int) -> bool:
        node = made.get(x)
        if node is None:
            return False
        exponent = node.kwargs.get("exponent")
        if node.op == "mul" and len(node.ins) == 2 and node.ins[0] == node.ins[1]:
            leaves.append(node.ins[0])
            return True
        if node.op == "pow" and exponent == 2.0:
            leaves.append(node.ins[0])
            return True
        if node.op == "pow" and isinstance(exponent, float) and exponent > 0:
            return walk(node.ins[0])
        if node.op in SUMS and node.ins:
            return all(walk(i) for i in node.ins)
        return False

    return leaves if walk(v) else None


def settle_rank_only(single: Lowered, ranks: list[Lowered]) -> list[str]:
    """Each rank's guards at code the single-device step never branches at
    (its location, the guard's last field, not among the single-device
    step's) taken out of the rank's guards when each is a norm's truth
    value taken true (``number != 0``, true: the values it squares not all
    zero); the assumptions they add, one line each. Any other rank-only
    guard is kept, for ``guards.same_branches`` to refuse, named. A rank whose branches are already the
    single-device step's is left as it is."""
    at = {g[4] for g in single.guards}
    want = [g[1:4] for g in single.guards]
    assumed: list[str] = []
    for low in ranks:
        if [g[1:4] for g in low.guards] == want:
            continue  # the single-device step's branches: item 70 as before
        kept = []
        for guard in low.guards:
            v, name, other, taken, where = guard
            if where in at:
                kept.append(guard)
                continue
            if (name, float(other), taken) != ("ne", 0.0, True) \
                    or squared_values(low, v) is None:
                kept.append(guard)  # not settled: ``same_branches`` refuses it, named
                continue
            line = (f"{where}: a norm on rank {low.rank} is not 0 (the values it squares, "
                    f"over the ranks it is reduced over, are not all zero)")
            if line not in assumed:
                assumed.append(line)
        low.guards[:] = kept
    return assumed


def drop_unread_norms(lows: list[Lowered]) -> None:
    """After rank-only guards are settled: the nodes that reach no final
    value (loss, gradient, update, state, block, remaining guard) dropped,
    an all-reduce among them only where every member of its group leaves
    its output (at the same place in the group's order) unread, so the
    members still meet at the same collectives (the number a chained
    optimizer returns for logging, its parts' norms reduced over their
    groups, read by nothing the step compares). What is dropped changes
    no value that is compared; in place."""
    from backends.torch.lowering.zero_reductions import ALL_REDUCES
    from backends.torch.lowering.zero_reductions import final_nodes as finals_of
    by_rank = {low.rank: low for low in lows}
    kept = {(low.rank, i) for low in lows for i, n in enumerate(low.nodes)
            if n.group is not None}
    while True:
        read: dict[int, dict[tuple[int, ...], list[bool]]] = {}
        for low in lows:
            need = finals_of(low)
            per: dict[tuple[int, ...], list[bool]] = {}
            for i in reversed(range(len(low.nodes))):
                node = low.nodes[i]
                wanted = bool(need.intersection(node.outs))
                if node.group is not None and node.op in ALL_REDUCES:
                    per.setdefault(tuple(node.group), []).insert(0, wanted)
                if wanted or (low.rank, i) in kept:
                    need.update(v for v in node.ins if v >= 0)
            read[low.rank] = per
        dropped = set()
        for low in lows:
            k_of: dict[tuple[int, ...], int] = {}
            for i, node in enumerate(low.nodes):
                if node.group is None or node.op not in ALL_REDUCES:
                    continue
                group = tuple(node.group)
                k = k_of[group] = k_of.get(group, -1) + 1
                if (low.rank, i) in kept and all(q in by_rank and len(read[q].get(group, [])) > k
                       and not read[q][group][k] for q in group):
                    dropped.add((low.rank, i))
        if not dropped:
            break
        kept -= dropped
    for low in lows:
        need = finals_of(low)
        live = []
        for i in reversed(range(len(low.nodes))):
            node = low.nodes[i]
            if need.intersection(node.outs) or ((low.rank, i) in kept):
                live.append(node)
                need.update(v for v in node.ins if v >= 0)
        low.nodes[:] = live[::-1]
