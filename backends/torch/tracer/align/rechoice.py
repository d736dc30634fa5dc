"""A rank's constant that several single-device constants could stand for
(a piece of each, or an input of its own read where each is read): the
match chosen per reader (``choose_constants``, docs/soundness.md, "Plans
traced from PyTorch", 99 c), and chosen again at a later reader that reads
a value computed from it alone and matches no single-device node
(``rechosen``, 100)."""

from __future__ import annotations

import itertools

from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import Claim, Pieces, key_kwargs

#: How many one-input nodes a constant's value is followed through
DEPTH = 8


class Rechoice(Pieces):
    """Constants matched per reader (``choose_constants``) and again
    (``rechosen``)."""

    own_tid: dict[int, int]
    alternatives: dict[int, list[tuple[int, Claim]]]
    matches: dict[int, list[tuple[int, Claim]]]
    reclaimed: list[int]
    #: copies made by ``choose_constants``, for the writer to write
    copies: list[int]
    consumers: dict[int, list[LNode]]
    retagged: list[int]
    split_from: dict[int, int]
    #: (constant, its copy, the reader given the copy), for the writer
    copied: list[tuple[int, int, LNode]]

    def rechosen(self, node: LNode) -> list[int]:
        """The single-device nodes ``node`` runs once one of its inputs, a
        value computed from a constant by one-input forward nodes that read
        nothing else of the rank's already matched, is matched through
        another single-device constant the constant may stand for
        (``options``), the chain replayed in the single-device step from it.
        The matches are changed (the values written retagged); empty, and
        nothing changed, when no choice makes ``node`` match."""
        for i, v in enumerate(node.ins):
            chain = self.chain_to_constant(v, node)
            if chain is None:
                continue
            c = chain[0].ins[0] if chain else v
            shared = not self.read_only_by(c, chain[0] if chain else node)
            if shared and c in self.own_tid:
                continue
            for sv, claim in self.options(c):
                found = self.replayed(chain, sv, node, i)
                if found is None:
                    continue
                if shared:
                    c = self.copy_for(c, chain[0] if chain else node)
                self.apply(c, sv, claim, chain, found[0], written=not shared)
                return found[1]
        return []

    def copy_for(self, c: int, reader: LNode) -> int:
        """A copy of constant ``c`` (the same contents) that ``reader``
        reads instead of it, c's other readers keeping their match: an
        identity of the rank's program. The writer gives it its tensor
        and rewires ``reader`` if it is written already (``copied``)."""
        u = self.copy_of(c, reader, "again")
        self.mb[u] = self.mb.get(c, -1)
        self.copied.append((c, u, reader))
        return u

    def copy_of(self, c: int, reader: LNode, tag: str) -> int:
        """A new input of the rank equal to constant ``c``, read by
        ``reader`` in place of ``c`` (of its microbatch if ``c`` is a
        microbatch's copy, ``per_microbatch``)."""
        low = self.low
        u = max(low.shapes) + 1
        kind, name = low.inputs[c]
        low.shapes[u] = low.shapes[c]
        low.inputs[u] = (kind, f"{name}.{tag}{u}")
        low.axes[u] = low.axes[c]
        low.constants[u] = low.constants[c]
        if c in self.split_from:
            self.split_from[u] = self.split_from[c]
        reader.ins = [u if x == c else x for x in reader.ins]
        self.consumers[c] = [n for n in self.consumers.get(c, []) if n is not reader]
        self.consumers[u] = [reader]
        return u

    def chain_to_constant(self, v: int, reader: LNode) -> list[LNode] | None:
        """The one-input forward nodes from a constant to ``v``, first to
        last, when no value on the way (the constant aside) has a matched
        reader other than the chain's next node and ``reader``; None
        otherwise. A constant other matched nodes read is copied for the
        chain (``copy_for``)."""
        chain: list[LNode] = []
        after = reader
        while v >= 0 and v not in self.low.constants:
            made = self.producer.get(v)
            if made is None or len(chain) == DEPTH or made.dir != "fw" or len(made.outs) != 1 \
                    or len([u for u in made.ins if u >= 0]) != 1 or made.ins[0] < 0:
                return None
            if not self.read_only_by(v, after):
                return None
            chain.insert(0, made)
            after, v = made, made.ins[0]
        return None if v < 0 else chain

    def read_only_by(self, v: int, reader: LNode) -> bool:
        """Every reader of ``v`` that is matched already is ``reader``."""
        return all(r is reader or not any(o in self.sv for o in r.outs if o >= 0)
                   for r in self.consumers.get(v, []))

    def options(self, c: int) -> list[tuple[int, Claim]]:
        """The other single-device constants constant ``c`` may be matched
        with, each with its claim: of a piece of several (``const_piece``),
        the others it is a piece of with the same claim (true by its
        contents); of an input of its own matched with a single-device
        constant (``own_constant``), every other single-device constant of
        that one's shape (a choice of readers only: its claim is its own
        input's)."""
        now = self.sv.get(c)
        mine = self.claim.get(c)
        if now is None or mine is None:
            return []
        if c in self.own_tid:
            consts = self.b.s.low.constants
            if now not in consts:
                return []  # an input standing in for a value (``stands_in``)
            shape = tuple(self.b.s.low.shapes[now])
            return [(sv, mine) for sv in consts if sv != now and sv in self.b.s.low.inputs
                    and tuple(self.b.s.low.shapes[sv]) == shape]
        return [(sv, claim) for sv, claim in self.matches.get(c, [])
                if sv != now and claim.dims == mine.dims]

    def replayed(self, chain: list[LNode], sv: int, node: LNode,
                 at: int) -> tuple[list[int], list[int]] | None:
        """The single-device values the chain computes from ``sv`` (one
        per chain node), and the single-device nodes ``node`` then runs
        with the last (or ``sv``) at input ``at``; None when a node of the
        chain or ``node`` has no such single-device node."""
        ins = [-1 if v < 0 else self.sv.get(v) for v in node.ins]
        if None in ins:
            return None
        nodes = self.b.s.low.nodes
        stack: list[list[int]] = [[]]
        while stack:
            values = stack.pop()
            cur = values[-1] if values else sv
            if len(values) == len(chain):
                ins[at] = cur
                cands = self.b.s.by_key.get((node.op, node.dir, tuple(ins),
                                             key_kwargs(node.kwargs)))
                if cands:
                    return values, cands
                continue
            made = chain[len(values)]
            key = (made.op, made.dir, (cur,), key_kwargs(made.kwargs))
            # several single-device nodes of one key (a mask expanded in the
            # forward and again in the backward): each tried, the one of the
            # same module first
            cands = sorted(self.b.s.by_key.get(key, []),
                           key=lambda c: nodes[c].name == made.name)
            stack += [[*values, nodes[c].outs[0]] for c in cands if len(nodes[c].outs) == 1]
        return None

    def apply(self, c: int, sv: int, claim: Claim, chain: list[LNode],
              values: list[int], written: bool = True) -> None:
        """Match constant ``c`` with ``sv`` (claimed as ``claim``) and the
        chain's outputs with ``values``; the tensors already written are
        retagged (a constant of the rank's own keeps its input's tensor, a
        copy has none yet)."""
        self.sv[c] = sv
        self.claim[c] = claim
        if written and c not in self.own_tid:
            self.retagged.append(c)
        for made, value in zip(chain, values):
            self.sv[made.outs[0]] = value
            self.retagged.append(made.outs[0])

    def choose_constants(self, node: LNode, key: tuple,
                         cands: list[int] | None) -> tuple[tuple, list[int] | None]:
        """A reader of constants that match several single-device ones (each
        claim true by the values): kept as matched when the single-device
        step runs this node and every aligned reader of its outputs;
        otherwise the first choice under which it runs both (one expert's
        mask equal to another's on this rank's rows, read once per expert),
        else, when nothing runs this node, the first under which it runs.
        A constant no reader has read yet takes the choice for every later
        reader; one read already keeps its match and this reader reads a
        copy of it, claimed as chosen (``copy_constant``)."""
        slots = [(i, v) for i, v in enumerate(node.ins) if v in self.matches]
        if not slots or (cands and self.fewest_missed(node, cands) == 0):
            return key, cands
        first = None
        for pick in itertools.product(*(self.matches[v] for _, v in slots)):
            ins = list(key[2])
            for (i, _), (sv, _) in zip(slots, pick):
                ins[i] = sv
            trial = (key[0], key[1], tuple(ins), key[3])
            found = self.b.s.by_key.get(trial)
            if not found:
                continue
            if self.fewest_missed(node, found) == 0:
                return self.take_constants(node, slots, pick, trial)
            first = first or (pick, trial)
        if cands or first is None:
            return key, cands
        return self.take_constants(node, slots, *first)

    def fewest_missed(self, node: LNode, cands: list[int]) -> int:
        return min(self.readers_missed(node, c) for c in cands)

    def take_constants(self, node: LNode, slots: list[tuple[int, int]],
                       pick: tuple, key: tuple) -> tuple[tuple, list[int]]:
        """The constants of ``slots`` claimed as ``pick`` for ``node``."""
        for (_, v), (sv, claim) in zip(slots, pick):
            if self.sv[v] == sv and self.claim[v] == claim:
                self.alternatives.pop(v, None)
                continue
            if v in self.alternatives:  # read by no node yet: chosen for all
                del self.alternatives[v]
                self.retagged.append(v)  # its tensor, written already, renamed
                self.reclaimed.append(v)
            else:
                v = self.copy_constant(v, node)
            self.sv[v], self.claim[v] = sv, claim
        return key, self.b.s.by_key[key]

    def copy_constant(self, v: int, node: LNode) -> int:
        """A copy of constant ``v`` read by ``node`` only (the same value:
        the rank's program is unchanged), written as an input before it
        (``copies``)."""
        u = self.copy_of(v, node, "read")
        if v in self.mb:
            self.mb[u] = self.mb[v]
        self.matches[u] = self.matches[v]
        self.copies.append(u)
        return u
