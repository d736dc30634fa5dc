"""Build the single-device plan and the parallel plan from lowered traces.

With ``single_plan`` (the single-device plan), this is the only module of
the backend that constructs plans (through ``verdict.plan``'s in-memory API).

Every parallel value is aligned with the single-device value it computes:
inputs by name, a computing node with the single-device node of the same
operator reading the aligned inputs, a collective's output with its input.
Its claim (which slice, which parts of a partial sum) is inferred: each dim
carries the mesh axes that cut it, taken from parameter placements and the
data-parallel batch split, carried through each operator's dims relations
(``Op.relations``), moved by collectives, and summed away by contractions
(a contracted dim cut by an axis makes the result partial over that axis).
An inference is never trusted: every claim of a computed tensor is proved
by the verifier, so a wrong one is a FAIL, not an assumption.
"""

from __future__ import annotations

from backends.torch.errors import AlignError
from backends.torch.lowering import LNode, Lowered, LoweringError
from backends.torch.tracer.align.aligned import AlignedRank
from backends.torch.tracer.align.claim import Claim, is_marker, scope, strided
from backends.torch.tracer.final_blocks import write_final_blocks
from backends.torch.tracer.guards import describe_guards, match_guards, same_branches
from backends.torch.tracer.joint_order import Channels, joint_order
from backends.torch.tracer.rank_guards import drop_unread_norms, settle_rank_only
from backends.torch.tracer.redeliver import redeliver
from backends.torch.tracer.single_plan import Builder
from backends.torch.tracer.strided_plan import rejoin, strided_grads, strided_input
from verdict.plan import Node, Plan, Tensor


def build_plans(single: Lowered, ranks: list[Lowered], world: dict) -> tuple[Plan, Plan]:
    """The single-device plan and the parallel plan of the lowered traces."""
    assumed = settle_rank_only(single, ranks)  # a norm's truth value on a rank (113 (f))
    same_branches(single, ranks)
    if single.guards:  # the branches a SUCCESS covers (docs/soundness.md, 69-71)
        world = {**world, "guards": describe_guards(single.guards)}
    if assumed:
        drop_unread_norms(ranks)
        world = {**world, "assumed": "; ".join(assumed)}
    b = Builder(single, world)
    plan_s = b.build_single()
    writer = _Writer(b, ranks, world, plan_s)
    writer.walk()
    writer.materialize_finals()
    writer.complete_grads()
    writer.refuse_loose_finals()
    writer.grad_buffers()
    write_final_blocks(writer)
    match_guards(single, plan_s, writer.plan, writer.t_of,
                 [r.low for r in writer.rs.values()], writer.b)
    return plan_s, writer.plan


