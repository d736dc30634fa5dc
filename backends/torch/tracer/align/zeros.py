"""Exact zeros by their making, and zeros claimed at the factor of the
values they are read with."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import Claim, Pieces, key_kwargs
from verdict.numeric import NumericXP, run_node
from verdict.plan import Node


def maps_zero_to_zero(node: LNode, shapes: dict[int, tuple[int, ...]]) -> bool:
    """``node`` run on zeros gives exact zeros (its meaning, evaluated
    once: a guess for a factor's claim, which the verifier proves)."""
    args = [None if v < 0 else np.zeros(shapes[v]) for v in node.ins]
    out_shapes = [None if o < 0 else shapes[o] for o in node.outs]
    fake = Node(0, 0, node.op, node.dir, tuple(node.ins), tuple(node.outs), dict(node.kwargs))
    try:
        with np.errstate(all="ignore"):
            outs = run_node(NumericXP(), fake, args, out_shapes)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError):
        return False
    return all(o is None or not np.any(np.asarray(o, dtype=float)) for o in outs)


class Zeros(Pieces):
    """Which of a rank's values are exact zeros by their making."""

    zero_memo: dict[int, bool]
    fresh: int

    def zeros_at_common_scale(self, node: LNode) -> tuple[LNode, list[LNode]]:
        """``node`` reading, in place of each exact zero whose factor is not
        the one factor of its other inputs, fresh zeros claimed at that
        factor (zeros are every multiple of themselves; a ``cat`` of a block
        of zeros and a gradient scaled by a per-rank mean): the zeros made
        first. Each claim is proved like any other (docs/soundness.md,
        "Plans traced from PyTorch", 40)."""
        ins = [v for v in node.ins if v >= 0]
        zero = {v for v in ins if self.is_zero(v)}
        others = {self.claim[v].scale for v in ins if v not in zero}
        if len(others) != 1:
            return node, []
        scale = others.pop()
        made, swap = [], {}
        for v in zero:
            if self.claim[v].scale == scale:
                continue
            target = self.fresh
            self.fresh += 1
            c = self.claim[v]
            self.low.shapes[target] = self.low.shapes[v]
            self.sv[target], self.mb[target] = self.sv[v], self.mb.get(v, -1)
            self.claim[target] = Claim([list(d) for d in c.dims], c.partial, c.mbs, scale, c.at)
            zeros = LNode("zeros", "none", [], [target],
                          {"shape": list(self.low.shapes[v])}, node.name)
            self.producer[target], self.zero_memo[target] = zeros, True
            made.append(zeros)
            swap[v] = target
        if not swap:
            return node, []
        return replace(node, ins=[swap.get(v, v) for v in node.ins]), made

    def is_zero(self, v: int) -> bool:
        """Value v is exactly zero by its making in the plan: a ``zeros``
        node, or an operator that gives zeros on zeros (a reshape, a slice,
        a ``cat``: ``maps_zero_to_zero``) of zeros, or a product with a
        factor of zeros (by the meaning of ``mul``). A loaded constant is not
        zero by making even when its traced value is: the verifier reads it
        as any value, so a claim that fresh zeros are a multiple of it could
        never be proved. Its makers are walked with a stack, not by
        recursion (a long chain of values deferred as sums is never asked
        one by one)."""
        memo, stack, opened = self.zero_memo, [v], set()
        while stack:
            u = stack[-1]
            if u in memo:
                stack.pop()
                continue
            made = self.producer.get(u)
            if made is None:
                memo[u] = False
            elif made.op == "zeros" and not made.ins:
                memo[u] = True
            else:
                ins = [w for w in made.ins if w >= 0]
                todo = [w for w in ins if w not in memo]
                if todo and u not in opened:
                    opened.add(u)
                    stack.extend(todo)
                    continue
                if todo:  # a value read by its own maker: not zero by making
                    memo[u] = False
                    stack.pop()
                    continue
                # a product with a factor of zeros is zeros whatever the
                # other factor (a gradient buffer's zeros times a mask)
                memo[u] = bool(ins) and (all(memo[w] for w in ins)
                                         and maps_zero_to_zero(made, self.low.shapes)
                                         or made.op == "mul" and made.dir == "fw"
                                         and any(memo[w] for w in ins))
            stack.pop()
        return memo[v]

    def zeros_of_no_piece(self, node: LNode) -> bool:
        """``node`` makes zeros of no input whose shape is a piece of none of
        the single-device ``zeros`` it keys alike with (sizes are left out
        of keys): as many dims, none larger. Such zeros (a stale range of a
        buffer gathered, 96 elements flat where the step's zeros are [4,
        24]) are no piece of any of them, so they are left loose, claimed as
        nothing: a reader's stage recomputes them, and a final value made of
        them is compared as what it is (docs/soundness.md, "Plans traced from
        PyTorch", 122 (a))."""
        if node.op != "zeros" or node.ins or len(node.outs) != 1:
            return False
        shape = tuple(self.low.shapes[node.outs[0]])
        key = (node.op, node.dir, (), key_kwargs(node.kwargs))
        full = self.b.s.low.shapes
        for c in self.b.s.by_key.get(key, []):
            so = self.b.s.low.nodes[c].outs[0]
            if so >= 0 and len(full[so]) == len(shape) \
                    and all(m <= f for m, f in zip(shape, full[so])):
                return False
        return True
