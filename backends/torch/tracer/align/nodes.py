"""A rank's compute nodes matched with the single-device nodes they run: the
same operator on the aligned inputs, or (a rescaling, a slice of a padded
piece, another column of one-hot ids, a function of a partial sum) the
single-device node it is claimed to stand for, a claim the verifier proves."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

from backends.torch.errors import AlignError, WrongStep
from backends.torch.lowering import LNode, LoweringError
from backends.torch.tracer.align.claim import Claim, Pieces, key_kwargs, phase, scope
from verdict.ops import get_op

SCALINGS = ("div", "mul_scalar")

#: Row-major reshapes (``undoes_reshape``)
RESHAPES = ("flatten", "unflatten")


def _factor(value) -> Fraction:
    """A scalar kwarg as the exact rational Z3 reads it (its decimal repr)."""
    return Fraction(repr(float(value)))


def _floats_only_differ(mine: tuple, theirs: tuple) -> bool:
    """Two nodes' keyed kwargs name the same keys, and each value that
    differs is a float number on both sides (no size, dim, flag or mode)."""
    if [k for k, _ in mine] != [k for k, _ in theirs]:
        return False
    differ = [(a, b) for (_, a), (_, b) in zip(mine, theirs) if a != b]
    return bool(differ) and all(_is_float(a) and _is_float(b) for a, b in differ)


#: keyword flags an optimizer node may differ in beside its float numbers
#: (Adam's decay through the gradient against AdamW's of the weight): the
#: stage evaluates the rank's node with its own flag (docs/soundness.md,
#: "Plans traced from PyTorch", 135 (f))
OPTIMIZER_FLAGS = {"adam_step": ("decoupled",)}


def _hyperparameters_only_differ(op: str, mine: tuple, theirs: tuple) -> bool:
    """``_floats_only_differ``, where an optimizer node's flags of
    ``OPTIMIZER_FLAGS`` may differ too."""
    flags = OPTIMIZER_FLAGS.get(op, ())
    if not flags or [k for k, _ in mine] != [k for k, _ in theirs]:
        return _floats_only_differ(mine, theirs)
    rest = [(a, b) for a, b in zip(mine, theirs) if a[0] not in flags]
    flipped = any(a != b for a, b in zip(mine, theirs) if a[0] in flags)
    same_rest = all(a == b for a, b in rest)
    return (flipped and same_rest) or _floats_only_differ(tuple(a for a, _ in rest),
                                                          tuple(b for _, b in rest))


def _is_float(text: str) -> bool:
    """A keyed value (its repr) that is a float literal, not an int or bool."""
    try:
        float(text)
    except ValueError:
        return False
    return any(ch in text for ch in ".eE") or text in ("inf", "-inf", "nan")


def _module_path(name: str) -> tuple[bool, str]:
    """A recorded node name without its root module's class (a wrapper
    renames it: ``FSDPLM`` for ``LM``): whether it was recorded in the
    backward, and the path of the module inside the model."""
    return name.startswith("bw:"), name.removeprefix("bw:").partition(".")[2]


#: Operators a ring runs per key block: aligned with the single-device one
#: reading the same tensors whatever their mask kwargs
BLOCK_OPS = ("attention", "attention_grad")


def _dims(dim, rank: int) -> set[int]:
    """A reduction's ``dim`` kwarg as a set of non-negative dims (None: all)."""
    if dim is None:
        return set(range(rank))
    return {d % rank for d in (dim if isinstance(dim, (list, tuple)) else [dim])}


