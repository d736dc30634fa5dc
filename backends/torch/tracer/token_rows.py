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
from types import SimpleNamespace

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.context import LNode, Lowered
from backends.torch.tracer.seq_order import POSITIONWISE, Reorder
from backends.torch.tracer.token_order import RowGrid, check_blocks, held_rows
from verdict.reduce import RuleMemo

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
        if not self.inner_first:  # [qo, lo, qi, li] -> [qo, qi, lo, li]
            a, s1 = self.node(node, "unflatten", node.ins[0], (qo, o // qo, i, *rest), None,
                              dim=0, sizes=[qo, o // qo])
            b, s2 = self.node(node, "unflatten", s1, (qo, o // qo, qi, i // qi, *rest), None,
                              dim=2, sizes=[qi, i // qi])
            c, s3 = self.node(node, "transpose", s2, (qo, qi, o // qo, i // qi, *rest), None,
                              dim0=1, dim1=2)
            d, _ = self.node(node, "flatten", s3, (o * i, *rest), node.outs[0], start=0, end=3)
            return [a, b, c, d]
        raise _refuse(f"{node.name}: rows cut as {self.parts}, the inner dim's parts first, "
                      f"are not laid out by a chain")

    def exit(self, node: LNode) -> list[LNode]:
        """The inverse chain: ``[o * i, *rest]`` -> parts first -> back to
        ``[o, i, *rest]``."""
        o, i = node.kwargs["sizes"]
        rest = tuple(self.low.shapes[node.ins[0]][1:])
        qo, qi = self.sizes
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
    chains = _Chains(low, parts, inner_first, local)
    nodes: list[LNode] = []
    seeds: list[int] = []
    exits: list[int] = []
    for node in low.nodes:
        if _is_entry(node, low, sizes, modules):
            made = chains.entry(node)
            exits += range(len(nodes), len(nodes) + len(made))
            nodes += made
            seeds.append(node.outs[0])
        elif _is_exit(node, low, sizes, modules):
            made = chains.exit(node)
            exits += range(len(nodes), len(nodes) + len(made))
            nodes += made
        else:
            nodes.append(node)
    low.nodes[:] = nodes
    return seeds, exits


class _Region(Reorder):
    """``seq_order``'s node-by-node check on the token rows: seeded at the
    entry chains' outputs, stopped at the exit chains; a recorded constant
    tied to the rows is relabelled (and then checked at every reader like
    any value carrying them)."""

    allowed = ROWWISE
    ordered: frozenset[str] = frozenset()

    def __init__(self, plan: SimpleNamespace, rows: int, seeds: list[int],
                 constants: set[int]):
        self.plan, self.s = plan, rows
        self.seq = {(v, 0): (1, 1) for v in seeds}
        self.memo = RuleMemo()
        self.inputs = constants
        #: values computed from constants alone -> their producing node
        self.derived: dict[int, int] = {}
        known = set(constants)
        for index, node in enumerate(plan.nodes):
            if all(t in known for t in node.inputs if t >= 0):  # a fill reads none
                for t in node.outputs:
                    self.derived[t] = index
                    known.add(t)
        self.relabel: dict[tuple[int, int], tuple[int, int]] = {}

    def refuse(self, index: int, why: str) -> None:
        node = self.plan.nodes[index]
        raise _refuse(f"the single-device step's {node.op} at {node.name or 'step'} {why}")

    def tie(self, index: int, a: tuple[int, int], b: tuple[int, int], own: set[int]) -> bool:
        pa, pb = self.seq.get(a), self.seq.get(b)
        for ref, place, other in ((b, pa, pb), (a, pb, pa)):
            if place is None or other is not None or ref[0] in own or self.size(ref) == 1:
                continue
            if ref[0] in self.inputs:
                self.seq[ref] = self.relabel[ref] = place
                return True
            if ref[0] in self.derived:
                # computed from constants alone (a mask broadcast): the rows
                # are carried back to the constants it is computed from, whose
                # relabelling moves it, its producer checked again with them
                self.seq[ref] = place
                self.node(self.derived[ref[0]])
                return True
        return super().tie(index, a, b, own)


def _shim(low: Lowered) -> SimpleNamespace:
    tensors = {v: SimpleNamespace(shape=tuple(s)) for v, s in low.shapes.items()}
    nodes = [SimpleNamespace(op=n.op, dir=n.dir, inputs=list(n.ins), outputs=list(n.outs),
                             kwargs=n.kwargs, name=n.name) for n in low.nodes]
    return SimpleNamespace(tensors=tensors, nodes=nodes)


def check_and_relabel(low: Lowered, rows: int, seeds: list[int], exits: list[int],
                      pi: np.ndarray) -> int:
    """Check every node of the one-device trace between the entry and exit
    chains to commute with the order ``pi`` of the rows (refused in one
    line otherwise) and relabel the recorded constants it reads along the
    rows; the number relabelled."""
    plan = _shim(low)
    region = _Region(plan, rows, seeds, set(low.constants))
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


def order_token_rows(single: dict, low_s: Lowered, lows: list[Lowered], dp: int,
                     tp: int) -> bool:
    """A routed step whose ranks' token rows are no block of the flattened
    rows, written in the ranks' order (each rank's rows found to be one
    block of it): Megatron-Core's sequence-first rows ``[s, b]`` at dp > 1
    and tp 1 (each dp rank's batch block at every position), and rows
    (batch, position) at dp > 1 and tp > 1 with the positions cut by tp
    (torchtitan's sequence parallelism), block ``d * tp + t``. False when
    the rows need no order."""
    if not single.get("routing") or dp <= 1:
        return False
    tokens = single["batch_ids"]["tokens"]
    batch, seqlen = int(tokens.shape[0]), int(tokens.shape[1])
    if single.get("sequence_first"):
        if tp > 1:
            return False  # refused up front (routing.check_rows_are_blocks)
        grid = RowGrid((seqlen, batch), (1, dp), inner_first=True)
    elif tp > 1:
        grid = RowGrid((batch, seqlen), (dp, tp))
    else:
        return False
    (lo, li) = (grid.sizes[0] // grid.parts[0], grid.sizes[1] // grid.parts[1])
    held = {}
    for low in lows:
        d, t = low.coords.get("dp", 0), low.coords.get("tp", 0)
        o, i = (0, d) if grid.inner_first else (d, t)
        held[low.rank] = held_rows(grid, np.arange(o * lo, (o + 1) * lo),
                                   np.arange(i * li, (i + 1) * li))
    check_blocks(grid, held)
    return order_rows(low_s, lows, grid, {low.rank: (lo, li) for low in lows})
