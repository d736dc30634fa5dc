"""Plans of ring attention: one causal attention layer, its single-device
step, and its step on a ring of ``cp`` ranks that merges key blocks by
their log-sum-exps (docs/parallelism.md, "Ring attention").

The model: parameters q, k [B, S, D] and v [B, S, Dv], data r [B, S, Dv];
``out, lse = attention(q, k, v)`` (causal), ``loss = sum(out * r)``. Its
backward runs ``attention_grad`` with the forward's out and lse, as flash
kernels do; every parameter has a gradient buffer.

The ring: rank c holds sequence chunk c of q, k, v and r. At step t it
holds the key and value chunk of rank c - t (received from rank c - 1 with
``send_recv``), computes its query chunk's block against it unless that
chunk comes after its own (a block wholly above the diagonal is skipped;
a chunk no later rank computes with is not sent on), and merges the block
into its running (out, lse) with ``lse_merge``. The
backward runs ``attention_grad`` per block with the merged out and lse,
sums the blocks' dq on the rank, and sends each block's dk and dv to the
rank that holds the chunk, which sums them.

A block's output and log-sum-exp, and a running merge, are pieces of no
single-device tensor: they claim loose parts of the attention's out and
lse (parts of a partial maximum that no tensor completes), which the
verifier never assumes (docs/soundness.md, "Exponentials and logarithms").
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from verdict.plan import Logical, Node, Plan, Tensor

NAMES = ("q", "k", "v", "r", "out", "lse", "y", "loss", "loss.grad", "y.grad", "out.grad",
         "q.grad", "k.grad", "v.grad", "q.grad_buffer", "k.grad_buffer", "v.grad_buffer")
#: The masked scores' row maximum, computed and unused by the single-device
#: step of a model whose ring has the "no_shift" fault (the fault reads it).
SCORES = ("scores", "scores.scaled", "scores.masked", "rowmax")
T = {name: tid for tid, name in enumerate(NAMES + SCORES)}
WHOLE = (0, 1, 1)
#: Faults a ring can be written with, each on the last rank (the one with
#: the most blocks): a block left out of the merge, a block merged with the
#: lse of the block before it, the diagonal block masked as the chunk
#: before it (every key visible), a block's lse without its shift (the
#: kernel's row maximum not added back).
FAULTS = ("dropped_block", "other_lse", "mask_chunk", "no_shift")


@dataclass(frozen=True)
class Ring:
    """A ring attention layer: ``cp`` ranks, ``chunk`` positions each."""

    cp: int = 2
    chunk: int = 2
    batch: int = 1
    head_dim: int = 2
    value_dim: int = 2
    #: a fault of the last rank's forward, for the checks of the checker
    #: (FAULTS); "" for none
    fault: str = ""

    @property
    def seqlen(self) -> int:
        return self.cp * self.chunk

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        b, s, d, dv = self.batch, self.seqlen, self.head_dim, self.value_dim
        three = {"q": d, "k": d, "v": dv, "r": dv, "out": dv, "y": dv, "y.grad": dv,
                 "out.grad": dv, "q.grad": d, "k.grad": d, "v.grad": dv, "q.grad_buffer": d,
                 "k.grad_buffer": d, "v.grad_buffer": dv}
        out = {name: (b, s, last) for name, last in three.items()}
        out.update({"lse": (b, s), "loss": (), "loss.grad": (), "rowmax": (b, s)})
        out.update({name: (b, s, s) for name in SCORES[:3]})
        return out

    def names(self) -> tuple[str, ...]:
        return NAMES + SCORES if self.fault == "no_shift" else NAMES

    def world(self, parallel: bool) -> dict:
        w = {"model": "ring_attention", "variant": "default", "gbs": self.batch, "dp": 1,
             "tp": 1, "pp": 1, "ep": 1, "nm": 1, "seqlen": self.seqlen, "heads": 1,
             "head_dim": self.head_dim, "value_dim": self.value_dim, "optimizer": "none"}
        if parallel:
            w["cp"] = self.cp
        return w

    def logical(self) -> list[Logical]:
        kinds = {"q": "param", "k": "param", "v": "param", "r": "data", "loss": "loss"}
        shapes = self.shapes()
        return [Logical(n, shapes[n], kinds.get(n, "grad" if n.endswith(".grad") else
                                                "gradbuf" if n.endswith("_buffer") else "act"))
                for n in self.names()]

    def attention_kw(self, row: int = 0, col: int = 0) -> dict:
        return {"scale": self.scale, "causal": True, "row_chunk": row, "col_chunk": col}


class _Writer:
    """Tensors with SSA versions per (rank, tensor) and nodes, in order."""

    def __init__(self, ring: Ring, parallel: bool):
        self.ring = ring
        self.plan = Plan(world=ring.world(parallel), logical=ring.logical(), loss=T["loss"],
                         grads={T[p]: T[f"{p}.grad_buffer"] for p in ("q", "k", "v")})
        self.versions: Counter = Counter()
        self.loose_count = 0
        self.shapes = ring.shapes()

    def piece(self, rank: int, mb: int, name: str, chunk: int | None,
              parts: tuple[int, int, int] = WHOLE, lver: int = 0, cols: int | None = None
              ) -> int:
        """Tensor ``name`` on ``rank``: sequence chunk ``chunk`` (None: whole),
        of the key positions too for scores (``cols``)."""
        full = self.shapes[name]
        slices = [(0, n) for n in full]
        for dim, at in ((1, chunk), (2, cols)):
            if at is not None:
                slices[dim] = (at * self.ring.chunk, (at + 1) * self.ring.chunk)
        shape = tuple(b - a for a, b in slices)
        tid = T[name]
        version = self.versions[(rank, tid)]
        self.versions[(rank, tid)] += 1
        self.plan.tensors.append(Tensor(rank, mb, tid, version, shape, lver, tuple(slices),
                                        parts))
        return len(self.plan.tensors) - 1

    def loose(self) -> tuple[int, int, int]:
        """Parts of a value of no single-device tensor: one part of a
        partial maximum that no other tensor's parts complete (each call
        its own), so it is never grouped nor assumed."""
        self.loose_count += 1
        return (0, 1, -(self.loose_count + 1))

    def node(self, rank: int, op: str, direction: str, inputs, outputs, kw=None,
             name: str = "", mb: int = 0) -> None:
        self.plan.nodes.append(Node(rank, mb, op, direction, tuple(inputs), tuple(outputs),
                                    dict(kw or {}), name or op))

    def buffers(self, rank: int, grads: dict[str, int], chunk: int | None) -> None:
        for p in ("q", "k", "v"):
            name = f"{p}.grad_buffer"
            zero = self.piece(rank, -1, name, chunk)
            self.node(rank, "zeros", "none", [], [zero],
                      {"shape": list(self.plan.tensors[zero].shape)}, name, mb=-1)
            done = self.piece(rank, 0, name, chunk, lver=1)
            self.node(rank, "local_grad_accumulation", "none", [zero, grads[p]], [done], {},
                      name)


def single_plan(ring: Ring) -> Plan:
    """The single-device step of the layer."""
    w = _Writer(ring, parallel=False)
    q, k, v = (w.piece(0, -1, n, None) for n in ("q", "k", "v"))
    r = w.piece(0, 0, "r", None)
    out, lse = w.piece(0, 0, "out", None), w.piece(0, 0, "lse", None)
    if ring.fault == "no_shift":
        _row_max(w, ring, 0, q, k, None, None)
    w.node(0, "attention", "fw", [q, k, v], [out, lse], ring.attention_kw())
    y = w.piece(0, 0, "y", None)
    w.node(0, "mul", "fw", [out, r], [y])
    loss = w.piece(0, 0, "loss", None)
    w.node(0, "sum", "fw", [y], [loss], {"dim": None, "keepdim": False})
    seed = w.piece(0, 0, "loss.grad", None)
    w.node(0, "ones", "bw", [], [seed], {"shape": []}, "loss.grad")
    dy = w.piece(0, 0, "y.grad", None)
    w.node(0, "sum", "bw", [-1, seed], [dy], {"dim": None, "keepdim": False})
    dout = w.piece(0, 0, "out.grad", None)
    w.node(0, "mul", "bw", [out, r, dy], [dout, -1])
    grads = {p: w.piece(0, 0, f"{p}.grad", None) for p in ("q", "k", "v")}
    w.node(0, "attention_grad", "bw", [dout, q, k, v, out, lse],
           [grads["q"], grads["k"], grads["v"]], ring.attention_kw())
    w.buffers(0, grads, None)
    return w.plan


def _row_max(w: _Writer, ring: Ring, rank: int, q: int, k: int, row: int | None,
             col: int | None, parts: tuple[int, int, int] = WHOLE) -> int:
    """The row maximum of the masked scores of q against k (chunks row and
    col; None: whole), written out: einsum, scale, causal mask, max."""
    s, scaled, masked = (w.piece(rank, 0, n, row, cols=col) for n in SCORES[:3])
    w.node(rank, "einsum", "fw", [q, k], [s], {"eq": "bqd,bkd->bqk"}, "scores")
    w.node(rank, "mul_scalar", "fw", [s], [scaled], {"value": ring.scale}, "scores.scaled")
    w.node(rank, "causal_mask", "fw", [scaled], [masked],
           {"row_chunk": row or 0, "col_chunk": col or 0}, "scores.masked")
    top = w.piece(rank, 0, "rowmax", row, parts)
    w.node(rank, "max", "fw", [masked], [top], {"dim": -1, "keepdim": False}, "rowmax")
    return top


def _unshifted(w: _Writer, ring: Ring, c: int, b: int, q: int, k: int, lse: int) -> int:
    """lse minus the block's row maximum of its masked scores: the
    log-sum-exp of the shifted scores, as a kernel that forgets to add its
    shift back returns it. The block's row maximum is part b of the partial
    maximum over key chunks of the single-device row maximum."""
    top = _row_max(w, ring, c, q, k, c, b, (b, b + 1, -ring.cp))
    out = w.piece(c, 0, "lse", c, w.loose())
    w.node(c, "sub", "fw", [lse, top], [out], {}, "ring.unshifted")
    return out


def ring_plan(ring: Ring) -> Plan:
    """The step on a ring of ``ring.cp`` ranks (module docstring)."""
    w = _Writer(ring, parallel=True)
    C = ring.cp
    q, k, v, r = ({c: w.piece(c, -1 if n != "r" else 0, n, c) for c in range(C)}
                  for n in ("q", "k", "v", "r"))
    # the ring: at step t rank c holds the chunk of rank c - t
    arrivals: dict[int, list[tuple[int, int, int]]] = {c: [(c, k[c], v[c])] for c in range(C)}
    held = {c: (k[c], v[c]) for c in range(C)}
    # a chunk is sent on while a rank after it still computes with it
    needed = {(C - 1, c): (c + 1) % C <= c for c in range(C)}
    for t in range(C - 2, -1, -1):
        needed.update({(t, c): (c - t) % C <= c or needed[(t + 1, (c + 1) % C)]
                       for c in range(C)})
    for t in range(1, C):
        moved = {}
        for c in range(C):
            src, chunk = (c - 1) % C, (c - t) % C
            if not needed[(t, c)]:
                continue
            kk, vv = w.piece(c, 0, "k", chunk), w.piece(c, 0, "v", chunk)
            w.node(c, "send_recv", "fw", [held[src][0]], [kk], {"src": src, "dst": c}, "ring.k")
            w.node(c, "send_recv", "fw", [held[src][1]], [vv], {"src": src, "dst": c}, "ring.v")
            moved[c] = (kk, vv)
            arrivals[c].append((chunk, kk, vv))
        held = moved
    blocks = {c: [a for a in arrivals[c] if a[0] <= c] for c in range(C)}
    outs, lses, losses = {}, {}, {}
    for c in range(C):
        fault = ring.fault if c == C - 1 and len(blocks[c]) > 1 else ""
        merged = blocks[c][:-1] if fault == "dropped_block" else blocks[c]
        run, previous = None, -1
        for i, (b, kk, vv) in enumerate(merged):
            final = i == len(merged) - 1
            alone = len(merged) == 1
            o = w.piece(c, 0, "out", c, WHOLE if alone else w.loose())
            lo = w.piece(c, 0, "lse", c, WHOLE if alone else w.loose())
            col = b - 1 if fault == "mask_chunk" and b == c else b
            w.node(c, "attention", "fw", [q[c], kk, vv], [o, lo], ring.attention_kw(c, col),
                   f"ring.block{i}")
            if fault == "no_shift" and final:
                lo = _unshifted(w, ring, c, b, q[c], kk, lo)
            if run is None:
                run, previous = (o, lo), lo
                continue
            if fault == "other_lse" and final:
                lo = previous
            previous = lo
            parts = WHOLE if final else w.loose()
            mo, ml = w.piece(c, 0, "out", c, parts), w.piece(c, 0, "lse", c, parts)
            w.node(c, "lse_merge", "fw", [run[0], run[1], o, lo], [mo, ml], {}, f"ring.merge{i}")
            run = (mo, ml)
        outs[c], lses[c] = run
        y = w.piece(c, 0, "y", c)
        w.node(c, "mul", "fw", [outs[c], r[c]], [y])
        losses[c] = w.piece(c, 0, "loss", None, (c, c + 1, C))
        w.node(c, "sum", "fw", [y], [losses[c]], {"dim": None, "keepdim": False})
    # backward
    dk_parts: dict[int, list[tuple[int, int, int]]] = {b: [] for b in range(C)}
    grads: dict[int, dict[str, int]] = {c: {} for c in range(C)}
    for c in range(C):
        seed = w.piece(c, 0, "loss.grad", None)
        w.node(c, "ones", "bw", [], [seed], {"shape": []}, "loss.grad")
        dy = w.piece(c, 0, "y.grad", c)
        w.node(c, "sum", "bw", [-1, seed], [dy], {"dim": None, "keepdim": False})
        dout = w.piece(c, 0, "out.grad", c)
        w.node(c, "mul", "bw", [outs[c], r[c], dy], [dout, -1])
        n = len(blocks[c])
        dq = None
        for i, (b, kk, vv) in enumerate(blocks[c]):
            part = WHOLE if n == 1 else (i, i + 1, n)
            g = w.piece(c, 0, "q.grad", c, part)
            m = C - b  # query chunks b..C-1 see key chunk b
            key_part = WHOLE if m == 1 else (c - b, c - b + 1, m)
            gk, gv = w.piece(c, 0, "k.grad", b, key_part), w.piece(c, 0, "v.grad", b, key_part)
            w.node(c, "attention_grad", "bw", [dout, q[c], kk, vv, outs[c], lses[c]], [g, gk, gv],
                   ring.attention_kw(c, b), f"ring.block{i}")
            dk_parts[b].append((c, gk, gv))
            if dq is None:
                dq = g
                continue
            total = w.piece(c, 0, "q.grad", c, WHOLE if i == n - 1 else (0, i + 1, n))
            w.node(c, "add", "none", [dq, g], [total], {}, "ring.dq")
            dq = total
        grads[c]["q"] = dq
    for b in range(C):
        m = C - b
        run = None
        for c, gk, gv in sorted(dk_parts[b]):
            if c != b:  # sent back to the chunk's rank
                key_part = (c - b, c - b + 1, m)
                rk, rv = w.piece(b, 0, "k.grad", b, key_part), w.piece(b, 0, "v.grad", b, key_part)
                w.node(b, "send_recv", "bw", [gk], [rk], {"src": c, "dst": b}, "ring.dk")
                w.node(b, "send_recv", "bw", [gv], [rv], {"src": c, "dst": b}, "ring.dv")
                gk, gv = rk, rv
            if run is None:
                run = (gk, gv)
                continue
            parts = WHOLE if c == C - 1 else (0, c - b + 1, m)
            tk, tv = w.piece(b, 0, "k.grad", b, parts), w.piece(b, 0, "v.grad", b, parts)
            w.node(b, "add", "none", [run[0], gk], [tk], {}, "ring.dk")
            w.node(b, "add", "none", [run[1], gv], [tv], {}, "ring.dv")
            run = (tk, tv)
        grads[b]["k"], grads[b]["v"] = run
    for c in range(C):
        w.buffers(c, grads[c], c)
    return w.plan


def ring_pair(ring: Ring) -> tuple[Plan, Plan]:
    """The single-device plan and the ring's."""
    return single_plan(ring), ring_plan(ring)