class NodeMatching(Pieces):
    """The single-device node each compute node of a rank runs."""

    alternatives: dict[int, list[tuple[int, Claim]]]
    split_from: dict[int, int]
    used: set[tuple[int, int]]
    consumers: dict[int, list[LNode]]
    twins: dict[int, list[int]]
    retagged: list[int]
    applied: Fraction
    padded: tuple[int, list[str]] | None
    standing: int | None
    own_tid: dict[int, int]
    producer: dict[int, LNode]
    reclaimed: list[int]
    pieced: set[int]
    stood: set[int]
    undone: set[int]
    alike: bool

    def joins_more_than_once(self, node: LNode, ins: list[int]) -> None:
        """A rank's ``cat`` with no single-device counterpart that reads the
        values a single-device ``cat`` along the same dim joins, one of them
        more often than that cat does, into more entries along the dim than
        it makes: WrongStep (docs/soundness.md, "Plans traced from PyTorch",
        130). Each input is a piece of its single-device value (its
        ``sv``), so the rank's output is no piece of that cat's (it is
        larger along the dim) nor of any other single-device value of
        those inputs: some entries are counted more than once (an
        attention sink appended to every gathered chunk of the keys)."""
        if any(v < 0 for v in ins) or any(self.claim[v].loose or self.claim[v].partial
                                          for v in node.ins):
            return
        nd = len(self.low.shapes[node.outs[0]])
        dim = node.kwargs.get("dim", 0) % nd
        mine = {v: ins.count(v) for v in ins}
        for c in self.b.s.low.nodes:
            if c.op != "cat" or c.dir != "fw" or set(c.ins) != set(mine) \
                    or c.kwargs.get("dim", 0) % nd != dim:
                continue
            full = self.b.s.low.shapes[c.outs[0]][dim]
            local = self.low.shapes[node.outs[0]][dim]
            if local > full and any(n > c.ins.count(v) for v, n in mine.items()):
                raise WrongStep(
                    f"rank {self.low.rank}: cat at {scope(node.name)} joins {len(ins)} pieces "
                    f"of the {len(mine)} values a single-device cat joins in {len(c.ins)}, into "
                    f"{local} entries along dim {dim} where that cat makes {full}: it counts "
                    f"some of them more than once")

    def align(self, node: LNode) -> list[int] | None:
        """The single-device node this compute node runs, None where its
        outputs are loose (``claimed_alike`` (b)), or AlignError."""
        ins = []
        for v in node.ins:
            ins.append(-1 if v < 0 else self.sv[v])
        key = (node.op, node.dir, tuple(ins), key_kwargs(node.kwargs))
        cands = self.reshaped_alike(node, self.b.s.by_key.get(key))
        if not cands and node.op in BLOCK_OPS:
            # a block of the attention: the kernel as called on it (its own
            # causal flag), over pieces of the single-device tensors
            cands = [c for k, cs in self.b.s.by_key.items() if k[:3] == key[:3] for c in cs]
        key, cands = self.choose_constants(node, key, cands)
        for v in node.ins:
            self.alternatives.pop(v, None)  # chosen by this reader
        self.applied = Fraction(1)
        self.padded = None
        self.standing = None
        if not cands and node.op == "narrow" and node.dir == "bw":
            cands = self.padded_piece(node, ins)
        if not cands and node.op == "narrow" and node.dir == "fw" and len(ins) == 1 \
                and self.low.inputs.get(node.ins[0], ("",))[0] == "tokens":
            cands = self.other_column(key)
        if node.op in SCALINGS and len(node.ins) == 1 and (not cands or self.rescales(node, cands)):
            # a rescaling the single-device step does not do (a divide factor,
            # a microbatch's share of the loss): it claims to be what it
            # rescales, times the factor it applies
            self.applied = _factor(node.kwargs["value"])
            if node.op == "div":
                self.applied = 1 / self.applied
            return [self.sv[node.ins[0]]]
        if not cands and node.op != "add" and len(node.ins) == 1 and node.ins[0] >= 0:
            # a function of a partial sum used as if it were the whole sum (a
            # stage's own gradient norm): matched with that function of the
            # whole, so the verifier judges it
            def key_of(root: int) -> tuple:
                return (node.op, node.dir, (root,), key_kwargs(node.kwargs))

            whole = self.b.superset(self.b.leaves_of(self.sv[node.ins[0]]),
                                    lambda root: key_of(root) in self.b.s.by_key)
            if whole is not None:
                cands = self.b.s.by_key[key_of(whole)]
        if not cands:
            key, cands = self.choose_twins(node, key)
        if not cands and node.op == "sum":
            cands = self.sum_with_ones(node, ins)
        if not cands:
            cands = self.past_anchor(node, ins)
        if not cands and self.stands_in(node):
            return [self.sv[self.standing]]
        if not cands:
            cands = self.other_scalars(key)
        if not cands:
            cands = self.claimed_alike(node)
            if cands is None:
                return None
        if not cands:
            cands = self.delivered_instead(node)  # item 102
        if not cands:
            cands = self.rechosen(node)  # item 100
        if not cands and node.op == "cat" and node.dir == "fw":
            self.joins_more_than_once(node, ins)  # WrongStep, or on to the refusal
        if not cands:
            raise AlignError(f"rank {self.low.rank} runs {node.op} ({phase(node.dir, node.name)}) at "
                             f"{scope(node.name)} on values the single-device step never "
                             f"combines that way")
        for v in node.ins:
            self.twins.pop(v, None)  # read: its match stays
        # several single-device nodes compute the same value (e.g. a buffer
        # expanded in every layer): prefer the one of the same module, then
        # the one this rank's readers combine as the single-device step does
        # (an expert-parallel rank's local expert 0 is another global
        # expert), not yet matched in this microbatch
        nodes = self.b.s.low.nodes
        cands = self.shaped_alike(node, cands)
        misses = {c: self.readers_missed(node, c) for c in cands} if len(cands) > 1 else {}
        pick = min(cands, key=lambda c: (nodes[c].name != node.name, misses.get(c, 0),
                                         (node.mb, c) in self.used,
                                         nodes[c].kwargs != node.kwargs))
        self.used.add((node.mb, pick))
        same = [nodes[c].outs[0] for c in cands if c != pick and len(nodes[c].outs) == 1
                and nodes[c].kwargs == nodes[pick].kwargs]
        if same and len(node.outs) == 1:
            self.twins[node.outs[0]] = same
        if node.op in SCALINGS and nodes[pick].kwargs.get("value") != node.kwargs.get("value"):
            # the single-device step scales by another constant (a mean over
            # the rank's own tokens where the step divides by all of them)
            ratio = _factor(node.kwargs["value"]) / _factor(nodes[pick].kwargs["value"])
            self.applied = 1 / ratio if node.op == "div" else ratio
        return self.b.s.low.nodes[pick].outs

    def sum_with_ones(self, node: LNode, ins: list[int]) -> list[int]:
        """The single-device sums (keepdim) of the same value over the dims
        this rank's sum runs over and more, each more dim of size 1 on the
        rank (an expand's backward sums only the dims it expanded, and a
        data-parallel rank with one batch row did not expand dim 0).
        Summing a dim of size 1 with keepdim is the identity on it, so the
        rank's node is rewritten to sum over the same dims as the chosen
        one: the same function of its input (docs/soundness.md, "Plans
        traced from PyTorch", 92 (c))."""
        if not node.kwargs.get("keepdim") or len(ins) != 1 or ins[0] < 0:
            return []
        shape = self.low.shapes[node.ins[0]]
        mine = _dims(node.kwargs.get("dim"), len(shape))
        found = []
        for key, cs in self.b.s.by_key.items():
            if key[:3] != ("sum", node.dir, tuple(ins)):
                continue
            for c in cs:
                kw = self.b.s.low.nodes[c].kwargs
                theirs = _dims(kw.get("dim"), len(shape))
                if kw.get("keepdim") and mine < theirs \
                        and all(shape[d] == 1 for d in theirs - mine):
                    found.append(c)
        if found:
            node.kwargs = dict(self.b.s.low.nodes[found[0]].kwargs)
        return found[:1]

    def past_anchor(self, node: LNode, ins: list[int]) -> list[int]:
        """A node reading ring's named results (``Lowered.anchors``) where
        the single-device step runs no such node on them: matched with the
        nearest single-device node of the same operator, kwargs (a ring
        block's causal flag aside) and module that reads, in their places,
        values of their shapes computed from them in the forward, and the
        same values elsewhere (a sink merged into the attention before its
        output is read, which the rank skips: prime-rl PR 3397). Its
        outputs are claimed as that node's, claims the verifier proves or
        refutes like any (docs/soundness.md, "Plans traced from PyTorch",
        92 (d)); an empty list when there is none."""
        named = {self.sv[a] for a in self.low.anchors if a in self.sv}
        at = [i for i, v in enumerate(node.ins)
              if v in self.low.anchors or (node.op in BLOCK_OPS and self.sv.get(v) in named)]
        if not at:
            return []
        nodes = self.b.s.low.nodes
        want = None if node.op in BLOCK_OPS else key_kwargs(node.kwargs)
        far = {i: self.descendants(ins[i]) for i in at}
        best, pick = None, []
        for c, n in enumerate(nodes):
            if n.op != node.op or n.dir != node.dir or n.name != node.name \
                    or len(n.ins) != len(ins) or (want is not None and key_kwargs(n.kwargs) != want):
                continue
            if any(n.ins[j] != ins[j] for j in range(len(ins)) if j not in far) \
                    or any(n.ins[i] not in far[i] for i in at):
                continue
            cost = sum(far[i][n.ins[i]] for i in at)
            if cost and (best is None or cost < best):
                best, pick = cost, [c]
        return pick

    def descendants(self, start: int) -> dict[int, int]:
        """The single-device values computed from ``start`` in the forward,
        of its shape, each with its distance (``start`` itself at 0)."""
        nodes, shapes = self.b.s.low.nodes, self.b.s.low.shapes
        far, frontier, depth = {start: 0}, {start}, 0
        while frontier:
            depth += 1
            after = {o for n in nodes if n.dir == "fw" and not n.name.startswith("bw:")
                     and any(v in frontier for v in n.ins) for o in n.outs
                     if o >= 0 and o not in far}
            for o in after:
                far[o] = depth
            frontier = after
        return {v: d for v, d in far.items() if shapes.get(v) == shapes.get(start)}

    def claimed_alike(self, node: LNode) -> list[int] | None:
        """What a node that combines aligned values in a way the
        single-device step never does is claimed to compute
        (docs/soundness.md, "Plans traced from PyTorch", 94). (a) A
        forward node of a module (a rank that writes the halves of a
        strided view back swapped): a single-device node of the same
        operator reading the same values (another order, other kwargs),
        made after the value each of its inputs is aligned with
        (so its stage can read them) and whose outputs its own are pieces
        of (``nearest_node``). The claim is proved or refuted by that
        node's stage, never assumed. (b) Once a rank holds such a claim, a
        later node that matches nothing (its backward, the gradient of its
        own forward) is loose (None): a stage that reads it recomputes it;
        one that writes a gradient or loss the rank ends with is claimed to
        be the single-device node that writes it. Empty when neither."""
        if any(v >= 0 and v not in self.sv for v in node.ins):
            return []
        if node.dir == "fw" and node.name and not node.name.startswith("bw:"):
            found = self.nearest_node(node)
            if found:
                self.alike = True
                return found
            found = self.nearest_downstream(node)
            if found:
                self.alike = True
                return found
        if not self.alike:
            return []
        return self.final_node(node)

    def nearest_node(self, node: LNode) -> list[int]:
        """The single-device node ``node`` is claimed to compute
        (``claimed_alike`` (a)), or none: of the candidates, the one of the
        same module path first (a wrapper renames the root class), then of
        the same kwargs, then reading most of the same values, then not yet
        matched in this microbatch."""
        nodes = self.b.s.low.nodes
        kw, where = key_kwargs(node.kwargs), _module_path(node.name)
        order = self.single_order()
        mine = [self.sv[v] for v in node.ins if v >= 0]
        after = max((order.get(sv, -1) for sv in mine), default=-1)
        same = sorted(mine)
        found = [i for i in range(after + 1, len(nodes))
                 if nodes[i].op == node.op and nodes[i].dir == node.dir
                 and len(nodes[i].outs) == len(node.outs) and self.fits_all(node, i)
                 and sorted(v for v in nodes[i].ins if v >= 0) == same]
        if not found:
            return []

        def rank(c: int) -> tuple:
            shared = sum(min(mine.count(sv), nodes[c].ins.count(sv)) for sv in set(mine))
            return (_module_path(nodes[c].name) != where, key_kwargs(nodes[c].kwargs) != kw,
                    -shared, (node.mb, c) in self.used)
        return [min(found, key=rank)]

    def nearest_downstream(self, node: LNode) -> list[int]:
        """A single-device node of the same operator, direction, module
        path, kwargs and inputs' count as ``node``, made after the values
        its inputs are aligned with, whose outputs its own are pieces of,
        and each of whose inputs is, in its place, the value the rank's
        input there is aligned with or one the single-device forward
        computes from it (a rank that skips a step the single-device step
        runs before this operator: the sinks' column dropped before a
        softmax); the nearest (fewest steps in all), or none
        (docs/soundness.md, "Plans traced from PyTorch", 101). The claim
        is proved or refuted by that node's stage, as (a)'s."""
        nodes = self.b.s.low.nodes
        ins = [self.sv[v] if v >= 0 else -1 for v in node.ins]
        kw, where = key_kwargs(node.kwargs), _module_path(node.name)
        order = self.single_order()
        after = max((order.get(v, -1) for v in ins if v >= 0), default=-1)
        far = {v: self.downstream(v) for v in set(ins) if v >= 0}
        best, pick = None, []
        for c in range(after + 1, len(nodes)):
            n = nodes[c]
            if n.op != node.op or n.dir != node.dir or len(n.ins) != len(ins) \
                    or len(n.outs) != len(node.outs) or _module_path(n.name) != where \
                    or key_kwargs(n.kwargs) != kw:
                continue
            if any((v < 0) != (w < 0) or (v >= 0 and w not in far[v])
                   for v, w in zip(ins, n.ins)):
                continue
            cost = sum(far[v][w] for v, w in zip(ins, n.ins) if v >= 0)
            if cost and self.fits_all(node, c) and (best is None or cost < best):
                best, pick = cost, [c]
        return pick

    def downstream(self, start: int) -> dict[int, int]:
        """The single-device values the forward computes from ``start``, of
        any shape, each with its distance (``start`` itself at 0)."""
        if self.fw_readers is None:
            self.fw_readers = {}
            for n in self.b.s.low.nodes:
                if n.dir == "fw" and not n.name.startswith("bw:"):
                    for v in set(n.ins):
                        self.fw_readers.setdefault(v, []).extend(o for o in n.outs if o >= 0)
        far, frontier, depth = {start: 0}, [start], 0
        while frontier:
            depth += 1
            after = []
            for v in frontier:
                for o in self.fw_readers.get(v, ()):
                    if o not in far:
                        far[o] = depth
                        after.append(o)
            frontier = after
        return far

    def final_node(self, node: LNode) -> list[int] | None:
        """The single-device node that writes the gradient or loss this
        node writes for the rank to end with, when it is of the same
        operator (``claimed_alike`` (b)); None (loose) when the node writes
        none."""
        finals = self.finals()
        mine = [finals.get(o) for o in node.outs if o in finals]
        if not mine:
            return None
        order = self.single_order()
        i = order.get(mine[0]) if mine[0] is not None else None
        if i is None or self.b.s.low.nodes[i].op != node.op \
                or self.b.s.low.nodes[i].dir != node.dir or not self.fits_all(node, i):
            return []
        return [i]

    def finals(self) -> dict[int, int | None]:
        """The gradients and losses the rank ends with -> the single-device
        value each is claimed to be."""
        finals = {v: self.b.s.low.grads.get(n) for n, v in self.low.grads.items()
                  if v is not None}
        finals.update(zip(self.low.losses, self.b.s.low.losses))
        return finals

    def writes_final(self, node: LNode) -> bool:
        """``node`` writes a gradient or loss the rank ends with."""
        finals = self.finals()
        return any(o in finals for o in node.outs)

    def fits_all(self, node: LNode, cand: int) -> bool:
        """Every output of ``node`` has as many dims as the single-device
        node ``cand``'s, none larger (a piece of it)."""
        full = self.b.s.low.shapes
        return all((o < 0) == (so < 0) and (o < 0 or (
            len(self.low.shapes[o]) == len(full[so])
            and all(m <= f for m, f in zip(self.low.shapes[o], full[so]))))
            for o, so in zip(node.outs, self.b.s.low.nodes[cand].outs))

    def stands_in(self, node: LNode) -> bool:
        """A forward node reading a constant of this rank only (``own_tid``)
        and one other value of its output's shape, where the single-device
        step runs nothing of the kind (a permutation of the routing weights,
        ``w[order]``): its output stands in for that value, so it is
        claimed to be the same piece of the same single-device value
        (``standing``). The verifier proves the claim for every value of the
        rank's constant, an input of its own (docs/soundness.md, "Plans
        traced from PyTorch", 73), so it holds only where the output does
        not depend on the constant; otherwise the claim is refuted there."""
        own = [v for v in node.ins if v in self.own_tid]
        rest = [v for v in node.ins if v >= 0 and v not in self.own_tid]
        if node.dir != "fw" or not own or len(rest) != 1 or len(node.outs) != 1 \
                or tuple(self.low.shapes[rest[0]]) != tuple(self.low.shapes[node.outs[0]]):
            return False
        self.standing = rest[0]
        self.stood.add(node.outs[0])
        self.stand_in_piece(node, own[0], rest[0])
        return True

    def stand_in_piece(self, node: LNode, c: int, u: int) -> None:
        """The piece of its own input the rank's constant ``c`` is, read by
        ``node`` with ``u`` (``stands_in``): each dim its operator ties to a
        dim of ``u`` or of the output (the same piece as ``u``'s) cut as
        that dim, so that every dim the stage ties has one full size; a
        piece of an input of its own, a free symbol either way."""
        shapes_in = [None if v < 0 else self.low.shapes[v] for v in node.ins]
        rel = get_op(node.op).relations(shapes_in, [self.low.shapes[node.outs[0]]],
                                        node.kwargs)
        at, of = node.ins.index(c), node.ins.index(u)
        local = tuple(self.low.shapes[c])
        dims: list[list[str]] = [[] for _ in local]
        full = list(local)
        for r in rel:
            if r[0] != "eq":
                continue
            for p, q in ((r[1], r[2]), (r[2], r[1])):
                if p[0] == "i" and p[1] == at and (q[0] == "o" or (q[0] == "i" and q[1] == of)):
                    dims[p[2]] = list(self.claim[u].dims[q[2]])
                    full[p[2]] = self.gshape(u)[q[2]]
        if dims == self.claim[c].dims and tuple(full) == tuple(self.gshape(c)):
            return
        if c in self.pieced:
            raise LoweringError(f"rank {self.low.rank}: a constant of its own is read as pieces "
                                f"of two shapes at {scope(node.name)}")
        self.claim[c] = Claim(dims)
        self.b.own_shape(self.sv[c], tuple(full))
        self.pieced.add(c)
        self.reclaimed.append(c)

    def undoes_reshape(self, node: LNode) -> bool:
        """A ``flatten`` or ``unflatten`` that the single-device step does
        not run, of the output of one, back to the shape of that one's
        input: that input itself (row-major reshapes compose, the same
        entries in the same order). Its readers are given that input
        instead, an identity of the rank's program (every reader computes
        the same values), and the node is left out. Only where every reader
        is a forward node of the model (not of its backward, ``bw:``): a
        ring's log-sum-exp unflattened and flattened back for the ring's
        backward on a rank with no target is left to align as before, and
        so is a reshape whose output a ring's result names (its claim is
        the anchor's)."""
        if not self.readers_of_model(node.outs[0] if node.outs else -1) \
                or node.outs[0] in self.low.anchors:
            return False  # a value a ring result names keeps its name (92 (b))
        if node.op not in RESHAPES or node.dir != "fw" or len(node.ins) != 1 \
                or len(node.outs) != 1 or (node.ins[0] not in self.undone
                                           and (node.ins[0] not in self.sv or self.aligns(node))):
            return False
        made = self.producer.get(node.ins[0])
        if made is None or made.op not in RESHAPES or made.dir != "fw" or len(made.ins) != 1 \
                or (made.ins[0] not in self.sv and made.ins[0] not in self.undone) \
                or tuple(self.low.shapes[made.ins[0]]) != tuple(self.low.shapes[node.outs[0]]):
            return False
        x, out = made.ins[0], node.outs[0]
        for reader in self.consumers.pop(out, []):
            reader.ins = [x if v == out else v for v in reader.ins]
            self.consumers.setdefault(x, []).append(reader)
        return True

    def readers_of_model(self, v: int) -> bool:
        """Every reader of v is a forward node of the model, or of its
        backward where it reads a constant of the rank's own
        (``undoes_reshape``)."""
        return not any(r.dir != "fw" or (r.name.startswith("bw:")
                                         and not any(u in self.own_tid for u in r.ins))
                       for r in self.consumers.get(v, []))

    def undone_by_readers(self, node: LNode) -> bool:
        """A ``flatten`` or ``unflatten`` that the single-device step does
        not run, of a value that stands in for another (``stands_in``),
        every reader of which is a forward reshape of the model back to
        this node's input shape: left out, and ``undoes_reshape`` gives its
        readers that input (row-major reshapes compose to the identity). A
        rank that flattens a value, moves its rows, reads them back in the
        value's shape and flattens them again reads the moved rows
        (docs/soundness.md, "Plans traced from PyTorch", 84).
        Also of any value when the node keys alike with single-device
        reshapes of none of which its output can be a piece (``misshaped``),
        its readers then of the backward too: such a rank's backward reads
        the gradient back in the module's shape and flattens it again for
        its own lookup (item 124 (e))."""
        if node.op not in RESHAPES or node.dir != "fw" or len(node.ins) != 1 \
                or len(node.outs) != 1 or node.ins[0] not in self.sv or self.aligns(node):
            return False
        stood = node.ins[0] in self.stood
        if not stood and not self.misshaped(node):
            return False
        readers = self.consumers.get(node.outs[0], [])
        shape = tuple(self.low.shapes[node.ins[0]])
        if not readers or any(r.op not in RESHAPES or r.dir != "fw"
                              or (stood and r.name.startswith("bw:"))
                              or len(r.ins) != 1 or len(r.outs) != 1
                              or tuple(self.low.shapes[r.outs[0]]) != shape
                              or not self.readers_of_model(r.outs[0]) for r in readers):
            return False  # each reader is then left out by ``undoes_reshape``
        self.undone.add(node.outs[0])
        return True

    def misshaped(self, node: LNode) -> bool:
        """The node keys alike with single-device nodes, and its outputs can
        be pieces of none of theirs (``reshaped_alike`` leaves none)."""
        key = (node.op, node.dir, tuple(-1 if v < 0 else self.sv[v] for v in node.ins),
               key_kwargs(node.kwargs))
        return bool(self.b.s.by_key.get(key)) and not self.aligns(node)

    def shaped_alike(self, node: LNode, cands: list[int]) -> list[int]:
        """Of several candidates, those whose outputs this node's outputs can
        be pieces of (as many dims, none larger): a ``ones`` of shape [2, 4]
        keys alike with every ``ones`` (sizes are left out of keys) but
        runs only the [4, 4] one's. All of them when none is."""
        if len(cands) < 2:
            return cands
        return [c for c in cands if self.pieces_of(node, c)] or cands

    def pieces_of(self, node: LNode, c: int) -> bool:
        """This node's outputs can be pieces of single-device node c's: as
        many dims, none larger."""
        shapes, full = self.low.shapes, self.b.s.low.shapes
        return all(o < 0 or so < 0 or (len(shapes[o]) == len(full[so]) and all(
            m <= f for m, f in zip(shapes[o], full[so])))
            for o, so in zip(node.outs, self.b.s.low.nodes[c].outs))

    def reshaped_alike(self, node: LNode, cands: list[int] | None) -> list[int] | None:
        """For a ``flatten`` or ``unflatten``, the keyed candidates whose
        outputs this node's outputs can be pieces of (``pieces_of``); other
        nodes' candidates as they are. A reshape's sizes are no key (a
        rank's reshape runs on pieces), so a rank's unflatten to [2, 2, 3]
        keys alike with a single-device unflatten to [2, 2, 2, 2, 3] of the
        same value (the first of a chain of token rows, item 98), whose
        output it cannot be a piece of: no match, rather than a claim no dim
        count allows (docs/soundness.md, "Plans traced from PyTorch", 124
        (e))."""
        if not cands or node.op not in RESHAPES:
            return cands
        return [c for c in cands if self.pieces_of(node, c)]

    def other_column(self, key: tuple) -> list[int]:
        """The single-device nodes that read another column of the same
        one-hot ids (``ids != pad`` for another pad id): the same slice
        along the same dim from another start. Aligned with them, the rank's
        column is claimed to be theirs, which the verifier refutes unless it
        is (docs/soundness.md, "Plans traced from PyTorch", 23)."""
        op, d, ins, kwargs = key
        rest = tuple(kv for kv in kwargs if kv[0] != "start")
        return [c for k, cs in self.b.s.by_key.items() if k[:3] == (op, d, ins)
                and tuple(kv for kv in k[3] if kv[0] != "start") == rest for c in cs]

    def other_scalars(self, key: tuple) -> list[int]:
        """The single-device nodes of the same operator on the same inputs
        whose kwargs differ from this node's only in float numbers (an
        optimizer step at another learning rate). Aligned with them, the
        rank's outputs are claimed to be theirs; the node keeps its own
        numbers, and the stage of the single-device node proves the claim
        for every input, so it holds only where the outputs are equal
        (a rate scaled against a gradient scaled back), and is refuted
        otherwise (docs/soundness.md, "Plans traced from PyTorch", 91 (a))."""
        op, d, ins, kwargs = key
        return [c for k, cs in self.b.s.by_key.items()
                if k[:3] == (op, d, ins) and _hyperparameters_only_differ(op, kwargs, k[3])
                for c in cs]

    def padded_piece(self, node: LNode, ins: list[int]) -> list[int] | None:
        """The backward of a slice that took this rank's piece of a dim cut by
        mesh axes (zeros outside the piece) is one term of the sum of the
        pieces: matched with the single-device backward of the slice of the
        whole dim, and claimed partial over those axes (``self.padded``)."""
        g = node.ins[-1]
        d = node.kwargs["dim"] % len(self.low.shapes[g])
        axes = self.claim[g].dims[d]
        if not axes:
            return None
        # the claim (this rank's piece, by its coordinates) is proved, not
        # assumed: a rank that took another piece fails
        whole = node.kwargs["length"] * math.prod(self.sizes[a] for a in axes)
        key = (node.op, node.dir, tuple(ins),
               key_kwargs({**node.kwargs, "start": 0, "length": whole}))
        cands = self.b.s.by_key.get(key)
        if cands:
            self.padded = (d, list(axes))
        return cands

    def sliced_alike(self, node: LNode) -> bool:
        """The single-device step has a backward of a slice this ``narrow``
        backward can be matched with (``padded_piece``, item 13)."""
        ins = [-1 if v < 0 else self.sv[v] for v in node.ins]
        found = self.padded_piece(node, ins)
        self.padded = None
        return bool(found)

    def aligns(self, node: LNode) -> bool:
        key = (node.op, node.dir, tuple(-1 if v < 0 else self.sv[v] for v in node.ins),
               key_kwargs(node.kwargs))
        return bool(self.reshaped_alike(node, self.b.s.by_key.get(key)))

    def computed_split(self, node: LNode, cut: bool = False) -> list[int] | None:
        """The single-device split this split computes (the same piece of the
        aligned input), or None: then it is a cut by a mesh axis. With
        ``cut``, also of a dim that mesh axes cut already (the model's own
        split of a sharded value, e.g. a fused projection's chunk)."""
        if node.op != "split" or node.ins[0] not in self.sv:
            return None
        key = (node.op, node.dir, (self.sv[node.ins[0]],), key_kwargs(node.kwargs))
        nodes = self.b.s.low.nodes
        for c in self.b.s.by_key.get(key, []):
            if nodes[c].kwargs == node.kwargs and (
                    cut or not self.claim[node.ins[0]].dims[node.kwargs["dim"]]):
                return nodes[c].outs
        return None

    def split_as_single(self, node: LNode, souts: list[int]) -> None:
        """Claim a split's piece as the single-device split's piece it stands
        for (the claim is proved: a split that does not follow the shards
        fails at this node)."""
        self.sv[node.outs[0]] = souts[0]
        self.mb[node.outs[0]] = node.mb if node.mb >= 0 else self.mb.get(node.ins[0], -1)
        self.infer(node)
        self.applied = Fraction(1)
        self.claim[node.outs[0]].scale = self.scales_of(node)[0]

    def rescales(self, node: LNode, cands: list[int]) -> bool:
        """Whether a scaling (``mul_scalar``, ``div``) that no candidate
        scales by the same number is rather a rescaling of its input the
        single-device step does not do: its readers, reading it as its
        input's value, then miss fewer single-device nodes than under any
        candidate (a microbatch's ``loss * 1/2`` of the backward's ones,
        which the single-device step scales by 0.9 and by 0.1 / classes for
        a smoothed cross-entropy: matched with one of those, neither
        reader aligns). Either choice is a claim the stages prove, a factor
        included (docs/soundness.md, "Plans traced from PyTorch", 135 (d))."""
        nodes = self.b.s.low.nodes
        if node.ins[0] < 0 or any(nodes[c].kwargs.get("value") == node.kwargs.get("value")
                                  for c in cands):
            return False
        mine = self.missed_as(node, [self.sv[node.ins[0]]])
        return mine < min(self.readers_missed(node, c) for c in cands)

    def readers_missed(self, node: LNode, cand: int) -> int:
        """How many of the readers of ``node``'s outputs whose other inputs
        are aligned already would read a combination the single-device step
        never runs, were ``node`` aligned with the single-device node
        ``cand`` (a choice among nodes computing equal values: which is
        chosen never changes a claim's truth, only where the stages meet)."""
        return self.missed_as(node, self.b.s.low.nodes[cand].outs)

    def missed_as(self, node: LNode, outs: list[int]) -> int:
        """``readers_missed`` were ``node``'s outputs the single-device
        values ``outs``."""
        missed = 0
        for o, so in zip(node.outs, outs):
            for reader in self.consumers.get(o, []) if o >= 0 else []:
                ins = [so if v == o else (-1 if v < 0 else self.sv.get(v)) for v in reader.ins]
                if None in ins:
                    continue
                key = (reader.op, reader.dir, tuple(ins), key_kwargs(reader.kwargs))
                missed += key not in self.b.s.by_key
        return missed

    def choose_twins(self, node: LNode, key: tuple) -> tuple[tuple, list[int] | None]:
        """A reader of values matched with one of several equal single-device
        values (the same op on the same inputs, e.g. a mask expanded once
        per reader), none read before: the first choice of those under which
        the single-device step runs this node (an equal value, so every
        claim stays true)."""
        slots = [(i, v) for i, v in enumerate(node.ins) if v in self.twins]
        if not slots:
            return key, None
        choices = [[self.sv[v], *self.twins[v]] for _, v in slots]
        for pick in itertools.product(*choices):
            ins = list(key[2])
            for (i, _), sv in zip(slots, pick):
                ins[i] = sv
            trial = (key[0], key[1], tuple(ins), key[3])
            if self.b.s.by_key.get(trial):
                for (_, v), sv in zip(slots, pick):
                    if self.sv[v] != sv:
                        self.sv[v] = sv
                        self.retagged.append(v)
                return trial, self.b.s.by_key[trial]
        return key, None
