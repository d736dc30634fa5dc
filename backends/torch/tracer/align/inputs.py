"""A rank's inputs and constants matched with the single-device step's: by
name, or a constant by its contents (the piece of a single-device
constant it is), or, when it is none, as a plan input of its own."""

from __future__ import annotations

import itertools

import numpy as np

from backends.torch.errors import AlignError, WrongStep
from backends.torch.lowering import LNode, LoweringError
from backends.torch.tracer.align.claim import Claim, Pieces, is_marker, key_kwargs

#: The mesh axes a constant's dim may be cut by, in the order they are
#: tried: the batch dim (0) data-parallel first, any other dim model- or
#: context-parallel first (a sequence of positions cut by "cp")
CONST_CUTS = ((("dp",), ("tp",), ("cp",), ("dp", "tp"), ("dp", "cp")),
              (("tp",), ("cp",), ("dp",), ("dp", "tp"), ("cp", "tp"), ("dp", "cp")))

#: The cuts of a constant's batch dim added for a constant of one microbatch
#: (``per_microbatch``): its rows are the microbatch's rows of the
#: data-parallel rank's (dp major, as the batch is laid out)
MB_CUTS = (("dp", "mb"), ("mb",))

#: Operators that broadcast a size-1 dim of either input (the rule table's
#: "with broadcasting" ones): a constant repeated along a dim they read as
#: its one row (``InputMatching.slim_constant``)
BROADCASTING = ("add", "mul", "sub")

#: The mesh axes a module buffer a recipe cut may be cut by, in the order
#: they are tried (``InputMatching.buffer_piece``)
BUFFER_CUTS = (("cp",), ("tp",), ("cp", "tp"))


def _tangled(claim: Claim) -> tuple[int, int]:
    """How many axes of a claim cut more than one dim, and how many axes it
    names: a constant's plainer claims sort first."""
    names = [a for axes in claim.dims for a in axes]
    return len(names) - len(set(names)), len(names)


