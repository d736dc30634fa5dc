"""A claim carried through an operator: each output dim cut by the axes of
the input dims its relations tie it to (``Op.relations``), an input dim
that reaches no output summed away (the output partial over its axes),
and each output's exact factor from its inputs' factors."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from backends.torch.lowering import LNode
from backends.torch.tracer.align.claim import Claim, Pieces
from verdict.numeric import NumericXP, run_node
from verdict.ops import get_op
from verdict.plan import Node

#: Operators whose output is the sum of their inputs (a scaled input must
#: have the scale of the others, up to a replicated value split n ways).
ADDITIONS = ("add", "sub", "local_grad_accumulation")

#: forward views and sums of one input: a piece read at another holder's
#: coordinates (a received key, ``Claim.at``) is still read there through
#: them (a key head repeated for its query heads, its gradient summed over
#: them; docs/soundness.md, "Plans traced from PyTorch", 107)
AT_CARRIERS = ("unflatten", "flatten", "expand", "transpose", "permute", "sum")


def probe_scale(node: LNode, shapes: dict[int, tuple[int, ...]],
                scales: list[Fraction]) -> list[Fraction]:
    """The factor of each output of ``node`` when its inputs are scaled by
    ``scales``: run it on positive random inputs, then on the inputs times
    their factors, and read one common ratio per output (1 when there is
    none: the output is not a multiple of the unscaled one, and its claim,
    which the verifier proves, then says so). A guess: the claim is proved."""
    rng = np.random.default_rng(0)
    args = [None if v < 0 else rng.uniform(0.5, 1.5, shapes[v]) for v in node.ins]
    out_shapes = [None if o < 0 else shapes[o] for o in node.outs]
    fake = Node(0, 0, node.op, node.dir, tuple(node.ins), tuple(node.outs), dict(node.kwargs))
    try:
        with np.errstate(all="ignore"):
            base = run_node(NumericXP(), fake, args, out_shapes)
            scaled = run_node(NumericXP(), fake, [None if a is None else a * float(f)
                                                  for a, f in zip(args, scales)], out_shapes)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError):
        return [Fraction(1)] * len(node.outs)
    out = []
    for a, b in zip(base, scaled):
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        keep = np.isfinite(a) & np.isfinite(b) & (np.abs(a) > 1e-12)
        if not keep.any():
            out.append(Fraction(1))
            continue
        ratio = b[keep] / a[keep]
        guess = Fraction(float(np.median(ratio))).limit_denominator(10**6)
        exact = np.allclose(ratio, float(guess), rtol=1e-9, atol=0) and np.allclose(
            b[~keep & np.isfinite(a)], 0, atol=1e-12)
        out.append(guess if exact and guess != 0 else Fraction(1))
    return out


def _find(parent: dict[tuple, tuple], x: tuple) -> tuple:
    """The class of a dim reference in a union-find forest."""
    while parent.get(x, x) != x:
        x = parent[x]
    return x


class Dims(Pieces):
    """The claims a rank's operators give their outputs."""

    consumers: dict[int, list[LNode]]

    def infer(self, node: LNode) -> None:
        """The claims of a compute node's outputs, from its inputs' claims
        (a backward node: ``infer_backward``)."""
        ins = [v for v in node.ins]
        shapes_in = [None if v < 0 else self.low.shapes[v] for v in ins]
        outs = [o for o in node.outs]
        partial: set[str] = set()
        mbs = None
        steps = None
        for v in ins:
            if v >= 0:
                partial |= self.claim[v].partial
                mbs = mbs or self.claim[v].mbs
                steps = steps or self.claim[v].steps
        if node.op in ("ones", "zeros"):
            partial = set()
        if node.dir == "bw":
            self.infer_backward(node, partial, mbs)
            for o in outs:
                if o >= 0 and "step" in self.claim[o].partial:
                    self.claim[o].steps = steps
            return
        shapes_out = [self.low.shapes[o] for o in outs]
        rel = get_op(node.op).relations(shapes_in, shapes_out, node.kwargs)
        dims_out, source = self.carried_dims(rel, ins, outs)
        partial |= self.summed_axes(rel, ins, shapes_out)
        held = [v for v in ins if v >= 0]
        at = self.claim[held[0]].at if node.op in AT_CARRIERS and len(held) == 1 else None
        self.claim_outputs(outs, dims_out, source, partial, mbs, steps, at)

    def carried_dims(self, rel: list, ins: list[int], outs: list[int]
                     ) -> tuple[list[list], dict[tuple[int, int], int]]:
        """The axes each output dim carries from the input dims its
        relations tie it to (None: no relation says), and, for an output
        dim equal to an input dim, the full size it came from."""
        dims_out = [[None] * len(self.low.shapes[o]) for o in outs]
        source: dict[tuple[int, int], int] = {}  # an output dim -> the full size it came from
        for r in rel:
            if r[0] == "eq":
                a, c = r[1], r[2]
                if a[0] == "i":
                    a, c = c, a
                if a[0] == "o" and c[0] == "i":
                    axes = self.claim[ins[c[1]]].dims[c[2]]
                    if dims_out[a[1]][a[2]] is None or (axes and not dims_out[a[1]][a[2]]):
                        dims_out[a[1]][a[2]] = list(axes)
                        source[(a[1], a[2])] = self.gshape(ins[c[1]])[c[2]]
            elif r[0] == "mul":
                target, factors = r[1], r[2]
                if target[0] == "o":  # flatten: the output dim is the product
                    axes = []
                    for f in factors:
                        axes += self.claim[ins[f[1]]].dims[f[2]]
                    dims_out[target[1]][target[2]] = axes
                else:  # unflatten: the input dim is the product of output dims
                    axes = list(self.claim[ins[target[1]]].dims[target[2]])
                    for f in factors:
                        if f[0] != "o":
                            continue
                        o, d = f[1], f[2]
                        full = self.b.s.low.shapes[self.sv[outs[o]]][d]
                        local = self.low.shapes[outs[o]][d]
                        if axes and local < full:
                            # the outer axes first, as many as cut this dim (a merged
                            # batch and heads dim cut by "mb" and "tp" splits into both)
                            take = 1
                            while take < len(axes) and math.prod(
                                    self.sizes.get(a, 1) for a in axes[:take]) * local < full:
                                take += 1
                            if math.prod(self.sizes.get(a, 1) for a in axes[:take]) * local != full:
                                take = len(axes)
                            dims_out[o][d], axes = axes[:take], axes[take:]
                        elif dims_out[o][d] is None:
                            dims_out[o][d] = []
        return dims_out, source

    def summed_axes(self, rel: list, ins: list[int], shapes_out: list) -> set[str]:
        """The axes of the input dims that reach no output dim through the
        relations (a contraction): the outputs are partial sums over them."""
        parent: dict[tuple, tuple] = {}
        for r in rel:
            refs = [r[1], r[2]] if r[0] == "eq" else ([r[1], *r[2]] if r[0] == "mul" else [])
            for x in refs[1:]:
                parent[_find(parent, tuple(x))] = _find(parent, tuple(refs[0]))
        reaches_out = {_find(parent, ("o", o, d))
                       for o, sh in enumerate(shapes_out) for d in range(len(sh))}
        summed: set[str] = set()
        for i, v in enumerate(ins):
            if v < 0:
                continue
            for d, axes in enumerate(self.claim[v].dims):
                if axes and _find(parent, ("i", i, d)) not in reaches_out:
                    summed |= set(axes)
        return summed

    def claim_outputs(self, outs: list[int], dims_out: list[list], source: dict,
                      partial: set[str], mbs, steps=None,
                      at: dict[str, int] | None = None) -> None:
        """Each output's claim: the carried axes that give its local size,
        else its consumers' (``hint``), else a guess; then checked."""
        for o, v in enumerate(outs):
            full = self.gshape(v)
            dims = [axes if axes is not None and self.fits(axes, full[d], self.low.shapes[v][d],
                                                           source.get((o, d)))
                    else None for d, axes in enumerate(dims_out[o])]
            for d, axes in enumerate(dims):
                if axes is None:
                    dims[d] = self.hint(v, d, self.low.shapes[v][d], full[d])
            for d, axes in enumerate(dims):
                if axes is None:
                    used = tuple(a for x in dims if x for a in x)
                    # dim 0 is the batch (data-parallel rows, then microbatches)
                    # "cp" last: a rank's rows no consumer ties to a claimed value
                    # (the sink's expand beside chunks of the scores; soundness.md, 130 (b))
                    order = ((("dp",), ("mb",), ("dp", "mb"), ("tp",), ("dp", "tp"), ("cp",))
                             if d == 0 else
                             (("dp",), ("tp",), ("dp", "tp"), ("mb",), ("dp", "mb"), ("cp",)))
                    dims[d] = self.guess(self.low.shapes[v][d], full[d], used, order)
            self.claim[v] = Claim(dims, frozenset(partial), mbs if "mb" in partial else None,
                                  steps=steps if "step" in partial else None,
                                  at=dict(at) if at and any(dims) else None)
            self.check(v, uneven=True)

    def hint(self, v: int, d: int, local: int, full: int) -> list[str] | None:
        """The axes cutting dim d of v as its consumers see it: a dim of another
        input of a consumer that the consumer's dims relations tie to it (a
        broadcast constant expanded for a batched matmul is cut as the other
        operand is; an optimizer state as its parameter), when those axes
        give the local size; None if none does."""
        for node in self.consumers.get(v, []):
            if node.group is not None or node.dir == "bw":
                continue
            shapes_in = [None if x < 0 else self.low.shapes[x] for x in node.ins]
            shapes_out = [self.low.shapes[o] for o in node.outs if o >= 0]
            try:
                rel = get_op(node.op).relations(shapes_in, shapes_out, node.kwargs)
            except Exception:  # a consumer whose relations need other kwargs: no hint
                continue
            parent: dict[tuple, tuple] = {}
            for r in rel:
                if r[0] == "eq":
                    parent[_find(parent, tuple(r[1]))] = _find(parent, tuple(r[2]))
            mine = {_find(parent, ("i", i, d)) for i, x in enumerate(node.ins) if x == v}
            for i, x in enumerate(node.ins):
                if x < 0 or x == v or x not in self.claim:
                    continue
                for e, axes in enumerate(self.claim[x].dims):
                    if axes and _find(parent, ("i", i, e)) in mine \
                            and self.extent(axes, full) == local:
                        return list(axes)
        return None

    def infer_backward(self, node: LNode, partial: set[str], mbs) -> None:
        grad = self.claim[node.ins[-1]]
        for o in node.outs:
            if o < 0:
                continue
            if node.op == "embedding":
                tokens = self.claim[node.ins[0]]
                dims = [list(tokens.dims[-1]), list(grad.dims[-1])]
                extra = {a for d in grad.dims[:-1] for a in d}
                self.claim[o] = Claim(dims, frozenset(partial | extra), mbs)
            elif node.op == "max":  # the gradient has the shape, and the layout, of the input
                self.claim[o] = Claim([list(d) for d in self.claim[node.ins[0]].dims],
                                      frozenset(partial), mbs)
            else:
                # one input: read where it is read (``AT_CARRIERS``: a sum of a
                # received key's repeated heads' gradients)
                at = grad.at if len([x for x in node.ins if x >= 0]) == 1 else None
                self.claim[o] = Claim([list(d) for d in grad.dims], frozenset(partial), mbs,
                                      at=dict(at) if at else None)
            self.check(o)

    def scales_of(self, node: LNode) -> list[Fraction]:
        """The factor of each output, from its inputs' factors: a sum keeps
        its terms' common factor (a replicated term divided by n counts as a
        part of an n-way partial sum, DTensor's bias on a Partial value);
        any other operator is probed (``probe_scale``)."""
        ins = [v for v in node.ins]
        scales = [Fraction(1) if v < 0 else self.claim[v].scale for v in ins]
        if node.op == "mean" and min(node.ins[0], node.outs[0]) >= 0:
            # a mean over a dim cut by mesh axes divides by the local count:
            # the product of those axes' sizes times its share
            x = node.ins[0] if node.dir != "bw" else node.outs[0]
            nd = len(self.low.shapes[x])
            dims = node.kwargs.get("dim")
            dims = range(nd) if dims is None else [d % nd for d in (
                dims if isinstance(dims, (list, tuple)) else [dims])]
            axes = {a for d in dims for a in self.claim[x].dims[d]}
            cut = math.prod(self.sizes[a] for a in axes)
            return [scales[-1] * cut] * len(node.outs)
        if all(f == 1 for f in scales):
            return [Fraction(1)] * len(node.outs)
        if node.op in ADDITIONS:
            partial = [set() if v < 0 else set(self.claim[v].partial) for v in ins]
            union = set().union(*partial)
            lifted = set()
            for v, f, own in zip(ins, scales, partial):
                if v >= 0:
                    lifted.add(f * math.prod(self.sizes[a] for a in union - own))
            if len(lifted) == 1:
                return [lifted.pop()] * len(node.outs)
            return [Fraction(1)] * len(node.outs)
        return probe_scale(node, self.low.shapes, scales)
