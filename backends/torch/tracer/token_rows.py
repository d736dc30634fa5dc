"""The single-device step written in the ranks' order of the token rows, and
every rank's flatten of its rows written as the same chain of shape ops
(docs/soundness.md, "Plans traced from PyTorch", 89).

``tracer/token_order.py`` gives the order and its chain. Here both traces
are rewritten before the plans are built: each flatten that makes the
token rows of a routed module (``[outer, inner, ...]`` -> ``[rows, ...]``)
becomes the chain (unflatten the cut dims into (parts, rows of a part),
transpose the parts' axes to the front, flatten), each unflatten that
unmakes them the inverse chain. On a rank every part is one: its chain
moves only dims of size 1 and is the identity. On one device the chain is
pi; the nodes between are checked to commute with pi (``_Region``, the
checks of ``seq_order.Reorder`` on the rows), the recorded constants they
read along the rows are relabelled, and the step's outputs must carry no
rows. Anything else is refused in one line (exit 2)."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import LNode, Lowered
from backends.torch.tracer.seq_order import POSITIONWISE, CarriedConstants
from backends.torch.tracer.token_order import RowGrid, check_blocks, held_rows
from verdict.reduce import node_relations

#: operators that commute with a permutation of the rows beyond the load
#: balancer's list: a broadcast keeps each row's values
ROWWISE = POSITIONWISE | {"expand"}


def _refuse(why: str) -> LoweringError:
    return LoweringError(f"the ranks' order of the token rows: {why}; not verified "
                         f"(docs/soundness.md, \"Plans traced from PyTorch\", 89)")


def _module(name: str) -> str:
    return name[3:] if name.startswith("bw:") else name


def routed_modules(low: Lowered, rows: int) -> set[str]:
    """The modules that read a recorded constant with a dim of ``rows``
    token rows (or of (token, slot) pairs): the routing's readers."""
    names = set()
    for node in low.nodes:
        for v in node.ins:
            if v in low.constants and any(n >= rows and n % rows == 0 for n in low.shapes[v]):
                names.add(_module(node.name))
    return names


def _is_entry(node: LNode, low: Lowered, sizes: tuple[int, int], modules: set[str]) -> bool:
    return node.op == "flatten" and node.kwargs.get("start") == 0 \
        and node.kwargs.get("end") == 1 and _module(node.name) in modules \
        and tuple(low.shapes[node.ins[0]][:2]) == sizes


def _is_exit(node: LNode, low: Lowered, sizes: tuple[int, int], modules: set[str]) -> bool:
    return node.op == "unflatten" and node.kwargs.get("dim") == 0 \
        and list(node.kwargs.get("sizes", ())) == list(sizes) and _module(node.name) in modules