def _holds_block(full: np.ndarray, mine: np.ndarray) -> bool:
    """Whether ``full`` holds ``mine`` as one of the blocks of ``mine``'s
    shape that tile it."""
    if full.ndim != mine.ndim or any(f % m for f, m in zip(full.shape, mine.shape)):
        return False
    counts = [f // m for f, m in zip(full.shape, mine.shape)]
    for at in itertools.product(*(range(c) for c in counts)):
        index = tuple(slice(i * m, (i + 1) * m) for i, m in zip(at, mine.shape))
        if np.array_equal(full[index], mine):
            return True
    return False


def _differences(full: np.ndarray, mine: np.ndarray) -> int:
    """The fewest entries in which ``mine`` differs from a block of its
    shape that tiles ``full`` (every entry when none has its shape)."""
    if full.ndim != mine.ndim or any(f % m for f, m in zip(full.shape, mine.shape)):
        return mine.size
    counts = [f // m for f, m in zip(full.shape, mine.shape)]
    fewest = mine.size
    for at in itertools.product(*(range(c) for c in counts)):
        index = tuple(slice(i * m, (i + 1) * m) for i, m in zip(at, mine.shape))
        fewest = min(fewest, int(np.count_nonzero(full[index] != mine)))
    return fewest


class InputMatching(Pieces):
    """The claims of a rank's inputs and constants.

    It rewrites the rank's ``Lowered`` in place (``slim_constant``,
    ``per_microbatch``): the slimmed constants and per-microbatch copies it
    makes are the rank's program from then on, read by every later part
    of the rank and by the plan writer, which all hold that one record."""

    own_tid: dict[int, int]
    alternatives: dict[int, list[tuple[int, Claim]]]
    matches: dict[int, list[tuple[int, Claim]]]
    consumers: dict[int, list[LNode]]
    taken: set[int]
    split_from: dict[int, int]
    recuts: dict[int, dict[int, list[Claim]]]

    def match_inputs(self) -> None:
        """Each input's single-device value and claim: by name (its claim
        from the axes it was placed on, checked against its shape), a
        constant no single-device input is named as by its contents, and
        last the constants no single-device constant holds (a plan input
        of their own)."""
        low, b, sizes = self.low, self.b, self.sizes
        by_name = {name: v for v, (_, name) in b.s.low.inputs.items()}
        own: list[tuple[int, str]] = []  # constants no single-device one holds
        split: list[tuple[int, str]] = []  # constants claimed per microbatch
        for v, (kind, name) in low.inputs.items():
            if name not in by_name and v in low.constants:
                if self.microbatch_rows(v):
                    split.append((v, name))
                    continue
                try:
                    self.sv[v], self.claim[v] = self.const_piece(v)
                except LoweringError:
                    slim = self.slim_constant(v)
                    if slim is None:
                        split.append((v, name))
                    else:
                        self.sv[v], self.claim[v] = slim
                continue
            tied = b.s.low.ties.get(name) if kind == "param" else None
            if name not in by_name and tied is not None:
                raise WrongStep(f"rank {low.rank} holds {name} as a parameter of its own, but "
                                f"the single-device model ties it to {tied} (one tensor): the "
                                f"tie is broken, so {tied}'s gradient misses {name}'s part and "
                                f"the two are updated apart")
            if name not in by_name:
                what = "a constant" if name.startswith("const.") else f"the input {name}"
                raise AlignError(f"rank {low.rank} reads {what} of shape {list(low.shapes[v])} "
                                 f"that the single-device step never reads")
            self.sv[v] = by_name[name]
            unknown = sorted({a for axes in low.axes[v] for a in self.atomic(axes)} - set(sizes))
            if unknown:
                raise LoweringError(f"rank {low.rank}: {name} is cut by the mesh dim "
                                    f"{unknown[0]!r}, which spans ranks of more than one of the "
                                    f"mesh's own dims: such a cut is not lowered")
            self.claim[v] = Claim([[a for a in self.atomic(axes) if sizes[a] > 1 or is_marker(a)]
                                   for axes in low.axes[v]])
            if kind == "buffer" and tuple(low.shapes[v]) != self.gshape(v):
                self.claim[v] = self.buffer_piece(v)
            self.check_input(v, name)
            self.whole_where_held(v)
        whole: dict[int, tuple[np.ndarray, tuple[int, ...]]] = {}
        for v, name in split:
            copies = self.per_microbatch(v)
            if not copies:
                whole[v] = (low.constants[v], tuple(low.shapes[v]))
                self.slim_constant(v, keep=True)
                own.append((v, name))
                continue
            for table in (low.inputs, low.axes, low.constants):  # read by its copies only
                table.pop(v, None)
            for u in copies:
                try:
                    self.sv[u], self.claim[u] = self.const_piece(u)
                except LoweringError:
                    own.append((u, low.inputs[u][1]))
        self.taken = {self.sv[u] for u in self.sv}
        for v, name in own:
            self.sv[v], self.claim[v] = self.own_constant(v, name, whole.get(v))

    def own_constant(self, v: int, name: str,
                     whole: tuple[np.ndarray, tuple[int, ...]] | None = None) -> tuple[int, Claim]:
        """A constant of this rank that is no piece of any single-device
        constant (another pad id on one rank): a plan input of its own, a
        fresh logical tensor no single-device node reads, so nothing ties
        its value to the single-device step's (docs/soundness.md, "Plans
        traced from PyTorch", 23). Its readers are aligned with the
        single-device nodes that read, at the same position, the constant of
        its shape they match; the verifier then judges them for every value
        of both, the real ones included. ``whole``: the constant before
        ``slim_constant`` took one slice of it, read again as it was when no
        single-device constant is read alike with the slice (docs/soundness.md,
        "Plans traced from PyTorch", 106)."""
        mine = self.low.constants[v]
        shape = tuple(self.low.shapes[v])
        tied: list[int] = []
        readers = [(node.op, node.dir, node.ins.index(v), key_kwargs(node.kwargs))
                   for node in self.consumers.get(v, [])]
        best, hits = None, 0
        for sv, full in self.b.s.low.constants.items():
            # of the same shape, or one this rank's would be a piece of
            # (another routing of its rows: docs/soundness.md, "Plans traced
            # from PyTorch", 36)
            if full.ndim != mine.ndim or any(f % m for f, m in zip(full.shape, mine.shape)) \
                    or sv not in self.b.s.low.inputs \
                    or not self.cut_by_mesh(shape, full.shape, self.mb.get(v, -1) >= 0):
                continue
            n = sum(any(op == k[0] and d == k[1] and len(k[2]) > i and k[2][i] == sv and kw == k[3]
                        for k in self.b.s.by_key) for op, d, i, kw in readers)
            if n and n == hits:
                tied.append(sv)
            if n > hits:
                best, hits, tied = sv, n, [sv]
        if best is None and whole is not None and whole[1] != shape:
            # the slice fits none: the rank's constant as it was (its program)
            self.low.constants[v], self.low.shapes[v] = whole
            return self.own_constant(v, name)
        if best is None and all(self.stood_in_by(node, v)
                                for node in self.consumers.get(v, [])):
            # read only where it changes a value of the reader's output's
            # shape (``NodeMatching.stands_in``), or read by no node (a
            # placeholder's weight whose forward no value reads: item 125
            # c): an input of its own, of its own shape
            self.own_tid[v] = self.b.own_input(f"{name}.ranks_only", shape,
                                               self.low.inputs[v][0])
            return self.b.own_value(self.own_tid[v], shape), Claim([[] for _ in shape])
        if best is None:
            read = ", ".join(sorted({f"{node.op} in {node.name}"
                                     for node in self.consumers.get(v, [])})[:3])
            raise LoweringError(f"rank {self.low.rank}: a constant of shape {list(shape)} is no "
                                f"piece of a single-device constant, and no single-device node "
                                f"reads one of its shape where this rank reads it ({read})")
        alike = list(tied)
        if len(tied) > 1:
            # several read alike (a rotary table's two parts): those that hold
            # this rank's values as some block (another rank's piece, the
            # wrong chunk), if any; a choice of the single-device readers to
            # align with only, the constant stays an input of its own
            holding = [sv for sv in tied if _holds_block(self.b.s.low.constants[sv], mine)]
            tied = holding or tied
            best = tied[0]
        if len(tied) > 1:
            # one per layer: those read by the single-device nodes of this
            # constant's readers' modules
            names = {node.name for node in self.consumers.get(v, [])}
            nodes = self.b.s.low.nodes
            same = {sv: sum(nodes[c].name in names for k, cs in self.b.s.by_key.items()
                            if sv in k[2] for c in cs) for sv in tied}
            top = max(same.values())
            if top:
                tied = [sv for sv in tied if same[sv] == top]
                best = tied[0]
        left = [sv for sv in tied if sv not in self.taken]
        if len(tied) > 1 and left:
            # several read alike (one per expert): the first that no
            # constant of this rank matched by value (both loops run in one
            # order); the claim is its own input's either way
            best = left[0]
            self.taken.add(best)
        elif len(tied) > 1:
            # every one matched by another constant of this rank (an
            # expert-parallel rank's masks, each of the group's rows): the
            # one it differs from in the fewest entries (the mask of the
            # expert whose rows the rank's differ from by a token)
            near = {sv: _differences(self.b.s.low.constants[sv], mine) for sv in tied}
            best = min(tied, key=lambda sv: near[sv])
        full = tuple(self.b.s.low.shapes[best])
        self.own_tid[v] = self.b.own_input(f"{name}.ranks_only", full, self.low.inputs[v][0])
        if len(alike) > 1:
            # each of those read alike is a match a reader may choose
            # (``Rechoice.choose_constants``, docs/soundness.md, "Plans traced
            # from PyTorch", 106): the chosen one first, then the nearest by
            # value; a choice of the single-device nodes its readers are
            # compared with only, its claim an input of its own whichever
            near = {sv: _differences(self.b.s.low.constants[sv], mine) for sv in alike}
            rest = sorted((sv for sv in alike if sv != best), key=lambda sv: near[sv])
            self.matches[v] = [(sv, self.own_claim(v, tuple(self.b.s.low.shapes[sv])))
                               for sv in [best, *rest]]
        return best, self.own_claim(v, full)

    def own_claim(self, v: int, full: tuple[int, ...]) -> Claim:
        """The claim of constant ``v``, an input of its own, as a piece of
        an input of shape ``full``: at this rank's coordinates, each smaller
        dim cut by the first mesh axes of its ratio (another routing of its
        rows, which no single-device node reads)."""
        shape = tuple(self.low.shapes[v])
        if full == shape:
            return Claim([[] for _ in shape])
        first = MB_CUTS + CONST_CUTS[0] if self.mb.get(v, -1) >= 0 else CONST_CUTS[0]
        return Claim([self.guess(m, f, order=self.orders((first, CONST_CUTS[1])[min(k, 1)]))
                      for k, (m, f) in enumerate(zip(shape, full))])


    def stood_in_by(self, node: LNode, v: int) -> bool:
        """``node`` reads constant ``v`` once, forward, and one other value,
        of its output's shape (``NodeMatching.stands_in``)."""
        rest = [u for u in node.ins if u >= 0 and u != v]
        return node.dir == "fw" and node.ins.count(v) == 1 and len(rest) == 1 \
            and len(node.outs) == 1 \
            and tuple(self.low.shapes[rest[0]]) == tuple(self.low.shapes[node.outs[0]])

    def check_input(self, v: int, name: str) -> None:
        """An input's claim is assumed, not proved: its local shape must be its
        full shape cut by exactly the claimed axes (a library mesh dim read as
        "dp" that spans only part of the data-parallel ranks, as HSDP's
        shard dim, would not be)."""
        full, local = self.gshape(v), self.low.shapes[v]
        for k, axes in enumerate(self.claim[v].dims):
            if self.extent(axes, full[k]) != local[k]:
                raise LoweringError(f"rank {self.low.rank}: input {name} of shape {list(local)} is "
                                    f"not its {list(full)} cut by {axes or 'no axis'} along dim {k}")

    def const_piece(self, v: int) -> tuple[int, Claim]:
        """The single-device constant this rank's constant is a piece of: the
        one whose slice at the rank's coordinates (each smaller dim cut by mesh
        axes of its ratio, the batch dim by "dp" first) holds exactly its
        contents. The claim is then true by those contents; no match stops
        the run."""
        mine = self.low.constants[v]
        coords = {**self.low.coords, "mb": self.mb.get(v, -1)}
        # the batch dim of a constant of one microbatch is first the microbatch's rows
        # (a constant equal on every row is a piece at several cuts, all true; the
        # one its readers' other inputs are cut by is the microbatch's)
        orders = (MB_CUTS + CONST_CUTS[0] if coords["mb"] >= 0 else CONST_CUTS[0], CONST_CUTS[1])
        found: list[tuple[int, Claim]] = []
        for sv, full in self.b.s.low.constants.items():
            if full.ndim != mine.ndim or any(f % m for f, m in zip(full.shape, mine.shape)):
                continue
            per_dim = [self.cuts(m, f, orders[min(k, 1)])
                       for k, (m, f) in enumerate(zip(mine.shape, full.shape))]
            true: list[Claim] = []
            for dims in itertools.product(*per_dim):
                index = []
                for axes, m in zip(dims, mine.shape):
                    i = 0
                    for a in axes:
                        i = i * self.sizes[a] + coords[a]
                    index.append(slice(i * m, (i + 1) * m))
                if np.array_equal(full[tuple(index)], mine):
                    true.append(Claim([list(a) for a in dims]))
            if true:
                found.append((sv, true[0]))
                if len(true) > 1:
                    # equal at several cuts (rows alike along a dim): each a
                    # true claim, the first kept until a reader's other input
                    # is cut otherwise (``Recuts.settle``, item 68)
                    self.recuts.setdefault(v, {})[sv] = true
        if found:
            # every match is a true claim; several (two experts' masks equal
            # on this rank's rows) are kept for the first reader to choose,
            # the plainest first: no axis cutting two dims, then the fewest
            # axes (an expert's mask column of a one-hot over experts cut by
            # dp x tp is a true piece of it only by coincidence of the sizes)
            found.sort(key=lambda f: _tangled(f[1]))
            if len(found) > 1:
                self.alternatives[v] = found
                self.matches[v] = found
            return found[0]
        raise LoweringError(f"rank {self.low.rank}: a constant of shape {list(mine.shape)} is no "
                            f"piece of a single-device constant")

    def slim_constant(self, v: int, keep: bool = False) -> tuple[int, Claim] | None:
        """A constant repeated along some dims (every slice along each equal
        to the first), read only by broadcasting operators whose other input
        has that dim's size, as the one slice: its readers compute the same
        values from either (broadcasting repeats the slice), so the rank's
        program is unchanged, and the slice is matched as a piece of a
        single-device constant of size 1 there (a rotary table gathered at
        the rank's positions, one row per batch row, where the single-device
        step reads it once for all rows: docs/soundness.md, "Plans traced
        from PyTorch", 55). None when no slice is a piece: the constant is
        then left as it was, or with ``keep`` (a constant about to be an
        input of its own, ``own_constant``, judged for every value) as its
        slice along every such dim."""
        mine = self.low.constants[v]
        shape = tuple(self.low.shapes[v])
        readers = self.consumers.get(v, [])
        if not readers or mine.ndim != len(shape):
            return None
        repeated = [k for k in range(mine.ndim) if shape[k] > 1
                    and np.array_equal(mine, np.broadcast_to(mine.take([0], axis=k), shape))]

        def kept_by_readers(k: int) -> bool:
            for node in readers:
                if node.op not in BROADCASTING or node.dir != "fw" or len(node.ins) != 2 \
                        or node.ins.count(v) != 1 or len(node.outs) != 1:
                    return False
                other = self.low.shapes[node.ins[1 - node.ins.index(v)]]
                if len(other) != len(shape) or other[k] != shape[k] \
                        or tuple(self.low.shapes[node.outs[0]]) != tuple(
                            max(a, b) for a, b in zip(other, shape)):
                    return False
            return True

        repeated = [k for k in repeated if kept_by_readers(k)]
        trials = [repeated] + [[k] for k in repeated] if len(repeated) > 1 else [repeated]
        for dims in trials:
            if not dims:
                continue
            one = mine
            for k in dims:
                one = one.take([0], axis=k)
            self.low.constants[v], self.low.shapes[v] = one, tuple(one.shape)
            try:
                found = self.const_piece(v)
            except LoweringError:
                continue
            if not _tangled(found[1])[0]:
                return found
            # a piece only by a coincidence of sizes (an axis cutting two
            # dims: the slice's one slot at the dp coordinate): no piece
            self.alternatives.pop(v, None)
            self.matches.pop(v, None)
            self.recuts.pop(v, None)
        self.low.constants[v], self.low.shapes[v] = mine, shape
        if repeated and keep:
            # no piece: read as the one slice all the same (the same
            # program), a constant of its own (own_constant)
            one = mine
            for k in repeated:
                one = one.take([0], axis=k)
            self.low.constants[v], self.low.shapes[v] = one, tuple(one.shape)
        return None

    def buffer_piece(self, v: int) -> Claim:
        """A module buffer a recipe cut (``context_parallel`` cuts the
        buffers it is given along the sequence): claimed, by its shape, as
        the piece at this rank's coordinates of the first axes of the
        right ratio in ``BUFFER_CUTS`` (a module's state is the same on
        every data-parallel rank: never cut by "dp"). The claim is not
        trusted: ``check.check_loaded`` compares the buffer's values with
        that piece (docs/soundness.md, "Plans traced from PyTorch", 28)."""
        return Claim([self.guess(m, f, order=BUFFER_CUTS)
                      for m, f in zip(self.low.shapes[v], self.gshape(v))])

    def microbatch_rows(self, v: int) -> bool:
        """Constant ``v`` is read in microbatches only, no single-device
        constant has its shape, and one has its shape but for more rows: its
        rows are a microbatch's, cut by "mb" (``per_microbatch``), whatever
        other cut its values would also fit (rows all alike fit any)."""
        readers = self.consumers.get(v, [])
        shape = tuple(self.low.shapes[v])
        if self.sizes.get("mb", 1) < 2 or not readers or any(n.mb < 0 for n in readers) \
                or not shape or not shape[0]:
            return False
        fulls = [tuple(f.shape) for f in self.b.s.low.constants.values()]
        return shape not in fulls and any(
            len(f) == len(shape) and f[1:] == shape[1:] and f[0] > shape[0]
            and f[0] % shape[0] == 0 for f in fulls)

    def per_microbatch(self, v: int) -> list[int]:
        """A constant input read in microbatches (one value, as the
        lowering keeps one input per distinct constant) that is no piece of
        a single-device constant as a whole: one copy per microbatch that
        reads it, each read by that microbatch's nodes only and placed in
        it, so that ``const_piece`` can claim each as the microbatch's
        piece (GPTModel's all-ones loss mask, rolled: the same values in
        every microbatch), or as a constant of its own in that microbatch
        (``own_constant``). Each claim is then checked by value as any
        constant's. No copies (an empty list) when a reader is in no
        microbatch or the step has one."""
        readers = self.consumers.get(v, [])
        mbs = sorted({node.mb for node in readers})
        if self.sizes.get("mb", 1) < 2 or not mbs or mbs[0] < 0:
            return []
        kind, name = self.low.inputs[v]
        copies = []
        for m in mbs:
            u = max(self.low.shapes) + 1
            self.low.shapes[u] = self.low.shapes[v]
            self.low.inputs[u] = (kind, f"{name}.mb{m}")
            self.low.axes[u] = self.low.axes[v]
            self.low.constants[u] = self.low.constants[v]
            for node in readers:
                if node.mb == m:
                    node.ins = [u if x == v else x for x in node.ins]
                    self.consumers.setdefault(u, []).append(node)
            self.mb[u] = m
            self.split_from[u] = v
            copies.append(u)
        del self.consumers[v]
        return copies

    def cut_by_mesh(self, local: tuple[int, ...], full: tuple[int, ...],
                    microbatch: bool = False) -> bool:
        """Every dim of ``full`` cut into ``local`` by some axes of the mesh,
        the batch dim of a constant of one microbatch also by the
        microbatches (``own_constant``'s guess can claim a piece of that
        shape)."""
        first = MB_CUTS + CONST_CUTS[0] if microbatch else CONST_CUTS[0]
        try:
            for k, (m, f) in enumerate(zip(local, full)):
                if m != f:
                    self.guess(m, f, order=self.orders((first, CONST_CUTS[1])[min(k, 1)]))
        except LoweringError:
            return False
        return True
