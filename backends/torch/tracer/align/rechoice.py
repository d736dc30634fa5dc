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
        value computed by forward nodes from constants (``tree``), is
        matched through other single-device constants those constants may
        stand for (``options``), one or several at once, the tree replayed
        in the single-device step from them (its other inputs at their
        matches). The matches are changed (the values written retagged);
        empty, and nothing changed, when no choice makes ``node`` match."""
        for i, v in enumerate(node.ins):
            steps: list[LNode] = []
            leaves: dict[int, LNode | None] = {}
            if not self.tree(v, node, steps, leaves, 0) or None in leaves.values():
                continue
            shared = {c: not self.read_only_by(c, reader) for c, reader in leaves.items()}
            choices = [[(self.sv[c], self.claim[c]), *self.options(c)] for c in leaves]
            for pick in itertools.product(*choices):
                if all(sv == self.sv[c] for c, (sv, _) in zip(leaves, pick)):
                    continue
                if any(shared[c] and c in self.own_tid and sv != self.sv[c]
                       for c, (sv, _) in zip(leaves, pick)):
                    continue  # an input of its own read elsewhere: not copied
                at = {c: sv for c, (sv, _) in zip(leaves, pick)}
                found = self.replayed(steps, at, node, i)
                if found is None:
                    continue
                for c, (sv, claim) in zip(list(leaves), pick):
                    if sv == self.sv[c]:
                        continue
                    reader = leaves[c]
                    if shared[c] and reader is not None:
                        self.apply(self.copy_for(c, reader), sv, claim, written=False)
                    else:
                        self.apply(c, sv, claim)
                for made, value in zip(steps, found[0]):
                    self.sv[made.outs[0]] = value
                    self.retagged.append(made.outs[0])
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

    def tree(self, v: int, reader: LNode, steps: list[LNode], leaves: dict[int, LNode | None],
             depth: int) -> bool:
        """Whether ``v`` is computed from constants with ``options`` by
        forward nodes of one output each whose values nothing else of the
        rank's already matched reads but ``reader`` (at most ``DEPTH``
        deep); if so the nodes are added to ``steps`` in the order they
        run, the constants to ``leaves`` with the node reading them. A
        value computed from no such constant stays as matched."""
        if v < 0 or v not in self.sv:
            return False
        if v in self.low.constants:
            if v in leaves:
                leaves[v] = None  # read twice on the way: not rechosen
                return True
            if not self.options(v):
                return False
            leaves[v] = reader
            return True
        made = self.producer.get(v)
        if made is None or depth == DEPTH or made.dir != "fw" or len(made.outs) != 1 \
                or made in steps or not self.read_only_by(v, reader):
            return False
        mark = len(steps)
        found = [self.tree(u, made, steps, leaves, depth + 1) for u in made.ins]
        if not any(found):
            del steps[mark:]
            return False
        steps.append(made)
        return True

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

    def replayed(self, steps: list[LNode], at: dict[int, int], node: LNode,
                 i: int) -> tuple[list[int], list[int]] | None:
        """The single-device values the steps compute from the constants'
        choices ``at`` (one per step; a value off the tree at its match),
        and the single-device nodes ``node`` then runs with the last at
        input ``i``; None when a step or ``node`` has no such single-device
        node."""
        nodes = self.b.s.low.nodes
        stack: list[list[int]] = [[]]
        while stack:
            values = stack.pop()
            now = {**at, **{made.outs[0]: x for made, x in zip(steps, values)}}
            if len(values) == len(steps):
                ins = [-1 if v < 0 else now.get(v, self.sv.get(v)) for v in node.ins]
                cands = self.b.s.by_key.get((node.op, node.dir, tuple(ins),
                                             key_kwargs(node.kwargs)))
                if cands:
                    return values, cands
                continue
            made = steps[len(values)]
            ins = [-1 if u < 0 else now.get(u, self.sv.get(u)) for u in made.ins]
            key = (made.op, made.dir, tuple(ins), key_kwargs(made.kwargs))
            # several single-device nodes of one key (a mask expanded in the
            # forward and again in the backward): each tried, the one of the
            # same module first
            cands = sorted(self.b.s.by_key.get(key, []),
                           key=lambda c: nodes[c].name == made.name)
            stack += [[*values, nodes[c].outs[0]] for c in cands if len(nodes[c].outs) == 1]
        return None

    def apply(self, c: int, sv: int, claim: Claim, written: bool = True) -> None:
        """Match constant ``c`` with ``sv`` (claimed as ``claim``); its
        tensor, if written already, retagged (a constant of the rank's own
        keeps its input's tensor, a copy has none yet)."""
        self.sv[c] = sv
        self.claim[c] = claim
        if written and c not in self.own_tid:
            self.retagged.append(c)

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
                v = self.copy_constant(v, node, sv)
            self.sv[v], self.claim[v] = sv, claim
        return key, self.b.s.by_key[key]

    def copy_constant(self, v: int, node: LNode, sv: int) -> int:
        """A copy of constant ``v`` read by ``node`` only (the same value:
        the rank's program is unchanged), written as an input before it
        (``copies``), to be matched with ``sv``."""
        u = self.copy_of(v, node, "read")
        if v in self.mb:
            self.mb[u] = self.mb[v]
        self.matches[u] = self.matches[v]
        if v in self.own_tid:
            # an input of its own: the copy is one too, a fresh input of the
            # chosen single-device constant's shape (one per value and shape,
            # as ``own_constant`` names them)
            kind, name = self.low.inputs[v]
            full = tuple(self.b.s.low.shapes[sv])
            self.own_tid[u] = self.b.own_input(
                f"{name.rsplit('.read', 1)[0]}.as{'x'.join(map(str, full))}.ranks_only", full, kind)
        self.copies.append(u)
        return u
