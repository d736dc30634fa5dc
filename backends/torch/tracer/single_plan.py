"""The single-device plan of the lowered single-device trace, and the
logical tensors both plans share: ``Builder`` numbers them and writes the
single-device plan; the parallel plan's writer (``build``) reads it to align
every rank's values with the single-device ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from backends.torch.lowering import LNode, Lowered, LoweringError
from backends.torch.tracer.align.claim import key_kwargs, scope
from verdict.plan import Logical, Node, Plan, Tensor


@dataclass
class Single:
    low: Lowered
    tid: dict[int, int] = field(default_factory=dict)  # S value -> logical id
    by_key: dict[tuple, list[int]] = field(default_factory=dict)  # node key -> S node indices
    lver: dict[int, int] = field(default_factory=dict)  # S value -> its logical version (updates)


def node_kind(node: LNode) -> str:
    return "grad" if node.dir == "bw" or node.name.startswith("bw:") else "act"


class Builder:
    def __init__(self, single: Lowered, world: dict):
        # its own copy of the shapes: a constant of ranks only that no
        # single-device constant stands for is given a value of its own there
        # (``own_value``)
        self.s = Single(replace(single, shapes=dict(single.shapes)))
        self.world = world
        self.logical: list[Logical] = []
        self.plan_s = Plan(world={**world, "dp": 1, "tp": 1, "pp": 1, "cp": 1, "nm": 1})
        self.gradbuf: dict[str, int] = {}
        self.own_inputs: dict[str, int] = {}  # a constant no single-device one matches -> tid
        self.own_shaped: dict[int, tuple[int, ...]] = {}  # such a tid -> its full shape (own_shape)
        self.loose = 0  # loose values numbered so far (``loose_number``)
        #: each single-device value -> the node that makes it
        self.s_made = {o: node for node in single.nodes for o in node.outs if o >= 0}

    # -- single-device plan ---------------------------------------------------
    def logical_of(self, name: str, shape, kind: str) -> int:
        self.logical.append(Logical(name, tuple(int(n) for n in shape), kind))
        return len(self.logical) - 1

    def own_input(self, name: str, shape: tuple[int, ...], kind: str) -> int:
        """A logical input that only ranks read (one per constant's name,
        which is its value's digest: ranks holding the same value read the
        same input): written into the single-device plan as an input no node
        reads."""
        if name in self.own_inputs:
            return self.own_inputs[name]
        tid = self.own_inputs[name] = self.logical_of(name, shape, kind)
        mb = -1 if kind in ("param", "buffer") else 0
        self.plan_s.tensors.append(Tensor(0, mb, tid, 0, tuple(shape), 0,
                                          tuple((0, n) for n in shape), (0, 1, 1)))
        return tid

    def own_value(self, tid: int, shape: tuple[int, ...]) -> int:
        """A single-device value standing for the logical input ``tid`` of
        ranks only (``own_input``), which no single-device node reads: the
        value a rank's constant is aligned with when it is a piece of no
        single-device constant and no single-device node reads a constant
        where the rank reads it (``InputMatching.own_constant``)."""
        for sv, t in self.s.tid.items():
            if t == tid:
                return sv
        sv = max(self.s.low.shapes) + 1
        self.s.low.shapes[sv] = tuple(shape)
        self.s.tid[sv] = tid
        return sv

    def own_shape(self, sv: int, shape: tuple[int, ...]) -> None:
        """The full shape of the input of ranks only that ``sv`` stands for
        (``own_value``), as its first reader's ties give it
        (``NodeMatching.stand_in_piece``): in its logical tensor and the
        single-device plan's input of it."""
        tid = self.s.tid[sv]
        if tid in self.own_shaped and self.own_shaped[tid] != shape:
            raise LoweringError(f"an input of ranks only ({self.logical[tid].name}) is read as a "
                                f"piece of {list(self.own_shaped[tid])} and of {list(shape)}")
        self.own_shaped[tid] = shape
        self.s.low.shapes[sv] = shape
        self.logical[tid] = self.logical[tid]._replace(shape=shape)
        for k, t in enumerate(self.plan_s.tensors):
            if t.tid == tid:
                self.plan_s.tensors[k] = t._replace(shape=shape,
                                                    slices=tuple((0, n) for n in shape))

    def build_single(self) -> Plan:
        s, plan = self.s.low, self.plan_s
        t_of: dict[int, int] = {}

        def tensor(v: int, mb: int, version: int = 0, tid: int | None = None) -> int:
            tid = self.s.tid[v] if tid is None else tid
            shape = self.logical[tid].shape
            plan.tensors.append(Tensor(0, mb, tid, version, tuple(shape), version,
                                       tuple((0, n) for n in shape), (0, 1, 1)))
            return len(plan.tensors) - 1

        for v, (kind, name) in s.inputs.items():
            self.s.tid[v] = self.logical_of(name, s.shapes[v], kind)
            t_of[v] = tensor(v, -1 if kind in ("param", "buffer") else 0)
        param_of = {name: v for v, (kind, name) in s.inputs.items() if kind == "param"}
        updated = {v: param_of[name] for name, v in s.updates.items()}
        state_names = {v: f"{name}.{k}" for name, st in s.states.items() for k, v in st.items()}
        for i, node in enumerate(s.nodes):
            for o in node.outs:
                if o in updated:  # the parameter's next version (the optimizer step)
                    self.s.tid[o] = self.s.tid[updated[o]]
                    self.s.lver[o] = 1
                    t_of[o] = tensor(o, 0, 1)
                elif o >= 0:
                    kind = "loss" if o in s.losses else node_kind(node)
                    name = state_names.get(o, f"{scope(node.name)}.{node.op}.{o}")
                    self.s.tid[o] = self.logical_of(name, s.shapes[o], kind)
                    t_of[o] = tensor(o, 0)
            ins = tuple(-1 if v < 0 else t_of[v] for v in node.ins)
            outs = tuple(-1 if v < 0 else t_of[v] for v in node.outs)
            plan.nodes.append(Node(0, 0, node.op, node.dir, ins, outs, dict(node.kwargs),
                                   scope(node.name)))
            key = (node.op, node.dir, tuple(-1 if v < 0 else v for v in node.ins),
                   key_kwargs(node.kwargs))
            self.s.by_key.setdefault(key, []).append(i)
        self.sum_trees(s)
        params = {name: v for v, (kind, name) in s.inputs.items() if kind == "param"}
        for name, v in params.items():
            g = s.grads.get(name)
            if g is None:
                continue
            buf = self.logical_of(f"{name}.grad_buffer", s.shapes[v], "gradbuf")
            self.gradbuf[name] = buf
            zero = tensor(v, -1, 0, buf)
            plan.nodes.append(Node(0, -1, "zeros", "none", (), (zero,),
                                   {"shape": list(s.shapes[v])}, f"{name}.grad_buffer"))
            final = tensor(v, 0, 1, buf)
            plan.nodes.append(Node(0, 0, "local_grad_accumulation", "none", (zero, t_of[g]),
                                   (final,), {}, f"{name}.grad_buffer"))
            plan.grads[self.s.tid[v]] = buf
        plan.logical = self.logical
        plan.loss = self.s.tid[s.losses[0]]
        return plan


    def sum_trees(self, s: Lowered) -> None:
        """Trees of additions (autograd summing gradient contributions), by the
        multiset of their leaves, so that a rank summing the same terms in
        another order is matched (addition is associative in exact arithmetic)."""
        uses: dict[int, int] = {}
        for node in s.nodes:
            for v in node.ins:
                uses[v] = uses.get(v, 0) + 1
        self.s_add: dict[int, LNode] = {}
        leaves: dict[int, list[int]] = {}
        for node in s.nodes:
            if node.op != "add":
                continue
            self.s_add[node.outs[0]] = node
            atoms = []
            for v in node.ins:
                atoms += leaves[v] if v in leaves and uses.get(v) == 1 else [v]
            leaves[node.outs[0]] = atoms
        self.s_trees = {tuple(sorted(a)): v for v, a in leaves.items()}
        self.s_leaves = leaves
        self.s_uses = uses

    def leaves_of(self, sv: int) -> list[int]:
        """The terms of a single-device value as a sum (itself if it is none)."""
        single = sv in self.s_leaves and self.s_uses.get(sv) == 1
        return list(self.s_leaves[sv]) if single else [sv]

    def superset(self, leaves: list[int], accept=lambda root: True) -> int | None:
        """The smallest single-device sum with all these terms and more (and
        that ``accept`` takes)."""
        want: dict[int, int] = {}
        for x in leaves:
            want[x] = want.get(x, 0) + 1
        found = sorted((len(key), root) for key, root in self.s_trees.items()
                       if len(key) > len(leaves) and accept(root)
                       and all(key.count(x) >= n for x, n in want.items()))
        return found[0][1] if found else None

    def loose_number(self) -> int:
        """A fresh number for a loose value's part (53 (e))."""
        self.loose += 1
        return self.loose
