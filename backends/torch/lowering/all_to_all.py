"""``all_to_all_single`` with split sizes, as its definition written out
(docs/soundness.md, "Plans traced from PyTorch", 37 b, c).

Member j's output is the concatenation, in group order, of block j of
every member's input (member i cuts its rows into blocks of its input
split sizes). Of a lowered tensor: the blocks sent (``send`` of a
``narrow``) and received (``send_recv``) and concatenated (``cat``). Of
rows at a recorded index (``Rows``, ``Experts``: routed_rows.py,
grouped_rows.py): every member's base sent whole and concatenated, the
output the rows of that base at the composed index; when every row read
lies in this member's even share of the base's rows, the base is cut to
that share (a ``narrow``, the index shifted).

A member needs the other members' indices to compose its own. The ranks
are lowered in rounds (``walk.lower_ranks``): each round publishes what
every rank sends at each all-to-all (``Sent``); a rank missing a member's
stops (``NeedPeers``) and is lowered again in the next round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.arranged import Arranged, Base, blocks_of, chain, is_box
from backends.torch.lowering.context import LNode
from backends.torch.lowering.grouped_rows import Experts, copied
from backends.torch.lowering.ir import Empty
from backends.torch.lowering.pair_rows import Assembled, Pairs
from backends.torch.lowering.registry import lowers
from backends.torch.lowering.routed_rows import Rows, value_of

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer

#: the data all-to-alls lowered here (args: input, output splits, input splits, group;
#: then ``torch.distributed.all_to_all``'s of lists)
OPS = ("_c10d_functional.all_to_all_single.default",
       "_c10d_functional_autograd.all_to_all_single.default", "c10d.alltoall_base_.default",
       "c10d.alltoall_.default")
#: ``torch.distributed.all_to_all_single``'s op (Megatron's dispatcher): args
#: (output written in place, input, group, output splits, input splits)
IN_PLACE = "c10d.alltoall_base_.default"
#: ``torch.distributed.all_to_all``'s op: args (outputs, inputs, group)
LISTS = OPS[3]
#: the kind of a member's send whose input has no row: it sends no entry
#: and no base (docs/soundness.md, "Plans traced from PyTorch", 125 a)
NOTHING = "nothing"


class NeedPeers(Exception):
    """A member's send at this all-to-all is not known yet (next round)."""


@dataclass(frozen=True)
class Sent:
    """What one member sends at one all-to-all: the kind of its input
    ("tensor", "rows", "experts", "assembled", "pairs"), the shape of what
    it sends whole (its base, or its grouped result, or each of its
    values), the index and groups of its rows, and its input split sizes;
    of a tensor that is a view of earlier values (its bases,
    ``arranged.blocks_of``), each base's shape and each block's element
    numbers of it; ``copies``: the base is the C-fold copy of a value of
    ``source`` shape, which is sent in its place; ``values``: how many
    values it sends whole (the ``g`` and ``w`` of pairs: their shapes in
    ``source``)."""
    kind: str
    shape: tuple[int, ...]
    index: np.ndarray | None
    groups: np.ndarray | None
    splits: tuple[int, ...]
    copies: int = 1
    source: tuple[tuple[int, ...], ...] = ()
    values: int = 1
    bases: tuple[tuple[tuple[int, ...], tuple[np.ndarray, ...]], ...] = ()