def _rank_sizes(ranks: list[Lowered], world: dict) -> dict[str, int]:
    """The mesh sizes the ranks' claims read (``dpr`` and ``dps`` when the
    parameters are sharded over groups of the data-parallel ranks)."""
    sizes = {"dp": world["dp"], "cp": world.get("cp", 1), "tp": world["tp"], "mb": world["nm"],
             "step": world.get("cp", 1)}
    shards = {low.split["dps"] for low in ranks if "dps" in low.split}
    if len(shards) > 1:
        raise LoweringError(f"the ranks shard their parameters over data-parallel groups of "
                            f"different sizes {sorted(shards)}")
    if shards:
        s = shards.pop()
        sizes.update(dpr=world["dp"] // s, dps=s)
    for low in ranks:  # a strided dim's marker cuts nothing by itself (item 87)
        sizes.update({a: 1 for dims in low.axes.values() for axes in dims for a in axes
                      if is_marker(a)})
    return sizes


class _Writer:
    """The parallel plan, written node by node in the ranks' joint order:
    each rank's claims inferred (``AlignedRank``), its tensors numbered in
    versions, collectives wired to their peers' inputs."""

    def __init__(self, b: Builder, ranks: list[Lowered], world: dict, plan_s: Plan) -> None:
        self.b = b
        self.ranks = ranks
        sizes = _rank_sizes(ranks, world)
        self.rs = {low.rank: AlignedRank(b, low, sizes) for low in ranks}
        self.channels = Channels(ranks)
        self.coords = {rank: r.low.coords for rank, r in self.rs.items()}
        self.plan = Plan(world=dict(world), logical=list(b.logical), loss=plan_s.loss,
                         grads=dict(plan_s.grads))
        self.versions: dict[tuple[int, int, int], int] = {}
        self.t_of: dict[tuple[int, int], int] = {}
        self.recv_node: dict[int, int] = {}  # a received tensor -> its send_recv node
        self.redelivered: dict[int, set[int]] = {}  # rank -> misdelivered values rewritten
        self.emitted: dict[int, int] = {}  # id of a rank's node -> its plan node
        #: a strided value's claimed blocks, (rank, value) -> plan tensors (item 87, 116 (c))
        self.strided_blocks: dict[tuple[int, int], list[int]] = {}
        for r in self.rs.values():
            for v in r.low.inputs:
                self.write_input(r, v)

    def write_input(self, r: AlignedRank, v: int) -> None:
        """Rank r's input v as a tensor of the plan."""
        kind = r.low.inputs[v][0]
        mb = r.mb[v] if v in r.split_from else -1 if kind in ("param", "buffer") else 0
        if kind == "param" and strided(r.claim[v].dims) is not None:
            self.t_of[(r.low.rank, v)] = strided_input(self, r, v)  # item 87
            return
        # an input of its own made while aligning (a copy's, ``copy_constant``)
        self.plan.logical.extend(self.b.logical[len(self.plan.logical):])
        self.t_of[(r.low.rank, v)] = self.tensor(r, v, mb, tid=r.own_tid.get(v))

    def tensor(self, r: AlignedRank, v: int, mb: int, tid: int | None = None,
               lver: int | None = None) -> int:
        """A new version of rank r's value v as a tensor of the plan."""
        b = self.b
        tid = b.s.tid[r.sv[v]] if tid is None else tid
        lver = b.s.lver.get(r.sv[v], 0) if lver is None else lver
        key = (r.low.rank, mb, tid)
        version = self.versions.get(key, 0)
        self.versions[key] = version + 1
        slices, parts = r.view(v)
        f = r.claim[v].scale
        self.plan.tensors.append(Tensor(r.low.rank, mb, tid, version, tuple(r.low.shapes[v]),
                                        lver, slices, parts, (f.numerator, f.denominator)))
        return len(self.plan.tensors) - 1

    def peer_input(self, q: int, node: LNode, k: int) -> int:
        """The value rank q gives to the collective ``node`` (its k-th)."""
        peer = self.rs[q]
        return peer.low.nodes[self.channels.nth(peer.low, node, k)].ins[0]

    def emit(self, r: AlignedRank, node: LNode, k: int) -> None:
        for u in r.copies:  # a constant's copy for one reader (``choose_constants``)
            self.write_input(r, u)
        r.copies.clear()
        if r.copied:
            self.copy_inputs(r)
        if r.retagged:
            self.retag(r)
        if r.reclaimed:
            self.reclaim(r)
        if len(r.misdelivered) > len(self.redelivered.get(r.low.rank, ())):
            redeliver(self, r)  # item 102
        low, t_of = r.low, self.t_of
        for o in node.outs:
            if o >= 0:
                t_of[(low.rank, o)] = self.tensor(r, o, max(r.mb.get(o, -1), 0))
        if node.op == "send_recv":
            src = node.group[0]
            ins = (t_of[(src, self.peer_input(src, node, k))],)
            kwargs = dict(node.kwargs)
        elif node.group is None:
            ins = tuple(-1 if v < 0 else t_of[(low.rank, v)] for v in node.ins)
            kwargs = dict(node.kwargs)
        else:
            ins = tuple(t_of[(q, self.peer_input(q, node, k))] for q in node.group)
            kwargs = {**node.kwargs, "index": node.group.index(low.rank)}
        outs = tuple(-1 if v < 0 else t_of[(low.rank, v)] for v in node.outs)
        mb = max((r.mb.get(o, -1) for o in node.outs if o >= 0), default=-1)
        self.emitted[id(node)] = len(self.plan.nodes)
        self.plan.nodes.append(Node(low.rank, max(mb, 0), node.op, node.dir, ins, outs, kwargs,
                                    scope(node.name)))
        for o in node.outs:
            if o >= 0 and strided(r.claim[o].dims) is not None:
                rejoin(self, r, o, scope(node.name))  # item 87

    def materialize(self, r: AlignedRank, x: int) -> None:
        """Rank r's pending value x written out, if it is pending."""
        if x in r.pending:
            for extra in r.materialize(x):
                self.emit(r, extra, -1)

    def walk(self) -> None:
        """Every rank's nodes in the joint order."""
        for i, n, k in joint_order(self.ranks):
            low = self.ranks[i]
            r = self.rs[low.rank]
            node = low.nodes[n]
            if node.op == "send_recv":
                peer = self.rs[node.group[0]]
                x = self.peer_input(peer.low.rank, node, k)
                self.materialize(peer, x)
                r.receive(node, peer, x)
                r.received_as(node.outs[0], peer.low.rank)
                r.anchored([node])
                self.emit(r, node, k)
                self.recv_node[self.t_of[(r.low.rank, node.outs[0])]] = len(self.plan.nodes) - 1
                continue
            if node.op == "all_reduce" and self.sum_across(r, node, k):
                continue
            if node.group is not None and node.op != "send":
                for q in node.group:
                    self.materialize(self.rs[q], self.peer_input(q, node, k))
            for out in r.step(node, self.coords):
                self.emit(r, out, k)

    def materialize_finals(self) -> None:
        """The gradients and losses the ranks end with, written out."""
        for r in self.rs.values():
            for name in list(r.low.grads):
                self.materialize(r, r.low.grads[name])
            for blocks in r.low.grad_blocks.values():
                for v, *_ in blocks:
                    self.materialize(r, v)
            for loss in r.low.losses:
                self.materialize(r, loss)
            for guard in r.low.guards:
                self.materialize(r, guard[0])
            for runs in r.low.final_runs.values():  # a distributed optimizer's ranges (item 90)
                for src, v, _, _ in runs:
                    self.materialize(self.rs[src], v)

    def complete_grads(self) -> None:
        """A rank's gradient that is a piece of one term of the single-device
        gradient's sum (its one local expert's gradient, padded to the
        experts' weights): the sum's other terms written as zeros, each
        claimed to be its term's piece, and the whole sum added in the
        single-device order (``Sums.zero_terms``, as for a rank's several
        experts' gradients; docs/soundness.md, "Plans traced from PyTorch",
        54 (f), 99)."""
        for r in self.rs.values():
            held = {n: p for p, (kind, n) in r.low.inputs.items() if kind == "param"}
            for name, g in r.low.grads.items():
                whole = self.b.s.low.grads.get(name)
                if g is not None and whole is not None and name in held and g not in r.pending \
                        and r.is_loose(g) and r.is_zero(g):
                    # zeros by their making (item 125 c): the pieces of the
                    # single-device sum's terms, each proved zero
                    v = r.fresh
                    r.fresh += 1
                    for node in r.zero_gradient(v, r.claim[held[name]],
                                                tuple(r.low.shapes[g]), whole):
                        self.emit(r, node, -1)
                    r.low.grads[name] = v
                    continue
                if g is None or whole is None or g in r.pending or r.sv.get(g) == whole \
                        or r.sv.get(g) not in self.b.s_leaves.get(whole, ()) \
                        or not r.same_piece([g]):
                    continue
                v = r.fresh
                r.fresh += 1
                r.low.shapes[v] = r.low.shapes[g]
                for node in r.zero_terms(v, [g], [r.sv[g]], whole):
                    self.emit(r, node, -1)
                r.low.grads[name] = v

    def grad_buffers(self) -> None:
        """Each held parameter's gradient accumulated into its zeroed
        buffer, the final gradient of the plan."""
        for r in self.rs.values():
            held = {n: v for v, (kind, n) in r.low.inputs.items() if kind == "param"}
            for name, buf in self.b.gradbuf.items():
                if name not in held:
                    continue  # another pipeline stage's parameter
                if name in r.low.grad_blocks:
                    self.block_grads(r, name, buf)
                    continue
                if strided(r.claim[held[name]].dims) is not None:
                    strided_grads(self, r, name, held[name], buf)  # item 87
                    continue
                g = r.low.grads.get(name)
                param = held[name]
                if g is None:
                    # the final contract reports that the rank ends with no
                    # gradient of a parameter it holds (exit 1; 92 (e))
                    continue
                rank = r.low.rank
                zero_claim = r.claim[param]
                r.claim[-1 - buf] = Claim([list(d) for d in zero_claim.dims])
                r.sv[-1 - buf] = r.sv[param]
                r.low.shapes[-1 - buf] = r.low.shapes[param]
                zero = self.tensor(r, -1 - buf, -1, buf, 0)
                self.plan.nodes.append(Node(rank, -1, "zeros", "none", (), (zero,),
                                            {"shape": list(r.low.shapes[param])},
                                            f"{name}.grad_buffer"))
                final = self.tensor(r, g, 0, buf, 1)
                self.plan.nodes.append(Node(rank, 0, "local_grad_accumulation", "none",
                                            (zero, self.t_of[(rank, g)]), (final,), {},
                                            f"{name}.grad_buffer"))

    def plain_tensor(self, like: Tensor, tid: int, mb: int, shape: tuple[int, ...], lver: int,
                     slices: tuple[tuple[int, int], ...]) -> int:
        """A new tensor of the plan with ``like``'s parts and factor."""
        key = (like.rank, mb, tid)
        version = self.versions.get(key, 0)
        self.versions[key] = version + 1
        self.plan.tensors.append(Tensor(like.rank, mb, tid, version, tuple(shape), lver,
                                        tuple(slices), like.parts, like.scale))
        return len(self.plan.tensors) - 1

    def block_grads(self, r: AlignedRank, name: str, buf: int) -> None:
        """A parameter whose final gradient is blocks of values (the flat
        range of it a distributed optimizer reads: ``Lowered.grad_blocks``):
        each block cut from its value by ``narrow`` nodes, one per dim it
        cuts, the block's slices the value's offset by its starts (the
        verifier proves each such claim like any), then accumulated into
        its zeroed block of the gradient buffer, a final gradient of the
        plan (docs/soundness.md, "Plans traced from PyTorch", 57). The
        plan's world says so (``grad_blocks``): the final check then reads
        each rank's blocks and requires the ranks' blocks to cover every
        parameter (``verdict/final.py``)."""
        rank = r.low.rank
        self.plan.world["grad_blocks"] = 1
        for v, starts, shape, own in r.low.grad_blocks[name]:
            t = self.t_of[(rank, v)]
            if own:
                self.own_block(r, name, buf, t, starts, shape)
                continue
            src = self.plan.tensors[t]
            if any(b - a != n for (a, b), n in zip(src.slices, src.shape)) \
                    or len(src.slices) != len(shape):
                raise LoweringError(f"rank {rank}: a block of the final gradient of {name} lies "
                                    f"in a value that is no plain block of a single-device value")
            slices = list(src.slices)
            at_shape = list(src.shape)
            for d, (s, n) in enumerate(zip(starts, shape)):
                if (s, n) == (0, at_shape[d]):
                    continue
                slices[d] = (slices[d][0] + s, slices[d][0] + s + n)
                at_shape[d] = n
                out = self.plain_tensor(src, src.tid, src.mb, tuple(at_shape), src.lver,
                                        tuple(slices))
                self.plan.nodes.append(Node(rank, max(src.mb, 0), "narrow", "none", (t,), (out,),
                                            {"dim": d, "start": s, "length": n},
                                            f"{name}.grad_buffer"))
                t, src = out, self.plan.tensors[out]
            zero = self.plain_tensor(Tensor(rank, -1, buf, 0, (), 0, (), (0, 1, 1)), buf, -1,
                                     tuple(shape), 0, tuple(slices))
            self.plan.nodes.append(Node(rank, -1, "zeros", "none", (), (zero,),
                                        {"shape": list(shape)}, f"{name}.grad_buffer"))
            final = self.plain_tensor(src, buf, 0, tuple(shape), 1, tuple(slices))
            self.plan.nodes.append(Node(rank, 0, "local_grad_accumulation", "none", (zero, t),
                                        (final,), {}, f"{name}.grad_buffer"))

    def own_block(self, r: AlignedRank, name: str, buf: int, t: int, starts: tuple[int, ...],
                  shape: tuple[int, ...]) -> None:
        """A block of the final gradient whose elements the lowering found
        elsewhere than at the range map's starts (``_grad_block``): the
        value ``t`` read there, accumulated into the zeroed block of the
        gradient buffer at the rank's held shard offset by ``starts``. The
        final tensor is claimed whole at factor 1, the contract's claim, and
        its stage proves it from ``t``'s producers or refutes it
        (docs/soundness.md, "Plans traced from PyTorch", 91 (b))."""
        rank = r.low.rank
        held = {n: p for p, (kind, n) in r.low.inputs.items() if kind == "param"}
        shard = self.plan.tensors[self.t_of[(rank, held[name])]].slices
        if len(shard) != len(shape):
            raise LoweringError(f"rank {rank}: a block of the final gradient of {name} has "
                                f"{len(shape)} dims, its parameter {len(shard)}")
        slices = tuple((a + s, a + s + n) for (a, _), s, n in zip(shard, starts, shape))
        like = Tensor(rank, -1, buf, 0, (), 0, (), (0, 1, 1))
        zero = self.plain_tensor(like, buf, -1, tuple(shape), 0, slices)
        self.plan.nodes.append(Node(rank, -1, "zeros", "none", (), (zero,),
                                    {"shape": list(shape)}, f"{name}.grad_buffer"))
        final = self.plain_tensor(like, buf, 0, tuple(shape), 1, slices)
        self.plan.nodes.append(Node(rank, 0, "local_grad_accumulation", "none", (zero, t),
                                    (final,), {}, f"{name}.grad_buffer"))

    def sum_across(self, r: AlignedRank, node: LNode, k: int) -> bool:
        """An all-reduce of sums whose terms together make single-device
        terms, each member holding some of them, whole or as its part (the
        stages' squared gradient norms summed over a pipeline, a trainer's
        squared norms of sharded gradients on every rank and of replicated
        ones on one rank, an exact zero on a rank that counts none): written,
        on each member, as receiving the other members' terms, adding the
        pieces of each single-device term (claimed as the all-reduce claims
        them: partial over fewer axes), and adding those in the
        single-device order, or leaving them a deferred sum when they are
        only some of a single-device sum's terms (addition is associative
        and commutative in exact arithmetic; every member's term is used
        once: docs/soundness.md, "Plans traced from PyTorch", 3 and 29).
        False when the members reduce one value (an ordinary all-reduce)."""
        units, zero = {}, False
        for q in node.group:
            x = self.peer_input(q, node, k)
            units[q] = [] if x in self.rs[q].zeros else self.rs[q].terms(x)
            zero |= x in self.rs[q].zeros
        if not zero and len({self.rs[q].sv[u] for q in node.group for u in units[q]}) <= 1 \
                and all(len(us) == 1 for us in units.values()):
            return False
        by_sv: dict[int, list[tuple[int, int]]] = {}
        for q in node.group:
            for u in units[q]:
                by_sv.setdefault(self.rs[q].sv[u], []).append((q, u))
        s_leaves = sorted(t for sv in by_sv for t in self.b.leaves_of(sv))
        root = self.b.s_trees.get(tuple(s_leaves))
        if root is None and (len(by_sv) < 2 or self.b.superset(s_leaves) is None):
            if zero:
                raise AlignError(f"rank {r.low.rank} all-reduces at {scope(node.name)} terms "
                                 f"that make no single-device sum")
            return False
        # the mesh axes the group runs along (several for a flattened group;
        # none for pipeline stages, whose terms are whole)
        axes = {a for a in r.axes if len({self.coords[q][a] for q in node.group}) > 1}
        out = node.outs[0]
        avail = {sv: self.combine(r, sv, terms, axes, node) for sv, terms in by_sv.items()}
        if root is None and len(by_sv) == 1:  # the all-reduce's value is that one term's sum
            acc = avail[next(iter(by_sv))]
            self.t_of[(r.low.rank, out)] = self.t_of[(r.low.rank, acc)]
            r.sv[out], r.mb[out], r.claim[out] = r.sv[acc], r.mb.get(acc, -1), r.claim[acc]
            r.low.shapes[out] = r.low.shapes[acc]
            return True
        if root is None:
            r.pending[out] = list(avail.values())
            return True

        def add_tree(sv: int, target: int | None) -> int:
            if sv in avail:
                return avail.pop(sv)
            s_node = self.b.s_add[sv]
            a, c = add_tree(s_node.ins[0], None), add_tree(s_node.ins[1], None)
            if target is None:
                target = r.fresh
                r.fresh += 1
                r.low.shapes[target] = r.low.shapes[a]
            new = LNode("add", s_node.dir, [a, c], [target], {}, s_node.name)
            r.one(new, {})
            self.emit(r, new, -1)
            return target

        add_tree(root, out)
        if avail:  # every member's term is added once, or the sum is not written
            raise AlignError(f"rank {r.low.rank} all-reduces at {scope(node.name)} terms the "
                             f"single-device sum they stand for does not add")
        return True

    def combine(self, r: AlignedRank, sv: int, terms: list[tuple[int, int]], axes: set[str],
                node: LNode) -> int:
        """Rank r's sum of the members' pieces of one single-device term,
        summed one mesh axis of the group at a time (innermost first): the
        pieces that differ only along that axis are added, and their sum
        is claimed partial over one axis fewer, at their common
        coordinates (a piece no other member completes keeps its claim;
        the verifier proves or refutes each claim)."""
        items = [(dict(self.coords[q]), u if q == r.low.rank else self.received(r, self.rs[q], u, node))
                 for q, u in terms]
        done: set[str] = set()
        for axis in [a for a in reversed(r.axes) if a in axes]:
            done.add(axis)
            merged: dict[tuple, list[tuple[dict, int]]] = {}
            for at, v in items:
                merged.setdefault(tuple(at[a] for a in r.axes if a not in done),
                                  []).append((at, v))
            items = []
            for same in merged.values():
                at, acc = same[0]
                for _, v in same[1:]:
                    target = r.fresh
                    r.fresh += 1
                    r.low.shapes[target] = r.low.shapes[acc]
                    ca, cv = r.claim[acc], r.claim[v]
                    partial = (ca.partial | cv.partial) - {axis}
                    held = {a for d in ca.dims for a in d} | partial
                    where = {a: at[a] for a in held if a in at and at[a] != r.low.coords[a]}
                    r.sv[target], r.mb[target] = sv, -1
                    r.claim[target] = Claim([list(d) for d in ca.dims], partial, ca.mbs,
                                            ca.scale, where or None)
                    self.emit(r, LNode("add", "fw", [acc, v], [target], {}, node.name), -1)
                    acc = target
                items.append((at, acc))
        if len(items) != 1:
            raise AlignError(f"rank {r.low.rank} all-reduces at {scope(node.name)} pieces of "
                             f"one term over ranks {list(node.group)} that no mesh axis joins")
        return items[0][1]

    def received(self, r: AlignedRank, peer: AlignedRank, u: int, node: LNode) -> int:
        """Rank r's copy of ``peer``'s term u (a ``send_recv``): the same
        piece, its axes read at the peer's coordinates."""
        target = r.fresh
        r.fresh += 1
        c = peer.claim[u]
        at = {a: peer.low.coords[a] for a in [*(a for d in c.dims for a in d), *c.partial]
              if a != "mb" and peer.low.coords.get(a, 0) != r.low.coords.get(a, 0)}
        r.sv[target], r.mb[target] = peer.sv[u], -1
        r.claim[target] = Claim([list(d) for d in c.dims], c.partial, c.mbs, c.scale, at or None)
        r.low.shapes[target] = peer.low.shapes[u]
        self.t_of[(r.low.rank, target)] = self.tensor(r, target, 0)
        self.plan.nodes.append(Node(r.low.rank, 0, "send_recv", "fw", (self.t_of[(peer.low.rank, u)],),
                                 (self.t_of[(r.low.rank, target)],),
                                 {"src": peer.low.rank, "dst": r.low.rank}, scope(node.name)))
        return target

    def retag(self, r: AlignedRank) -> None:
        """The tensors of values whose match ``choose_twins`` moved to an
        equal single-device value, renamed as that value's (their last
        version of the old name given back)."""
        for v in r.retagged:
            t = self.t_of[(r.low.rank, v)]
            old = self.plan.tensors[t]
            key = (old.rank, old.mb, old.tid)
            if self.versions.get(key) != old.version + 1:
                raise LoweringError(f"rank {r.low.rank}: a value matched again after a later "
                                    f"version of its match was written")
            self.versions[key] = old.version
            tid = self.b.s.tid[r.sv[v]]
            new = (old.rank, old.mb, tid)
            version = self.versions.get(new, 0)
            self.versions[new] = version + 1
            self.plan.tensors[t] = old._replace(tid=tid, version=version,
                                                lver=self.b.s.lver.get(r.sv[v], 0))
        r.retagged.clear()

    def copy_inputs(self, r: AlignedRank) -> None:
        """The tensors of constants a rank copied for a reader
        (``Rechoice.copy_for``), and that reader, if written already,
        given the copy in place of the constant."""
        rank = r.low.rank
        for c, u, reader in r.copied:
            kind = r.low.inputs[u][0]
            mb = r.mb[u] if u in r.split_from else -1 if kind in ("param", "buffer") else 0
            t = self.tensor(r, u, mb)
            self.t_of[(rank, u)] = t
            at = self.emitted.get(id(reader))
            if at is not None:
                old, n = self.t_of[(rank, c)], self.plan.nodes[at]
                ins = tuple(t if x == old else x for x in n.inputs)
                self.plan.nodes[at] = n._replace(inputs=ins)
        r.copied.clear()

    def reclaim(self, r: AlignedRank) -> None:
        """The tensors written for values whose claim changed after
        (``AlignedRank.reclaimed``), given their new slices, and their logical
        tensor its full shape (a constant of the rank's own: ``own_shape``)."""
        for v in r.reclaimed:
            t = self.t_of[(r.low.rank, v)]
            slices, parts = r.view(v)
            old = self.plan.tensors[t]
            self.plan.tensors[t] = old._replace(slices=slices, parts=parts)
            self.plan.logical[old.tid] = self.b.logical[old.tid]
        r.reclaimed.clear()

    def refuse_loose_finals(self) -> None:
        """A loss or gradient a rank ends with that is loose (computed from
        attention over part of the keys whose merge no ring result names:
        a ring written by hand, outside the CP shim) is refused in one line:
        it names no single-device value, so no claim about it could be
        proved (docs/soundness.md, "Plans traced from PyTorch", 53 (e))."""
        for r in self.rs.values():
            finals = [*r.low.losses, *(g for g in r.low.grads.values() if g is not None)]
            zero = next((n for n, g in r.low.grads.items()
                         if g is not None and r.is_loose(g) and r.is_zero(g)), None)
            if zero is not None:
                # zeros by their making (an expert-parallel placeholder's
                # backward, lowering/zero_flow.py): no claim ties them to the
                # single-device gradient, whose piece they must be
                raise AlignError(f"rank {r.low.rank} ends with zeros by their making as its "
                                 f"gradient of {zero} (the backward of a value no reader read: "
                                 f"a placeholder row its experts ran on), and no claim ties "
                                 f"zeros to a piece of the single-device gradient")
            if any(r.is_loose(v) for v in finals):
                raise AlignError(f"rank {r.low.rank} runs attention over part of the keys and "
                                 f"merges the blocks into a value the single-device step never "
                                 f"combines that way (a ring is verified when its merged result "
                                 f"is named: backends/torch/zoo/cp_shim.py ring_result)")
