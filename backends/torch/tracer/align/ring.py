"""A ring's attention (context parallelism by rings, docs/soundness.md,
"Plans traced from PyTorch", 53): the blocks a ring runs over some of the
keys, the additions that accumulate its steps' parts, the parts a block's
gradients are, and the merged result anchored as the single-device
attention's."""

from __future__ import annotations

from dataclasses import replace

from backends.torch.errors import AlignError
from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import Claim, Pieces, scope

#: how many backward nodes past the repeated keys' gradient a grouped
#: attention's key gradient is looked for (``Ring.grouped_heads_grad``)
GQA_STEPS = 4


class Ring(Pieces):
    """The claims of a ring's blocks, sums of steps and merged result."""

    pending: dict[int, list[int]]

    def whole_rows(self, v: int) -> bool:
        """Value v holds every row (dim -2: the keys or queries) of its
        single-device tensor."""
        rows = self.view(v)[0][-2]
        return rows == (0, self.gshape(v)[-2])

    def ring_step(self, node: LNode) -> list[LNode] | None:
        """The nodes to emit for a node a ring runs outside the single-device
        step's operators: a reader of a loose value that the single-device
        step does not run (the merge's arithmetic: loose too), or an
        addition accumulating a ring's parts (``accumulates_steps``); None
        for any other node."""
        if node.group is not None:
            return None
        if any(self.is_loose(v) and not self.is_zero(v) for v in node.ins):
            if self.alike and self.writes_final(node):
                return None  # claimed to be the single-device node (``claimed_alike``)
            emitted: list[LNode] = []
            for v in node.ins:
                if v in self.pending:
                    emitted += self.materialize(v)
            bases = self.block_bases(node)
            if bases is None and self.alike:
                bases = self.first_fits(node)  # ``claimed_alike`` (b)
            self.make_loose(node, bases)
            return [*emitted, node]
        if node.op == "add" and len(node.ins) == 2 \
                and not any(v in self.pending for v in node.ins) and self.accumulates_steps(node):
            return [node]
        return None

    def block_bases(self, node: LNode) -> list[int] | None:
        """The outputs of the single-device attention (or its gradient)
        reading the values a ring's block reads pieces of, loose ones
        included (a half of a rank's query): the values a loose block's
        results are claimed beside, so that their stage comes after every
        value they read. None for any other node."""
        if node.op not in ("attention", "attention_grad"):
            return None
        ins = [self.sv.get(v, -1) if v >= 0 else -1 for v in node.ins]
        for n in self.b.s.low.nodes:
            if n.op == node.op and n.dir == node.dir and list(n.ins) == ins:
                return list(n.outs)
        return None

    def accumulates_steps(self, node: LNode) -> bool:
        """An addition of a ring's parts (53 (f)): exact zeros plus a
        value (the accumulator's start: the value's claim); a value summing
        steps [lo, hi) plus exact zeros (a skipped block: step hi); two
        pieces of one single-device value with the same dims, summing
        adjacent steps (their union, whole once it holds every step)."""
        a, b = node.ins
        out = node.outs[0]
        za, zb = self.is_zero(a), self.is_zero(b)
        ca, cb = self.claim.get(a), self.claim.get(b)
        if za and not zb and cb is not None and not cb.loose and cb.steps is not None:
            self.sv[out], self.mb[out] = self.sv[b], self.mb.get(b, -1)
            self.claim[out] = replace(cb, dims=[list(d) for d in cb.dims])
            return True
        if ca is None or cb is None or ca.loose or ca.steps is None:
            return False
        lo, hi, n = ca.steps
        if zb and not za:
            if hi >= n:
                return False
            hi += 1
        elif not cb.loose and cb.steps is not None and self.sv[a] == self.sv[b] \
                and ca.dims == cb.dims and ca.at == cb.at and ca.partial == cb.partial \
                and cb.steps[2] == n and hi == cb.steps[0]:
            hi = cb.steps[1]
        else:
            return False
        partial = set(ca.partial)
        if (lo, hi) == (0, n):
            partial.discard("step")
        # parts of unequal factors (ranks whose losses are scaled apart: a
        # per-rank mean): the sum claimed at the later part's, which holds
        # only if the other part is zero; the claim is proved or refuted
        scale = cb.scale if not zb else ca.scale
        self.sv[out], self.mb[out] = self.sv[a], self.mb.get(a, -1)
        self.claim[out] = Claim([list(d) for d in ca.dims], frozenset(partial), ca.mbs, scale,
                                ca.at, None if (lo, hi) == (0, n) else (lo, hi, n))
        return True

    def anchored(self, nodes: list[LNode]) -> list[LNode]:
        """``nodes``, with the ring's merged out and lse among their outputs
        claimed as the single-device attention's (53 (d))."""
        for node in nodes:
            for o in node.outs:
                if o in self.low.anchors:
                    self.anchor(o)
        return nodes

    def anchor(self, o: int) -> None:
        """Claim a value the shim names: the ring's merged out or lse as the
        single-device attention's of the rank's query over the keys and
        values its local ones are pieces of (53 (d)); the ring backward's
        dq, dk or dv as that attention's gradient (the single-device
        ``attention_grad`` reading the same query, keys and values) at the
        rank's query, key or value rows (66). The claims are proved."""
        kind, q, k, v = self.low.anchors[o]
        nodes = self.b.s.low.nodes
        op = "attention_grad" if kind in ("dq", "dk", "dv") else "attention"
        at = 1 if op == "attention_grad" else 0
        cands = [n for n in nodes if n.op == op and n.dir == "fw"
                 and n.ins[at] == self.sv.get(q)]
        cands.sort(key=lambda n: (n.ins[at + 1] != self.sv.get(k), n.ins[at + 2] != self.sv.get(v)))
        if not cands:
            raise AlignError(f"rank {self.low.rank}: a ring attention's result whose query the "
                             f"single-device step never attends with")
        cq, cv = self.claim[q], self.claim[v]
        if kind in ("dq", "dk", "dv"):
            like = self.claim[{"dq": q, "dk": k, "dv": v}[kind]]
            dims = [list(d) for d in like.dims]
            index = ("dq", "dk", "dv").index(kind)
        else:
            like = cq
            dims = [list(d) for d in cq.dims[:-1]]
            if kind == "out":
                dims.append(list(cv.dims[-1]))
            index = 0 if kind == "out" else 1
        self.sv[o] = cands[0].outs[index]
        if kind in ("dk", "dv"):
            self.sv[o] = self.grouped_heads_grad(self.sv[o], self.gshape({"dk": k, "dv": v}[kind]))
        self.mb[o] = self.mb.get(q, -1)
        self.claim[o] = Claim(dims, frozenset(cq.partial), cq.mbs, cq.scale, like.at)
        self.check(o)

    def grouped_heads_grad(self, sv: int, shape: tuple[int, ...]) -> int:
        """The single-device gradient of keys or values of ``shape`` read by
        an attention with more query heads (``enable_gqa``: the kernel's
        lowering repeats each key head for its group of query heads, so the
        single-device ``attention_grad`` gives the gradient of the repeated
        keys, ``sv``): the nearest value of ``shape`` the backward computes
        from ``sv`` (the repeat's backward, a sum over each group), else
        ``sv``. Only what the ring's dk or dv is claimed as; the claim is
        proved (docs/soundness.md, "Plans traced from PyTorch", 107)."""
        s = self.b.s.low
        if tuple(s.shapes[sv]) == tuple(shape):
            return sv
        readers: dict[int, list[LNode]] = {}
        for n in s.nodes:
            for x in n.ins:
                readers.setdefault(x, []).append(n)
        frontier, seen = [sv], {sv}
        for _ in range(GQA_STEPS):
            nxt = []
            for x in frontier:
                for n in readers.get(x, []):
                    for y in n.outs:
                        if y < 0 or y in seen:
                            continue
                        if tuple(s.shapes[y]) == tuple(shape):
                            return y
                        seen.add(y)
                        nxt.append(y)
            frontier = nxt
        return sv

    def infer_attention_grad(self, node: LNode) -> None:
        """dq has the query's layout, dk and dv the keys' and values'. A block
        of a ring (query rows and key rows both pieces) gives parts of the
        ring step (query chunk - key chunk) mod cp (53 (f)); with all
        keys and a piece of the queries, dk and dv are partial over the axes
        cutting the queries' rows (and dq, with all queries and a piece of
        the keys, over the keys')."""
        dout, q, k, v = node.ins[:4]
        partial: set[str] = set()
        mbs = None
        for x in node.ins:
            if x >= 0:
                partial |= self.claim[x].partial
                mbs = mbs or self.claim[x].mbs
        cq, ck = self.claim[q], self.claim[k]
        q_whole, k_whole = self.whole_rows(q), self.whole_rows(k)
        if self.low.reordered and not (q_whole and k_whole):
            # a block of a ring over a sequence in a load balancer's order:
            # loose, its sums too, up to the gradients the shim names (66)
            self.make_loose(node, [self.sv[o] if o >= 0 else -1 for o in node.outs])
            return
        for_q, for_kv = set(partial), set(partial)
        step_q = step_kv = None
        if not q_whole and not k_whole:
            step_q, step_kv = self.block_steps(node)
            for_q |= {"step"} if step_q[2] > 1 else set()
            for_kv |= {"step"} if step_kv[2] > 1 else set()
        elif not q_whole:
            for_kv |= set(cq.dims[-2])
        elif not k_whole:
            for_q |= set(ck.dims[-2])
        mb = node.mb if node.mb >= 0 else max((self.mb.get(x, -1) for x in node.ins), default=-1)
        for o, like, part, steps in zip(node.outs, (q, k, v), (for_q, for_kv, for_kv),
                                        (step_q, step_kv, step_kv)):
            if o < 0:
                continue
            c = self.claim[like]
            self.mb[o] = mb
            self.claim[o] = Claim([list(d) for d in c.dims], frozenset(part),
                                  mbs if "mb" in part else None, c.scale, c.at,
                                  steps if "step" in part else None)
            self.check(o)

    def block_steps(self, node: LNode) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The parts a ring block's dq and dk (dv) are, (label, label + 1, n):
        chunks qc of the queries and kc of the keys, of C equal chunks. With
        the single-device attention causal, the key chunks a query chunk
        sees are kc <= qc: dq is part qc - kc of qc + 1, dk part qc - kc of
        C - kc (the query chunks that see it); else part (qc - kc) mod C of
        C. The label is the ring step the block runs at, so a ring's sums
        cover adjacent ranges (53 (f))."""
        q, k = node.ins[1], node.ins[2]
        qr, kr = self.view(q)[0][-2], self.view(k)[0][-2]
        chunk = self.low.shapes[q][-2]
        full = self.gshape(q)[-2]
        if self.low.shapes[k][-2] != chunk or qr[0] % chunk or kr[0] % chunk or full % chunk:
            raise AlignError(f"rank {self.low.rank} runs attention_grad at {scope(node.name)} "
                             f"on query and key pieces of unequal chunks")
        qc, kc, chunks = qr[0] // chunk, kr[0] // chunk, full // chunk
        single = self.b.s_made[self.sv[node.outs[0]]]
        if not single.kwargs.get("causal"):
            label = (qc - kc) % chunks
            return (label, label + 1, chunks), (label, label + 1, chunks)
        if kc > qc:
            raise AlignError(f"rank {self.low.rank} runs attention_grad at {scope(node.name)} "
                             f"on a key block wholly after its queries (every score masked)")
        label = qc - kc
        return (label, label + 1, qc + 1), (label, label + 1, chunks - kc)