def _splits(sizes: Any, rows: int, n: int, what: str) -> tuple[int, ...]:
    if sizes is None or (isinstance(sizes, (list, tuple)) and not sizes):
        if rows % n:
            raise LoweringError(f"an all-to-all without {what} split sizes of {rows} rows over "
                                f"{n} members")
        return (rows // n,) * n
    out = tuple(int(s) for s in sizes)
    if len(out) != n or sum(out) != rows:
        raise LoweringError(f"an all-to-all's {what} split sizes {list(out)} do not cut its "
                            f"{rows} rows among {n} members")
    return out


def _no_rows(lw: Lowerer, a: Any) -> bool:
    """Recorded tensor ``a`` has no row: whatever computed it, there is no
    entry of it to send."""
    shape = lw.trace["shapes"][a[1]] if isinstance(a, (list, tuple)) and len(a) == 2 else None
    return shape is not None and len(shape) > 0 and shape[0] == 0


def _starts(splits: tuple[int, ...]) -> list[int]:
    return [int(s) for s in np.concatenate([[0], np.cumsum(splits)[:-1]])]


def _describe(lw: Lowerer, x: Any, in_splits: Any, n: int) -> tuple[Sent, int]:
    """This member's send: its description and the lowered value it sends whole."""
    if isinstance(x, Rows):
        rows = len(x.index)
        copy = next(((v, c) for (v, c), made in lw.grouped_copies.items() if made == x.base), None)
        if copy is not None:  # the copy's source sent in its place
            return Sent("rows", tuple(lw.shapes[x.base]), np.asarray(x.index), None,
                        _splits(in_splits, rows, n, "input"), copy[1],
                        (tuple(lw.shapes[copy[0]]),)), copy[0]
        return Sent("rows", tuple(lw.shapes[x.base]), np.asarray(x.index), None,
                    _splits(in_splits, rows, n, "input")), x.base
    if isinstance(x, Assembled) and x.group.ndim == 1:
        return Sent("assembled", tuple(lw.shapes[x.values[0]]), np.asarray(x.index),
                    np.asarray(x.group), _splits(in_splits, len(x.group), n, "input"),
                    values=len(x.values)), x.values
    if isinstance(x, Pairs) and x.pair.ndim == 1:
        return Sent("pairs", (lw.shapes[x.g][0] * x.k,), np.asarray(x.pair), None,
                    _splits(in_splits, len(x.pair), n, "input"), x.k,
                    (tuple(lw.shapes[x.g]), tuple(lw.shapes[x.w])), 2), (x.g, x.w)
    if isinstance(x, Experts):
        rows = len(x.index)
        return Sent("experts", tuple(lw.shapes[x.y]), np.asarray(x.index), np.asarray(x.group),
                    _splits(in_splits, rows, n, "input")), x.y
    v = lw.materialize(x)
    splits = _splits(in_splits, lw.shapes[v][0], n, "input")
    viewed = blocks_of(lw, v, splits)
    if viewed:
        lw.bases_sent[v] = tuple(base for base, _ in viewed)
        return Sent("tensor", tuple(lw.shapes[v]), None, None, splits,
                    bases=tuple((tuple(lw.shapes[base]), tuple(blocks))
                                for base, blocks in viewed)), v
    return Sent("tensor", tuple(lw.shapes[v]), None, None, splits), v


def _exchange_whole(lw: Lowerer, me: int, group: tuple[int, ...], own: int,
                    shapes: list[tuple[int, ...]], dim: int) -> int:
    """Every member's value sent whole and concatenated along ``dim`` in
    group order (an all-gather of values of possibly unequal lengths)."""
    for dst in group:
        if dst != me and own is not None:
            lw.nodes.append(_send(lw, own, me, dst))
    pieces = []
    for src, shape in zip(group, shapes):
        if src == me:
            if own is not None:
                pieces.append(own)
        elif shape[dim]:
            pieces.append(lw.emit("send_recv", [], [shape], {"src": src, "dst": me},
                                  group=(src, me))[0])
    pieces = [p for p in pieces if lw.shapes[p][dim]] or pieces[:1]
    if len(pieces) <= 1:
        return pieces[0] if pieces else None
    full = list(lw.shapes[pieces[0]])
    full[dim] = sum(lw.shapes[p][dim] for p in pieces)
    return lw.emit("cat", pieces, [tuple(full)], {"dim": dim})[0]


def _send(lw: Lowerer, v: int, me: int, dst: int) -> LNode:
    return LNode("send", "fw", [v], [], {}, lw.name, (me, dst), lw.mb)


def _narrow(lw: Lowerer, v: int, dim: int, start: int, length: int) -> int:
    shape = list(lw.shapes[v])
    if start == 0 and length == shape[dim]:
        return v
    shape[dim] = length
    return lw.emit("narrow", [v], [tuple(shape)], {"dim": dim, "start": start, "length": length})[0]


def _tensor(lw: Lowerer, me: int, group: tuple[int, ...], x: int, sends: dict[int, Sent],
            out_shape: tuple[int, ...]) -> int:
    """The definition with point-to-point operators: blocks sent, received,
    concatenated."""
    i = group.index(me)
    mine = sends[me]
    starts = _starts(mine.splits)
    for k, dst in enumerate(group):
        if dst != me and mine.splits[k]:
            lw.nodes.append(_send(lw, _narrow(lw, x, 0, starts[k], mine.splits[k]), me, dst))
    pieces = []
    for src in group:
        s = sends[src]
        rows = s.splits[i]
        if not rows:
            continue
        if src == me:
            pieces.append(_narrow(lw, x, 0, starts[i], rows))
        else:
            pieces.append(lw.emit("send_recv", [], [(rows, *s.shape[1:])], {"src": src, "dst": me},
                                  group=(src, me))[0])
    if not pieces:
        if out_shape[0]:
            raise LoweringError(f"{lw.name}: an all-to-all of a tensor that sends this rank no "
                                f"row")
        return None
    out = pieces[0] if len(pieces) == 1 else \
        lw.emit("cat", pieces, [out_shape], {"dim": 0})[0]
    return out


def _arranged(lw: Lowerer, group: tuple[int, ...], own: tuple[int, ...], sends: dict[int, Sent],
              out_shape: tuple[int, ...]) -> Any:
    """The output as the elements of the members' bases it holds
    (``arranged.Arranged``): the block each member sends this one, in group
    order, as the definition says; one reading per base every member has
    at the same distance (``own``: this member's bases, nearest first)."""
    i = group.index(lw.trace["rank"])
    pos = np.concatenate([np.full(sends[src].bases[0][1][i].shape, p, dtype=np.int64)
                          for p, src in enumerate(group)])
    if pos.shape != out_shape:
        raise LoweringError(f"{lw.name}: an all-to-all receives blocks of shape "
                            f"{list(pos.shape)}, its output is {list(out_shape)}")
    bases = []
    for k, value in enumerate(own):
        if any(len(sends[src].bases) <= k for src in group):
            break
        flat = np.concatenate([sends[src].bases[k][1][i] for src in group])
        bases.append(Base(value, tuple(sends[src].bases[k][0] for src in group), flat))
    return Arranged(group, pos, tuple(bases))


def _composed(group: tuple[int, ...], me: int, sends: dict[int, Sent], along: int
              ) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows (and groups) this member receives, as positions in the
    members' concatenated bases (``along``: the dim of the bases the
    concatenation runs along: 0 rows, 1 groups)."""
    i = group.index(me)
    index, groups = [], []
    offset = 0
    for src in group:
        s = sends[src]
        if s.kind == NOTHING:
            continue
        lo = _starts(s.splits)[i]
        block = s.index[lo:lo + s.splits[i]]
        if along == 0:
            index.append(block + offset)
        else:
            index.append(block)
            groups.append(s.groups[lo:lo + s.splits[i]] + offset)
        offset += s.shape[0]
    return (np.concatenate(index).astype(np.int64) if index else np.zeros(0, np.int64),
            np.concatenate(groups).astype(np.int64) if groups else None)


def _own_share(lw: Lowerer, base: int, index: np.ndarray, me: int, group: tuple[int, ...],
               dim: int) -> tuple[int, np.ndarray]:
    """The base cut to this member's even share of its rows (along
    ``dim``) when every row read lies in it; else the base whole."""
    rows, n = lw.shapes[base][dim], len(group)
    if rows % n or not len(index):
        return base, index
    share = rows // n
    lo = group.index(me) * share
    if index.min() < lo or index.max() >= lo + share:
        return base, index
    return _narrow(lw, base, dim, lo, share), index - lo


@lowers(LISTS)
def all_to_all_list(lw: Lowerer, args, kwargs, shapes, group):
    """``torch.distributed.all_to_all(outputs, inputs, group)``: output i is
    member i's input at this member's position. Every input a view of one
    value (``tensor_split``'s pieces, VeOmni's): the outputs read as the
    elements of the members' bases (``arranged.Arranged``), one reading
    shared by all, joined again by a ``cat``."""
    pg = args[2]
    if not (isinstance(pg, (list, tuple)) and len(pg) == 2 and pg[0] == "pg"):
        raise LoweringError(f"{lw.name}: an all-to-all without its group")
    group = tuple(pg[1])
    me, n = lw.trace["rank"], len(group)
    ins = [lw.val(a) for a in args[1]]
    if len(ins) != n or len(args[0]) != n:
        raise LoweringError(f"{lw.name}: an all-to-all of {len(ins)} tensors over {n} members")
    chains = [dict(chain(lw, v)) for v in ins]
    bases = [(b, [c[b] for c in chains]) for b in chains[0]
             if all(b in c for c in chains[1:])
             and all(is_box(c[b], lw.shapes[b]) for c in chains)]
    if not bases:
        raise LoweringError(f"{lw.name}: an all-to-all of tensors that are no views of one value")
    mine = Sent("tensor", (), None, None, tuple(1 for _ in ins),
                bases=tuple((tuple(lw.shapes[b]), tuple(blocks)) for b, blocks in bases))
    counter = lw.all_to_alls
    k = counter.get(group, 0)
    counter[group] = k + 1
    lw.published[(group, k)] = mine
    sends = {me: mine}
    for m in group:
        if m != me:
            sent = (lw.peers or {}).get(m, {}).get((group, k))
            if sent is None:
                raise NeedPeers(f"rank {m}'s all-to-all {k + 1} on {list(group)}")
            sends[m] = sent
    i = group.index(me)
    gathered: dict = {}
    outs = []
    for p, src in enumerate(group):
        readings = []
        for j, (value, _) in enumerate(bases):
            if any(len(sends[m].bases) <= j for m in group):
                break
            readings.append(Base(value, tuple(sends[m].bases[j][0] for m in group),
                                 sends[src].bases[j][1][i]))
        block = sends[src].bases[0][1][i]
        if block.shape != tuple(shapes[p]):
            raise LoweringError(f"{lw.name}: an all-to-all receives a tensor of shape "
                                f"{list(block.shape)} into one of {list(shapes[p])}")
        outs.append(Arranged(group, np.full(block.shape, p, dtype=np.int64), tuple(readings),
                             gathered))
    return outs


@lowers(IN_PLACE)
def all_to_all_in_place(lw: Lowerer, args, kwargs, shapes, group):
    """``torch.distributed.all_to_all_single(out, x, out_splits, in_splits,
    group)``: the functional op's definition, its result the output
    (written in place)."""
    pg = args[2]
    if not (isinstance(pg, (list, tuple)) and len(pg) == 2 and pg[0] == "pg"):
        raise LoweringError(f"{lw.name}: an all-to-all without its group")
    return all_to_all(lw, [args[1], args[3], args[4]], {}, shapes, tuple(pg[1]))


@lowers(*OPS[:2])
def all_to_all(lw: Lowerer, args, kwargs, shapes, group):
    """Lower one ``all_to_all_single`` (see the module's docstring)."""
    if group is None:
        raise LoweringError(f"{lw.name}: an all-to-all without its group")
    group = tuple(group)
    me, n = lw.trace["rank"], len(group)
    x = value_of(lw, args[0])
    if x is None:
        raise LoweringError(f"{lw.name}: an all-to-all of a tensor no recorded op produced")
    if _no_rows(lw, args[0]):  # it sends no entry (item 125 a): no value read
        mine, whole = Sent(NOTHING, (0,), None, None, (0,) * n), None
    else:
        mine, whole = _describe(lw, x, args[2] if len(args) > 2 else None, n)
    counter = lw.all_to_alls
    k = counter.get(group, 0)
    counter[group] = k + 1
    key = (group, k)
    published = lw.published
    published[key] = mine
    peers = lw.peers or {}
    sends = {me: mine}
    for m in group:
        if m != me:
            sent = peers.get(m, {}).get(key)
            if sent is None:
                raise NeedPeers(f"rank {m}'s all-to-all {k + 1} on {list(group)}")
            sends[m] = sent
    kinds = {s.kind for s in sends.values() if s.kind != NOTHING}
    if not kinds:  # no member sends an entry
        return Empty(tuple(shapes[0]))
    out = _received(lw, me, group, whole, sends, kinds, args, shapes)
    # a member that receives no row holds no value (item 125 a); it still
    # sends and receives what its members' whole sends need
    return Empty(tuple(shapes[0])) if not shapes[0][0] else out


def _received(lw: Lowerer, me: int, group: tuple[int, ...], whole: Any, sends: dict[int, Sent],
              kinds: set[str], args, shapes) -> Any:
    """The all-to-all's output of this member (``all_to_all``'s body once
    every member's send is known); members that send nothing (``NOTHING``)
    contribute no row, no base and no value."""
    mine = sends[me]
    if mine.kind == NOTHING:
        mine = next(s for s in sends.values() if s.kind != NOTHING)
    senders = {m: s for m, s in sends.items() if s.kind != NOTHING}
    if len(kinds) != 1:
        sent = ", ".join(f"rank {m} {s.kind}" for m, s in sorted(sends.items()))
        raise LoweringError(f"{lw.name}: an all-to-all whose members send different kinds of "
                            f"rows ({sent}): one member computes its rows otherwise than its "
                            f"peers, and pending rows of different kinds are not exchanged "
                            f"(docs/soundness.md, \"Plans traced from PyTorch\", 54)")
    i = group.index(me)
    received = sum(s.splits[i] for s in sends.values())
    if received != shapes[0][0]:
        raise LoweringError(f"{lw.name}: an all-to-all receives {received} rows by its members' "
                            f"input splits, {shapes[0][0]} by its own output splits")
    out_splits = args[1] if len(args) > 1 else None
    if out_splits and tuple(int(s) for s in out_splits) != tuple(sends[m].splits[i] for m in group):
        raise LoweringError(f"{lw.name}: an all-to-all's output split sizes "
                            f"{[int(s) for s in out_splits]} are not what its members send it")
    everyone = len(senders) == len(sends)
    if mine.kind == "tensor" and everyone and all(s.bases for s in sends.values()):
        return _arranged(lw, group, lw.bases_sent[whole], sends, tuple(shapes[0]))
    if mine.kind == "tensor":
        if everyone and any(s.bases for s in sends.values()):
            raise LoweringError(f"{lw.name}: an all-to-all some of whose members send views of "
                                f"an earlier value and some not")
        return _tensor(lw, me, group, whole, sends, tuple(shapes[0]))
    if not everyone and mine.kind not in ("rows", "experts", "assembled"):
        raise LoweringError(f"{lw.name}: an all-to-all of {mine.kind} some of whose members "
                            f"send no row")
    if mine.kind in ("assembled", "pairs"):
        return _values(lw, me, group, whole, sends)
    if mine.kind == "rows" and all(s.copies == mine.copies > 1 for s in senders.values()):
        if not everyone:
            raise LoweringError(f"{lw.name}: an all-to-all of rows of copies some of whose "
                                f"members send no row")
        return _copies(lw, me, group, whole, sends)
    if any(s.copies > 1 for s in senders.values()):
        raise LoweringError(f"{lw.name}: an all-to-all of rows of copies beside other rows")
    if mine.kind == "rows":
        if any(s.shape[1:] != mine.shape[1:] for s in senders.values()):
            shown = ", ".join(f"rank {m} {list(sends[m].shape)}" for m in group)
            raise LoweringError(f"{lw.name}: an all-to-all of rows of bases of other widths "
                                f"(the bases the members send: {shown})")
        base = _exchange_whole(lw, me, group, whole, [sends[m].shape for m in group], 0)
        index, _ = _composed(group, me, sends, 0)
        if base is None:
            return None
        base, index = _own_share(lw, base, index, me, group, 0)
        return Rows(base, index)
    if any(s.shape[1:] != mine.shape[1:] for s in senders.values()):
        shown = ", ".join(f"rank {m} {list(sends[m].shape)}" for m in group)
        raise LoweringError(f"{lw.name}: an all-to-all of grouped rows over bases of other rows "
                            f"(the grouped results the members send: {shown})")
    y = _exchange_whole(lw, me, group, whole, [sends[m].shape for m in group], 0)
    index, groups = _composed(group, me, sends, 1)
    if y is None:
        return None
    y, index = _own_share(lw, y, index, me, group, 1)
    return Experts(y, groups, index)


def _copies(lw: Lowerer, me: int, group: tuple[int, ...], own: int, sends: dict[int, Sent]) -> Rows:
    """Rows of the members' C-fold copies: the copied values sent whole and
    concatenated (cut to this member's share of them when every row read
    lies in it), the rows those of its copy at the composed index (row
    ``off * C + p`` of the copy of the concatenation is row p of the copy
    of the member whose rows start at ``off``)."""
    c = sends[me].copies
    x = _exchange_whole(lw, me, group, own, [sends[m].source[0] for m in group], 0)
    index, _ = _composed(group, me, sends, 0)
    tokens, n = lw.shapes[x][0], len(group)
    if tokens % n == 0 and len(index):
        share = tokens // n
        lo = group.index(me) * share
        if index.min() >= lo * c and index.max() < (lo + share) * c:
            x, index = _narrow(lw, x, 0, lo, share), index - lo * c
    return Rows(copied(lw, x, c), index)


def _values(lw: Lowerer, me: int, group: tuple[int, ...], own: tuple[int, ...],
            sends: dict[int, Sent]) -> Assembled | Pairs:
    """Rows of token-space values (``pair_rows``): every member's values
    sent whole, in order, to every other member; the rows received those of
    the concatenation (``Assembled``: the members' values one after
    another, the groups renumbered; ``Pairs``: g and w each concatenated
    along the tokens, the pairs shifted by the tokens before)."""
    i = group.index(me)
    mine = sends[me]
    if mine.kind == NOTHING:  # this member sends no value; its peers' are read
        mine, own = next(s for s in sends.values() if s.kind != NOTHING), ()
    for dst in group:
        if dst != me:
            for v in own:
                lw.nodes.append(_send(lw, v, me, dst))
    received: list[list[int]] = []
    for src in group:
        s = sends[src]
        if s.kind == NOTHING:  # a member that sends no row: no value of it
            received.append([])
            continue
        # assembled rows: each member sends its own number of values (an
        # expert of no token on it has none there), renumbered below
        # (docs/soundness.md, "Plans traced from PyTorch", 114 b)
        if s.kind != mine.kind or (mine.kind == "pairs" and s.values != mine.values) or \
                (mine.kind == "assembled" and s.shape != mine.shape):
            shown = ", ".join(f"rank {m} {t.kind} {t.values} x {list(t.shape)}"
                              for m, t in sorted(sends.items()))
            raise LoweringError(f"{lw.name}: an all-to-all whose members send other values "
                                f"({shown})")
        if src == me:
            received.append(list(own))
            continue
        shapes = s.source if mine.kind == "pairs" else (s.shape,) * s.values
        received.append([lw.emit("send_recv", [], [tuple(shape)], {"src": src, "dst": me},
                                 group=(src, me))[0] for shape in shapes])
    groups, index = [], []
    offset = 0
    for src in group:
        s = sends[src]
        if s.kind == NOTHING:
            continue
        lo = _starts(s.splits)[i]
        block = slice(lo, lo + s.splits[i])
        if mine.kind == "assembled":
            g = s.groups[block]
            groups.append(np.where(g >= 0, g + offset, -1))
            index.append(s.index[block])
            offset += s.values
        else:
            index.append(s.index[block] + offset * mine.copies)
            offset += s.source[0][0]
    if mine.kind == "assembled":
        values = tuple(v for vs in received for v in vs)
        return Assembled(values, np.concatenate(groups).astype(np.int64),
                         np.concatenate(index).astype(np.int64))
    g = _cat(lw, [vs[0] for vs in received])
    w = _cat(lw, [vs[1] for vs in received])
    return Pairs(g, w, mine.copies, np.concatenate(index).astype(np.int64))


def _cat(lw: Lowerer, pieces: list[int]) -> int:
    pieces = [p for p in pieces if lw.shapes[p][0]] or pieces[:1]
    if len(pieces) == 1:
        return pieces[0]
    shape = list(lw.shapes[pieces[0]])
    shape[0] = sum(lw.shapes[p][0] for p in pieces)
    return lw.emit("cat", pieces, [tuple(shape)], {"dim": 0})[0]