class _Chains:
    """Writes a trace's entries and exits as chains, with fresh values. The
    chain's ops follow the one-device cut ``parts``; on a rank (``local``)
    each cut dim is split into one part of all its rows."""

    def __init__(self, low: Lowered, parts: tuple[int, int], inner_first: bool, local: bool):
        self.low, self.parts, self.inner_first = low, parts, inner_first
        self.sizes = (1, 1) if local else parts
        self.next = max(low.shapes) + 1

    def value(self, shape: tuple[int, ...]) -> int:
        v = self.next
        self.next += 1
        self.low.shapes[v] = tuple(shape)
        return v

    def node(self, like: LNode, op: str, src: int, shape: tuple[int, ...], out: int | None,
             **kwargs) -> tuple[LNode, int]:
        dst = self.value(shape) if out is None else out
        return LNode(op, "fw", [src], [dst], kwargs, like.name, like.group, like.mb), dst

    def entry(self, node: LNode) -> list[LNode]:
        """``[o, i, *rest]`` -> the cut dims split into (parts, rows of a
        part) -> the parts' axes first, in claim order -> ``[o * i, *rest]``."""
        shape = tuple(self.low.shapes[node.ins[0]])
        (o, i), rest = shape[:2], shape[2:]
        qo, qi = self.sizes
        if self.inner_first and self.parts[0] == 1:  # [o, qi, li] -> [qi, o, li]
            a, s1 = self.node(node, "unflatten", node.ins[0], (o, qi, i // qi, *rest), None,
                              dim=1, sizes=[qi, i // qi])
            b, s2 = self.node(node, "transpose", s1, (qi, o, i // qi, *rest), None,
                              dim0=0, dim1=1)
            c, _ = self.node(node, "flatten", s2, (o * i, *rest), node.outs[0], start=0, end=2)
            return [a, b, c]
        # [qo, lo, qi, li] -> [qo, qi, lo, li]; both dims cut with the inner's parts first
        # (Megatron's [s, b] at dp x tp with sequence parallelism): -> [qi, qo, lo, li]
        a, s1 = self.node(node, "unflatten", node.ins[0], (qo, o // qo, i, *rest), None,
                          dim=0, sizes=[qo, o // qo])
        b, s2 = self.node(node, "unflatten", s1, (qo, o // qo, qi, i // qi, *rest), None,
                          dim=2, sizes=[qi, i // qi])
        c, s3 = self.node(node, "transpose", s2, (qo, qi, o // qo, i // qi, *rest), None,
                          dim0=1, dim1=2)
        made = [a, b, c]
        if self.inner_first:
            d, s3 = self.node(node, "transpose", s3, (qi, qo, o // qo, i // qi, *rest), None,
                              dim0=0, dim1=1)
            made.append(d)
        last, _ = self.node(node, "flatten", s3, (o * i, *rest), node.outs[0], start=0, end=3)
        return [*made, last]

    def exit(self, node: LNode) -> list[LNode]:
        """The inverse chain: ``[o * i, *rest]`` -> parts first -> back to
        ``[o, i, *rest]``."""
        o, i = node.kwargs["sizes"]
        rest = tuple(self.low.shapes[node.ins[0]][1:])
        qo, qi = self.sizes
        if self.inner_first and self.parts[0] > 1:
            # [qi, qo, lo, li] -> [qo, qi, lo, li] -> [qo, lo, qi, li] -> [o, i]
            a, s1 = self.node(node, "unflatten", node.ins[0], (qi, qo, o // qo, i // qi, *rest),
                              None, dim=0, sizes=[qi, qo, o // qo, i // qi])
            b, s2 = self.node(node, "transpose", s1, (qo, qi, o // qo, i // qi, *rest), None,
                              dim0=0, dim1=1)
            c, s3 = self.node(node, "transpose", s2, (qo, o // qo, qi, i // qi, *rest), None,
                              dim0=1, dim1=2)
            d, s4 = self.node(node, "flatten", s3, (o, qi, i // qi, *rest), None, start=0, end=1)
            e, _ = self.node(node, "flatten", s4, (o, i, *rest), node.outs[0], start=1, end=2)
            return [a, b, c, d, e]
        if self.inner_first:  # [qi, o, li] -> [o, qi, li] -> [o, i]
            a, s1 = self.node(node, "unflatten", node.ins[0], (qi, o, i // qi, *rest), None,
                              dim=0, sizes=[qi, o, i // qi])
            b, s2 = self.node(node, "transpose", s1, (o, qi, i // qi, *rest), None,
                              dim0=0, dim1=1)
            c, _ = self.node(node, "flatten", s2, (o, i, *rest), node.outs[0], start=1, end=2)
            return [a, b, c]
        # [qo, qi, lo, li] -> [qo, lo, qi, li] -> [o, i]
        a, s1 = self.node(node, "unflatten", node.ins[0], (qo, qi, o // qo, i // qi, *rest),
                          None, dim=0, sizes=[qo, qi, o // qo, i // qi])
        b, s2 = self.node(node, "transpose", s1, (qo, o // qo, qi, i // qi, *rest), None,
                          dim0=1, dim1=2)
        c, s3 = self.node(node, "flatten", s2, (o, qi, i // qi, *rest), None, start=0, end=1)
        d, _ = self.node(node, "flatten", s3, (o, i, *rest), node.outs[0], start=1, end=2)
        return [a, b, c, d]


def write_chains(low: Lowered, sizes: tuple[int, int], parts: tuple[int, int],
                 inner_first: bool, modules: set[str],
                 local: bool = False) -> tuple[list[int], list[int]]:
    """Rewrite ``low`` in place: its entries and exits of token rows of
    ``sizes`` (its own) as chains of ``parts`` (1 on a rank, the cut on one
    device). The values the entry chains make (rows first) and the nodes of
    the chains, entries and exits, by index in the new node list."""
    entries = {k for k, node in enumerate(low.nodes) if _is_entry(node, low, sizes, modules)}
    exits = {k for k, node in enumerate(low.nodes) if _is_exit(node, low, sizes, modules)}
    seeds, chained, _ = write_chains_at(low, parts, inner_first, entries, exits, local)
    return seeds, chained


def write_chains_at(low: Lowered, parts: tuple[int, int], inner_first: bool,
                    entries: set[int], exits: set[int],
                    local: bool = False) -> tuple[list[int], list[int], list[int]]:
    """``write_chains`` at given nodes: the flattens ``entries`` and the
    unflattens ``exits`` (indices in ``low.nodes``) written as chains. Also
    where each node of the new list came from (its old index, -1 for a
    chain's node)."""
    chains = _Chains(low, parts, inner_first, local)
    nodes: list[LNode] = []
    seeds: list[int] = []
    chained: list[int] = []
    origin: list[int] = []
    for k, node in enumerate(low.nodes):
        if k in entries or k in exits:
            made = chains.entry(node) if k in entries else chains.exit(node)
            chained += range(len(nodes), len(nodes) + len(made))
            nodes += made
            origin += [-1] * len(made)
            if k in entries:
                seeds.append(node.outs[0])
        else:
            nodes.append(node)
            origin.append(k)
    low.nodes[:] = nodes
    return seeds, chained, origin


class _Region(CarriedConstants):
    """``seq_order``'s node-by-node check on the token rows: seeded at the
    entry chains' outputs, stopped at the exit chains; a recorded constant
    tied to the rows is relabelled (and then checked at every reader like
    any value carrying them)."""

    allowed = ROWWISE
    ordered: frozenset[str] = frozenset()

    def __init__(self, plan: SimpleNamespace, rows: int, seeds: list[int],
                 constants: set[int]):
        super().__init__(plan, rows, seeds, 0, constants)

    def refuse(self, index: int, why: str) -> None:
        node = self.plan.nodes[index]
        raise _refuse(f"the single-device step's {node.op} at {node.name or 'step'} {why}")


def flattens_rows(op: str, kwargs: dict, shape: tuple[int, ...],
                  sizes: tuple[int, int]) -> bool:
    """A flatten of the two dims of ``sizes`` into token rows."""
    return op == "flatten" and kwargs.get("start") == 0 and kwargs.get("end") == 1 \
        and tuple(shape[:2]) == tuple(sizes)


def unflattens_rows(op: str, kwargs: dict, sizes: tuple[int, int]) -> bool:
    """An unflatten of token rows back into the two dims of ``sizes``."""
    return op == "unflatten" and kwargs.get("dim") == 0 \
        and tuple(kwargs.get("sizes", ())) == tuple(sizes)


class _Promote(Exception):
    """A flatten that makes the token rows found to be an entry (the rows
    carried back to its output), or an unflatten of them an exit (the rows
    reach its input): the chains are written again with it."""

    def __init__(self, index: int, kind: str):
        super().__init__(f"{kind} at node {index}")
        self.index, self.kind = index, kind


class _Growing(_Region):
    """``_Region`` whose rows also reach back: a value tied to the rows that
    a node reads but does not make (and that carries no rows yet) is marked
    as carrying them, and its producer is checked with it in the next pass
    like any node. A flatten of the token rows so reached is an entry, an
    unflatten the rows reach an exit (``_Promote``); a chain's node, an
    input of the step or a rank's value is never reached back. ``origin``
    maps the nodes to their index before the chains were written."""

    def __init__(self, plan: SimpleNamespace, rows: int, seeds: list[int],
                 constants: set[int], chained: set[int], origin: list[int],
                 sizes: tuple[int, int]):
        super().__init__(plan, rows, seeds, constants)
        self.chained, self.origin, self.sizes = chained, origin, sizes
        self.producer = {t: k for k, node in enumerate(plan.nodes) for t in node.outputs}
        #: dims marked by reaching back: their producer must relate them
        self.carried: set[tuple[int, int]] = set()

    def node(self, index: int) -> None:
        node = self.plan.nodes[index]
        if unflattens_rows(node.op, node.kwargs, self.sizes) \
                and (node.inputs[0], 0) in self.seq:
            if self.seq[(node.inputs[0], 0)] != (1, 1):
                self.refuse(index, "unflattens token rows that are part of a dim")
            raise _Promote(self.origin[index], "exit")
        super().node(index)
        marked = [(t, d) for t in node.outputs if t >= 0
                  for d in range(len(self.plan.tensors[t].shape))
                  if (t, d) in self.carried]
        if not marked:
            return
        # tied to a dim it reads by its rule's "eq" or "mul" (a bound, a
        # narrow's "min", is no tie): else made from no row it reads
        refs = {r for rel in node_relations(self.plan, node, self.memo)
                for r in ([rel[1], rel[2]] if rel[0] == "eq" else
                          [rel[1], *rel[2]] if rel[0] == "mul" else [])}
        if any(ref not in refs for ref in marked):
            self.refuse(index, "makes a value carrying token rows from no dim it reads")

    def carry(self, index: int, ref: tuple[int, int], place: tuple[int, int],
              why: str) -> bool:
        k = self.producer.get(ref[0])
        if k is None or k in self.chained or ref[0] in self.inputs:
            return super().carry(index, ref, place, why)
        node = self.plan.nodes[k]
        if flattens_rows(node.op, node.kwargs, self.plan.tensors[node.inputs[0]].shape,
                         self.sizes):
            if ref[1] != 0 or place != (1, 1):
                self.refuse(k, "makes token rows that are read as part of a dim")
            raise _Promote(self.origin[k], "entry")
        self.seq[ref] = place
        self.carried.add(ref)
        return True


def _shim(low: Lowered) -> SimpleNamespace:
    tensors = {v: SimpleNamespace(shape=tuple(s)) for v, s in low.shapes.items()}
    nodes = [SimpleNamespace(op=n.op, dir=n.dir, inputs=list(n.ins), outputs=list(n.outs),
                             kwargs=n.kwargs, name=n.name) for n in low.nodes]
    return SimpleNamespace(tensors=tensors, nodes=nodes)


def check_and_relabel(low: Lowered, rows: int, seeds: list[int], exits: list[int],
                      pi: np.ndarray, grow: tuple[list[int], tuple[int, int]] | None = None
                      ) -> int:
    """Check every node of the one-device trace between the entry and exit
    chains to commute with the order ``pi`` of the rows (refused in one
    line otherwise) and relabel the recorded constants it reads along the
    rows; the number relabelled. With ``grow`` (the nodes' origins and the
    sizes of the two dims) the rows are carried back to the producers of
    values tied to them (``_Growing``: raises ``_Promote``)."""
    plan = _shim(low)
    if grow is None:
        region = _Region(plan, rows, seeds, set(low.constants))
    else:
        region = _Growing(plan, rows, seeds, set(low.constants), set(exits), *grow)
    skip = set(exits)
    found = -1
    while found != len(region.seq):
        # again until nothing more carries the rows: a value found to carry
        # them late (computed from constants) is checked at every reader
        found = len(region.seq)
        for index in range(len(plan.nodes)):
            if index not in skip:
                region.node(index)
    finals = set(low.losses) | {v for v in low.grads.values() if v is not None} \
        | set(low.updates.values())
    for v, d in region.seq:
        if v in finals:
            raise _refuse(f"the step's result of shape {list(low.shapes[v])} carries token "
                          f"rows along dim {d}")
    for (v, d), (o, i) in region.relabel.items():
        const = np.asarray(low.constants[v])
        shape = const.shape
        grid = const.reshape(*shape[:d], o, rows, i, *shape[d + 1:])
        low.constants[v] = np.take(grid, pi, axis=d + 1).reshape(shape)
    return len(region.relabel)


def _entries(low: Lowered, sizes: tuple[int, int]) -> int:
    """How many flattens make token rows of ``sizes`` in the routed modules."""
    modules = routed_modules(low, math.prod(sizes))
    return sum(_is_entry(node, low, sizes, modules) for node in low.nodes)


def order_rows(low_s: Lowered, lows: list[Lowered], grid: RowGrid,
               local: dict[int, tuple[int, int]]) -> bool:
    """Write the one-device trace in the ranks' order of its token rows and
    every rank's rows as its block of it (``local``: each rank's own sizes
    of the two dims). False, nothing written, when no rank flattens rows of
    its sizes (its token rows are another block: the dims it holds whole,
    claimed as before). Refused in one line where the argument does not
    reach."""
    if not any(_entries(low, local[low.rank]) for low in lows):
        return False
    modules = routed_modules(low_s, grid.rows)
    if not modules:
        raise _refuse("no module reads the routing along the token rows")
    seeds, exits = write_chains(low_s, grid.sizes, grid.parts, grid.inner_first, modules)
    if not seeds:
        raise _refuse("no flatten makes the token rows of the routed modules")
    check_and_relabel(low_s, grid.rows, seeds, exits, grid.order())
    for low in lows:
        sizes = local[low.rank]
        made, _ = write_chains(low, sizes, grid.parts, grid.inner_first,
                               routed_modules(low, math.prod(sizes)), local=True)
        if len(made) != len(seeds):
            raise _refuse(f"rank {low.rank} makes its token rows {len(made)} times, the "
                          f"single-device step {len(seeds)} times")
    return True


def _is_forward(node: LNode) -> bool:
    return not node.name.startswith("bw:")


def _first_shape(low: Lowered, node: LNode) -> tuple[int, ...]:
    """The shape of a node's first input (none for a node that reads none)."""
    return tuple(low.shapes[node.ins[0]]) if node.ins and node.ins[0] >= 0 else ()


def _unrooted(name: str) -> str:
    """A module's path without its root class (which wrappers rename), and
    without the attribute a wrapper holds the model at (Megatron's DDP
    ``module``, the backend's one-device ``model``)."""
    path = name.split(".", 1)[-1]
    for wrapped in ("module.", "model."):
        if path.startswith(wrapped):
            return path[len(wrapped):]
    return path


def _routing_layers(low: Lowered, rows: int) -> set[str]:
    """The layers that route: the parents of the modules whose forward reads
    a recorded constant of the token rows (the router, the experts)."""
    names = set()
    for node in low.nodes:
        if _is_forward(node) and any(v in low.constants and any(
                n >= rows and n % rows == 0 for n in low.shapes[v]) for v in node.ins):
            names.add(_unrooted(node.name).rsplit(".", 1)[0])
    return names


def _rank_flattens(low: Lowered, local: tuple[int, int], seqlen: int,
                   sequence_first: bool = False) -> dict[str, list[bool]]:
    """A rank's forward flattens of its batch rows by module inside the
    layers that route, in order (those of its own positions, True, and of
    all positions, False), for the modules with one of its own positions."""
    layers = _routing_layers(low, local[0] * local[1])
    marks: dict[str, list[bool]] = {}
    for node in low.nodes:
        shape = _first_shape(low, node)
        name = _unrooted(node.name)
        if not (_is_forward(node) and len(shape) >= 2
                and any(name == m or name.startswith(m + ".") for m in layers)):
            continue
        if sequence_first:  # [s, b]: the positions are the outer dim
            if shape[0] in (local[0], seqlen) \
                    and flattens_rows(node.op, node.kwargs, shape, (shape[0], local[1])):
                marks.setdefault(name, []).append(shape[0] == local[0])
        elif shape[1] in (local[1], seqlen) \
                and flattens_rows(node.op, node.kwargs, shape, (local[0], shape[1])):
            marks.setdefault(name, []).append(shape[1] == local[1])
    return {name: flags for name, flags in marks.items() if any(flags)}


def paired_entries(low_s: Lowered, lows: list[Lowered], grid: RowGrid,
                   local: dict[int, tuple[int, int]]) -> set[int]:
    """The one-device forward flattens of the token rows that stand where
    the ranks flatten their own rows (their block of both dims): the k-th
    flatten of the rows in a module is one when each rank's k-th flatten of
    its batch rows there is of its own positions (not of all positions,
    gathered). A module's pairing is read from the ranks that flatten their
    batch rows there as many times as the one-device step flattens the rows
    (a rank whose own program flattens them more or fewer times there, a
    hook of its own, is paired by ``_rank_chains``): the choice decides only
    what the ranks' values are claimed to be (docs/soundness.md, "Plans
    traced from PyTorch", 98 (c), 124). Refused in one line where those
    ranks differ, or where no rank flattens a module's rows as often as the
    one-device step."""
    marks = {low.rank: _rank_flattens(low, local[low.rank],
                                      grid.sizes[0 if grid.inner_first else 1],
                                      grid.inner_first) for low in lows}
    names = sorted({name for flags in marks.values() for name in flags})
    entries: set[int] = set()
    for name in names:
        found = [k for k, node in enumerate(low_s.nodes) if _unrooted(node.name) == name
                 and _is_forward(node)
                 and flattens_rows(node.op, node.kwargs, _first_shape(low_s, node), grid.sizes)]
        paired = {rank: flags.get(name, []) for rank, flags in marks.items()
                  if len(flags.get(name, [])) == len(found)}
        if not paired:
            counts = sorted({len(flags.get(name, [])) for flags in marks.values()})
            raise _refuse(f"{name} flattens the token rows {len(found)} times on one device, "
                          f"its batch rows {' or '.join(map(str, counts))} times on the ranks")
        first, *rest = sorted(paired)
        for rank in rest:
            if paired[rank] != paired[first]:
                raise _refuse(f"rank {rank} flattens its own token rows in {name} at other "
                              f"flattens than rank {first}")
        entries |= {k for k, own in zip(found, paired[first]) if own}
    return entries


def grow_chains(low_s: Lowered, grid: RowGrid,
                entries: set[int]) -> tuple[set[int], set[int]]:
    """Write the one-device trace in the ranks' order from the forward
    ``entries``, the exits and the backward's entries found by reaching the
    rows back (``_Growing``), written again until the check passes; the
    entries and exits (indices in the trace as it was)."""
    nodes, shapes = list(low_s.nodes), dict(low_s.shapes)
    entries, exits = set(entries), set()
    while True:
        low_s.nodes[:] = nodes
        low_s.shapes.clear()
        low_s.shapes.update(shapes)
        seeds, chained, origin = write_chains_at(low_s, grid.parts, grid.inner_first,
                                                 entries, exits)
        try:
            check_and_relabel(low_s, grid.rows, seeds, chained, grid.order(),
                              grow=(origin, grid.sizes))
            return entries, exits
        except _Promote as found:
            (entries if found.kind == "entry" else exits).add(found.index)


def order_rows_paired(low_s: Lowered, lows: list[Lowered], grid: RowGrid,
                      local: dict[int, tuple[int, int]]) -> bool:
    """``order_rows`` for rows (batch, position) cut over dp and tp, whose
    entries are not found by module alone: on one device the forward
    flattens paired with the ranks' flattens of their own rows
    (``paired_entries``), the rest found by reaching the rows back
    (``grow_chains``); on every rank each flatten of its own rows and each
    unflatten back to them, as many as on one device. False, nothing
    written, when no rank flattens its own rows."""
    entries = paired_entries(low_s, lows, grid, local)
    if not entries:
        return False
    where = {k: key for key, k in row_ops(low_s, grid.sizes).items()}
    chosen = grow_chains(low_s, grid, entries)
    # a chain at a node of no key (none seen) can be paired by count only
    wanted = [{where.get(k, ("", "", k)) for k in part} for part in chosen]
    for low in lows:
        write_chains_at(low, grid.parts, grid.inner_first, *_rank_chains(low, local[low.rank],
                                                                         wanted), local=True)
    return True


def _rank_chains(low: Lowered, sizes: tuple[int, int],
                 wanted: list[set[tuple[str, str, int]]]) -> tuple[set[int], set[int]]:
    """Where a rank's chains go: every flatten of its token rows and every
    unflatten back to them when there are as many as the single-device
    step's chains (sequence parallelism: the rank's other flattens are of
    gathered positions); else (context parallelism: its attention and loss
    flatten rows of its sizes too) the rank's nodes of the single-device
    chains' keys (``row_ops``); else, when that makes as many, those left
    once the pairs of an unflatten and the flattens back that alone read it
    are taken out (``_undone_pairs``). Refused in one line when none holds."""
    ops = row_ops(low, sizes)
    made = tuple({k for key, k in ops.items() if key[1] == kind}
                 for kind in ("flatten", "unflatten"))
    if (len(made[0]), len(made[1])) == (len(wanted[0]), len(wanted[1])):
        return made
    if ops.keys() >= wanted[0] | wanted[1]:
        return tuple({ops[key] for key in part} for part in wanted)
    # a rank's own reshape of its rows read back by flattens alone (a hook's
    # reshape(-1, K) of its rows, put back in their shape and flattened again
    # by the module): each such pair is the identity, so neither is a chain's site
    undone = _undone_pairs(low, sizes)
    kept = tuple(part - undone for part in made)
    if undone and (len(kept[0]), len(kept[1])) == (len(wanted[0]), len(wanted[1])):
        return kept
    raise _refuse(f"rank {low.rank} flattens its token rows {len(made[0])} times and "
                  f"unflattens them {len(made[1])} times, not where the single-device step "
                  f"does ({len(wanted[0])} and {len(wanted[1])} times)")


def _undone_pairs(low: Lowered, sizes: tuple[int, int]) -> set[int]:
    """A rank's unflattens of its token rows whose every reader is a flatten
    of them back, with those readers (indices): each unflatten and flatten
    so paired compose to the identity (docs/soundness.md, "Plans traced
    from PyTorch", 124)."""
    readers: dict[int, list[int]] = {}
    for k, node in enumerate(low.nodes):
        for v in node.ins:
            readers.setdefault(v, []).append(k)
    undone: set[int] = set()
    for k, node in enumerate(low.nodes):
        if not unflattens_rows(node.op, node.kwargs, sizes):
            continue
        after = readers.get(node.outs[0], [])
        if after and all(flattens_rows(low.nodes[r].op, low.nodes[r].kwargs,
                                       _first_shape(low, low.nodes[r]), sizes) for r in after):
            undone |= {k, *after}
    return undone


def row_ops(low: Lowered, sizes: tuple[int, int]) -> dict[tuple[str, str, int], int]:
    """Each flatten of token rows of ``sizes`` and each unflatten back to
    them, by (module, "flatten" or "unflatten", its number among that
    module's of its kind) -> index: the key pairing a rank's with the
    single-device step's (a rank under context parallelism flattens rows of
    its sizes outside the routed layers too: its attention, its loss)."""
    found: dict[tuple[str, str, int], int] = {}
    seen: Counter[tuple[str, str]] = Counter()
    for k, node in enumerate(low.nodes):
        if flattens_rows(node.op, node.kwargs, _first_shape(low, node), sizes):
            kind = "flatten"
        elif unflattens_rows(node.op, node.kwargs, sizes):
            kind = "unflatten"
        else:
            continue
        key = (_unrooted(node.name), kind)
        found[(*key, seen[key])] = k
        seen[key] += 1
    return found


def order_token_rows(single: dict, low_s: Lowered, lows: list[Lowered], dp: int,
                     tp: int, cp: int = 1) -> bool:
    """A routed step whose ranks' token rows are no block of the flattened
    rows, written in the ranks' order (each rank's rows found to be one
    block of it): Megatron-Core's sequence-first rows ``[s, b]`` at dp > 1
    and tp 1 (each dp rank's batch block at every position), and rows
    (batch, position) at dp > 1 and tp > 1 with the positions cut by tp
    (torchtitan's sequence parallelism), block ``d * tp + t``; and rows
    (batch, position) with the positions cut by context parallelism (cp > 1,
    tp 1, any dp: each rank's batch block at its chunk of the sequence),
    block ``d * cp + c`` (item 115). False when the rows need no order."""
    if not single.get("routing") or (dp <= 1 and cp <= 1):
        return False
    tokens = single["batch_ids"]["tokens"]
    batch, seqlen = int(tokens.shape[0]), int(tokens.shape[1])
    seq_axis = "tp"
    if single.get("sequence_first"):
        if cp > 1:
            raise _refuse("sequence-first token rows cut by context parallelism")
        grid = RowGrid((seqlen, batch), (tp, dp), inner_first=True)
    elif cp > 1:
        if tp > 1:
            raise _refuse("token rows whose positions are cut by both tp and cp")
        grid, seq_axis = RowGrid((batch, seqlen), (dp, cp)), "cp"
    elif tp > 1:
        grid = RowGrid((batch, seqlen), (dp, tp))
    else:
        return False
    (lo, li) = (grid.sizes[0] // grid.parts[0], grid.sizes[1] // grid.parts[1])
    held = {}
    for low in lows:
        d, t = low.coords.get("dp", 0), low.coords.get(seq_axis, 0)
        o, i = (t if tp > 1 else 0, d) if grid.inner_first else (d, t)
        held[low.rank] = held_rows(grid, np.arange(o * lo, (o + 1) * lo),
                                   np.arange(i * li, (i + 1) * li))
    check_blocks(grid, held)
    local = {low.rank: (lo, li) for low in lows}
    if grid.inner_first and tp == 1:
        return order_rows(low_s, lows, grid, local)
    return order_rows_paired(low_s, lows, grid, local)
