"""Plans of ring attention: one causal attention layer, its single-device
step, and its step on a ring of ``cp`` ranks that merges key blocks by
their log-sum-exps (docs/parallelism.md, "Ring attention").

The model: data x [B, S, H] and r [B, S, Dv], parameters wq, wk [D, H]
and wv [Dv, H]; ``q, k, v = linear(x, w*)``, ``out, lse = attention(q, k,
v)`` (causal), ``loss = sum(out * r)``. Its backward runs
``attention_grad`` with the forward's out and lse, as flash kernels do,
then the projections' backward; every weight has a gradient buffer.

The ring: the sequence is cut into ``cp`` chunks, rank c holding chunk c,
or, load-balanced, into 2 cp chunks, rank c holding chunks c and
2 cp - 1 - c (PyTorch's head-tail balancer, Megatron's layout). Weights
are replicated. Each rank projects its chunks; at step t it holds the key
and value chunks of rank c - t (received from rank c - 1 with
``send_recv``; a chunk no later rank computes with is not sent on), runs
each of its query chunks against each key chunk not after it (a block
wholly above the diagonal is skipped) and merges the block into that query
chunk's running (out, lse) with ``lse_merge``. The backward runs
``attention_grad`` per block with the merged out and lse, sums a query
chunk's dq over its blocks, sends each block's dk and dv to the rank that
holds the key chunk, which sums them, and accumulates the weights'
gradients per chunk; a reducer sums the buffers over the ranks.

A block's output and log-sum-exp, and a running merge, are pieces of no
single-device tensor: they claim loose parts of the attention's out and
lse (parts of a partial maximum that no tensor completes), which the
verifier never assumes (docs/soundness.md, "Exponentials and logarithms").
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass

from verdict.plan import Logical, Node, Plan, Tensor

WEIGHTS = ("wq", "wk", "wv")
NAMES = ("x", "r", *WEIGHTS, "q", "k", "v", "out", "lse", "y", "loss", "loss.grad", "y.grad",
         "out.grad", "q.grad", "k.grad", "v.grad", *(f"{w}.grad" for w in WEIGHTS),
         *(f"{w}.grad_buffer" for w in WEIGHTS))
#: The masked scores' row maximum, computed and unused by the single-device
#: step of a model whose ring has the "no_shift" fault (the fault reads it),
#: or of one written with ``scores`` (what a ring's mutant that takes a
#: block's shift off claims: harness/mutations.py).
SCORES = ("scores", "scores.scaled", "scores.masked", "rowmax")
T = {name: tid for tid, name in enumerate(NAMES + SCORES)}
WHOLE = (0, 1, 1)
#: Faults a ring can be written with, each on the last rank's last query
#: chunk (the one with the most blocks): a block left out of the merge, a
#: block merged with the lse of the block before it, the diagonal block
#: masked as the chunk before it (every key visible), a block's lse without
#: its shift (the kernel's row maximum not added back).
FAULTS = ("dropped_block", "other_lse", "mask_chunk", "no_shift")


@dataclass(frozen=True)
class Ring:
    """A ring attention layer: ``cp`` ranks, ``chunk`` positions a chunk."""

    cp: int = 2
    chunk: int = 2
    batch: int = 1
    hidden: int = 2
    head_dim: int = 2
    value_dim: int = 2
    #: two chunks a rank, head and tail (load balancing of causal attention)
    balanced: bool = False
    #: a fault (FAULTS) of the last rank's forward, for the checks of the
    #: checker; "" for none
    fault: str = ""
    #: the single-device step also computes its masked scores' row maximum,
    #: unused (so that a ring's mutants have those tensors to claim)
    scores: bool = False

    @property
    def with_scores(self) -> bool:
        return self.scores or self.fault == "no_shift"

    @property
    def chunks(self) -> int:
        return self.cp * (2 if self.balanced else 1)

    @property
    def seqlen(self) -> int:
        return self.chunks * self.chunk

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def held(self, rank: int) -> list[int]:
        """The sequence chunks of a rank."""
        return [rank, 2 * self.cp - 1 - rank] if self.balanced else [rank]

    def owner(self, chunk: int) -> int:
        return chunk if chunk < self.cp else 2 * self.cp - 1 - chunk

    def part(self, chunk: int) -> int:
        """A chunk's part of a sum over chunks: by rank, then which of the
        rank's chunks, so that a rank's chunks are one range."""
        return 2 * self.owner(chunk) + int(chunk >= self.cp) if self.balanced else chunk

    def shapes(self) -> dict[str, tuple[int, ...]]:
        b, s, h, d, dv = self.batch, self.seqlen, self.hidden, self.head_dim, self.value_dim
        last = {"x": h, "r": dv, "q": d, "k": d, "v": dv, "out": dv, "y": dv, "y.grad": dv,
                "out.grad": dv, "q.grad": d, "k.grad": d, "v.grad": dv}
        out = {name: (b, s, n) for name, n in last.items()}
        for w, rows in zip(WEIGHTS, (d, d, dv)):
            out.update({w: (rows, h), f"{w}.grad": (rows, h), f"{w}.grad_buffer": (rows, h)})
        out.update({"lse": (b, s), "loss": (), "loss.grad": (), "rowmax": (b, s)})
        out.update({name: (b, s, s) for name in SCORES[:3]})
        return out

    def names(self) -> tuple[str, ...]:
        return NAMES + SCORES if self.with_scores else NAMES

    def world(self, parallel: bool) -> dict:
        w = {"model": "ring_attention", "variant": "default", "gbs": self.batch, "dp": 1,
             "tp": 1, "pp": 1, "ep": 1, "nm": 1, "seqlen": self.seqlen, "hidden": self.hidden,
             "heads": 1, "head_dim": self.head_dim, "value_dim": self.value_dim,
             "optimizer": "none"}
        if parallel:
            w["cp"] = self.cp
            if self.balanced:
                w["cp_balance"] = True
        return w

    def logical(self) -> list[Logical]:
        kinds = {"x": "data", "r": "data", "loss": "loss", **{w: "param" for w in WEIGHTS}}
        shapes = self.shapes()
        return [Logical(n, shapes[n], kinds.get(n, "grad" if n.endswith(".grad") else
                                                "gradbuf" if n.endswith("_buffer") else "act"))
                for n in self.names()]

    def attention_kw(self, row: int = 0, col: int = 0) -> dict:
        return {"scale": self.scale, "causal": True, "row_chunk": row, "col_chunk": col}


class _Writer:
    """Tensors with SSA versions per (rank, tensor), and nodes in order."""

    def __init__(self, ring: Ring, parallel: bool):
        self.ring = ring
        self.plan = Plan(world=ring.world(parallel), logical=ring.logical(), loss=T["loss"],
                         grads={T[w]: T[f"{w}.grad_buffer"] for w in WEIGHTS})
        self.versions: Counter = Counter()
        self.loose_count = 0
        self.shapes = ring.shapes()

    def piece(self, rank: int, mb: int, name: str, chunk: int | None = None,
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

    def project(self, rank: int, x: int, weights: dict[str, int], chunk: int | None
                ) -> dict[str, int]:
        out = {}
        for name, w in zip("qkv", WEIGHTS):
            out[name] = self.piece(rank, 0, name, chunk)
            self.node(rank, "linear", "fw", [x, weights[w]], [out[name]], {}, name)
        return out

    def project_back(self, rank: int, x: int, weights: dict[str, int], grads: dict[str, int],
                     chunk: int | None, parts: tuple[int, int, int]) -> dict[str, int]:
        out = {}
        for name, w in zip("qkv", WEIGHTS):
            out[w] = self.piece(rank, 0, f"{w}.grad", None, parts)
            self.node(rank, "linear", "bw", [x, weights[w], grads[name]], [-1, out[w]], {}, name)
        return out


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


def single_plan(ring: Ring) -> Plan:
    """The single-device step of the layer."""
    w = _Writer(ring, parallel=False)
    weights = {name: w.piece(0, -1, name) for name in WEIGHTS}
    x, r = w.piece(0, 0, "x"), w.piece(0, 0, "r")
    qkv = w.project(0, x, weights, None)
    if ring.with_scores:
        _row_max(w, ring, 0, qkv["q"], qkv["k"], None, None)
    out, lse = w.piece(0, 0, "out"), w.piece(0, 0, "lse")
    w.node(0, "attention", "fw", [qkv["q"], qkv["k"], qkv["v"]], [out, lse], ring.attention_kw())
    y = w.piece(0, 0, "y")
    w.node(0, "mul", "fw", [out, r], [y])
    loss = w.piece(0, 0, "loss")
    w.node(0, "sum", "fw", [y], [loss], {"dim": None, "keepdim": False})
    seed = w.piece(0, 0, "loss.grad")
    w.node(0, "ones", "bw", [], [seed], {"shape": []}, "loss.grad")
    dy = w.piece(0, 0, "y.grad")
    w.node(0, "sum", "bw", [-1, seed], [dy], {"dim": None, "keepdim": False})
    dout = w.piece(0, 0, "out.grad")
    w.node(0, "mul", "bw", [out, r, dy], [dout, -1])
    grads = {n: w.piece(0, 0, f"{n}.grad") for n in "qkv"}
    w.node(0, "attention_grad", "bw", [dout, qkv["q"], qkv["k"], qkv["v"], out, lse],
           [grads["q"], grads["k"], grads["v"]], ring.attention_kw())
    wgrads = w.project_back(0, x, weights, grads, None, WHOLE)
    for name in WEIGHTS:
        buf = f"{name}.grad_buffer"
        zero = w.piece(0, -1, buf)
        w.node(0, "zeros", "none", [], [zero], {"shape": list(ring.shapes()[buf])}, buf, mb=-1)
        done = w.piece(0, 0, buf, lver=1)
        w.node(0, "local_grad_accumulation", "none", [zero, wgrads[name]], [done], {}, buf)
    return w.plan


def _unshifted(w: _Writer, ring: Ring, rank: int, a: int, b: int, q: int, k: int,
               lse: int) -> int:
    """lse minus the block's row maximum of its masked scores: the
    log-sum-exp of the shifted scores, as a kernel that forgets to add its
    shift back returns it. The block's row maximum is part b of the partial
    maximum over key chunks of the single-device row maximum."""
    top = _row_max(w, ring, rank, q, k, a, b, (b, b + 1, -ring.chunks))
    out = w.piece(rank, 0, "lse", a, w.loose())
    w.node(rank, "sub", "fw", [lse, top], [out], {}, "ring.unshifted")
    return out


def _rotate(w: _Writer, ring: Ring, qkv: dict[int, dict[str, int]]
            ) -> dict[int, list[tuple[int, int, int]]]:
    """The key and value chunks each rank holds, in the order they arrive:
    (chunk, k, v). A rank's chunks travel on to the next rank while a later
    rank computes with them."""
    C = ring.cp

    def used(rank: int, chunk: int) -> bool:
        return any(a >= chunk for a in ring.held(rank))

    needed = {(C - 1, c, a): used(c, a) for c in range(C) for a in ring.held((c + 1) % C)}
    for t in range(C - 2, -1, -1):
        for c in range(C):
            for a in ring.held((c - t) % C):
                needed[(t, c, a)] = used(c, a) or needed[(t + 1, (c + 1) % C, a)]
    held = {c: {a: (qkv[a]["k"], qkv[a]["v"]) for a in ring.held(c)} for c in range(C)}
    arrivals = {c: [(a, *held[c][a]) for a in ring.held(c)] for c in range(C)}
    for t in range(1, C):
        moved: dict[int, dict[int, tuple[int, int]]] = {}
        for c in range(C):
            src = (c - 1) % C
            moved[c] = {}
            for a in ring.held((c - t) % C):
                if not needed[(t, c, a)]:
                    continue
                kk, vv = w.piece(c, 0, "k", a), w.piece(c, 0, "v", a)
                w.node(c, "send_recv", "fw", [held[src][a][0]], [kk], {"src": src, "dst": c},
                       "ring.k")
                w.node(c, "send_recv", "fw", [held[src][a][1]], [vv], {"src": src, "dst": c},
                       "ring.v")
                moved[c][a] = (kk, vv)
                arrivals[c].append((a, kk, vv))
        held = moved
    return arrivals


def _merge(w: _Writer, ring: Ring, rank: int, a: int, q: int, blocks, fault: str
           ) -> tuple[int, int]:
    """Query chunk a's blocks, merged in arrival order: its (out, lse)."""
    merged = blocks[:-1] if fault == "dropped_block" else blocks
    run, previous = None, -1
    for i, (b, kk, vv) in enumerate(merged):
        final = i == len(merged) - 1
        alone = len(merged) == 1
        o = w.piece(rank, 0, "out", a, WHOLE if alone else w.loose())
        lo = w.piece(rank, 0, "lse", a, WHOLE if alone else w.loose())
        col = b - 1 if fault == "mask_chunk" and b == a else b
        w.node(rank, "attention", "fw", [q, kk, vv], [o, lo], ring.attention_kw(a, col),
               f"ring.block{i}")
        if fault == "no_shift" and final:
            lo = _unshifted(w, ring, rank, a, b, q, kk, lo)
        if run is None:
            run, previous = (o, lo), lo
            continue
        if fault == "other_lse" and final:
            lo = previous
        previous = lo
        parts = WHOLE if final else w.loose()
        mo, ml = w.piece(rank, 0, "out", a, parts), w.piece(rank, 0, "lse", a, parts)
        w.node(rank, "lse_merge", "fw", [run[0], run[1], o, lo], [mo, ml], {},
               f"ring.merge{i}")
        run = (mo, ml)
    return run


def ring_plan(ring: Ring) -> Plan:
    """The step on a ring of ``ring.cp`` ranks (module docstring)."""
    w = _Writer(ring, parallel=True)
    C, n = ring.cp, ring.chunks
    weights = {c: {name: w.piece(c, -1, name) for name in WEIGHTS} for c in range(C)}
    x = {a: w.piece(ring.owner(a), 0, "x", a) for c in range(C) for a in ring.held(c)}
    r = {a: w.piece(ring.owner(a), 0, "r", a) for c in range(C) for a in ring.held(c)}
    qkv = {a: w.project(ring.owner(a), x[a], weights[ring.owner(a)], a)
           for c in range(C) for a in ring.held(c)}
    arrivals = _rotate(w, ring, qkv)
    blocks = {a: [blk for blk in arrivals[ring.owner(a)] if blk[0] <= a]
              for c in range(C) for a in ring.held(c)}
    outs, losses = {}, {}
    for c in range(C):
        chunks = ring.held(c)
        for a in chunks:
            fault = ring.fault if (c == C - 1 and a == chunks[-1] and len(blocks[a]) > 1) else ""
            outs[a] = _merge(w, ring, c, a, qkv[a]["q"], blocks[a], fault)
            y = w.piece(c, 0, "y", a)
            w.node(c, "mul", "fw", [outs[a][0], r[a]], [y])
            losses[a] = w.piece(c, 0, "loss", None, (ring.part(a), ring.part(a) + 1, n))
            w.node(c, "sum", "fw", [y], [losses[a]], {"dim": None, "keepdim": False})
        if len(chunks) == 2:
            total = w.piece(c, 0, "loss", None, (2 * c, 2 * c + 2, n))
            w.node(c, "add", "fw", [losses[chunks[0]], losses[chunks[1]]], [total], {}, "loss")
    # backward
    dq: dict[int, int] = {}
    contributions: dict[int, list[tuple[int, int, int]]] = {a: [] for a in qkv}
    for c in range(C):
        seed = w.piece(c, 0, "loss.grad")
        w.node(c, "ones", "bw", [], [seed], {"shape": []}, "loss.grad")
        for a in ring.held(c):
            dy = w.piece(c, 0, "y.grad", a)
            w.node(c, "sum", "bw", [-1, seed], [dy], {"dim": None, "keepdim": False})
            dout = w.piece(c, 0, "out.grad", a)
            w.node(c, "mul", "bw", [outs[a][0], r[a], dy], [dout, -1])
            count = len(blocks[a])
            for i, (b, kk, vv) in enumerate(blocks[a]):
                g = w.piece(c, 0, "q.grad", a, WHOLE if count == 1 else (i, i + 1, count))
                m = n - b  # the query chunks b..n-1 see key chunk b
                key_part = WHOLE if m == 1 else (a - b, a - b + 1, m)
                gk, gv = w.piece(c, 0, "k.grad", b, key_part), w.piece(c, 0, "v.grad", b, key_part)
                w.node(c, "attention_grad", "bw",
                       [dout, qkv[a]["q"], kk, vv, outs[a][0], outs[a][1]], [g, gk, gv],
                       ring.attention_kw(a, b), f"ring.block{i}")
                contributions[b].append((a, gk, gv))
                if i:
                    total = w.piece(c, 0, "q.grad", a, WHOLE if i == count - 1 else (0, i + 1, count))
                    w.node(c, "add", "none", [dq[a], g], [total], {}, "ring.dq")
                    g = total
                dq[a] = g
    grads = {a: {"q": dq[a]} for a in qkv}
    for b in qkv:
        m, home, run = n - b, ring.owner(b), None
        for a, gk, gv in sorted(contributions[b]):
            src = ring.owner(a)
            if src != home:  # sent back to the chunk's rank
                part = (a - b, a - b + 1, m)
                rk, rv = w.piece(home, 0, "k.grad", b, part), w.piece(home, 0, "v.grad", b, part)
                w.node(home, "send_recv", "bw", [gk], [rk], {"src": src, "dst": home}, "ring.dk")
                w.node(home, "send_recv", "bw", [gv], [rv], {"src": src, "dst": home}, "ring.dv")
                gk, gv = rk, rv
            if run is not None:
                parts = WHOLE if a == n - 1 else (0, a - b + 1, m)
                tk, tv = w.piece(home, 0, "k.grad", b, parts), w.piece(home, 0, "v.grad", b, parts)
                w.node(home, "add", "none", [run[0], gk], [tk], {}, "ring.dk")
                w.node(home, "add", "none", [run[1], gv], [tv], {}, "ring.dv")
                gk, gv = tk, tv
            run = (gk, gv)
        grads[b]["k"], grads[b]["v"] = run
    final: dict[int, dict[str, int]] = {}
    for c in range(C):
        buffers = {}
        for name in WEIGHTS:
            buf = f"{name}.grad_buffer"
            buffers[name] = w.piece(c, -1, buf)
            w.node(c, "zeros", "none", [], [buffers[name]], {"shape": list(ring.shapes()[buf])},
                   buf, mb=-1)
        first = ring.part(ring.held(c)[0])
        for a in ring.held(c):
            wgrads = w.project_back(c, x[a], weights[c], grads[a], a,
                                    (ring.part(a), ring.part(a) + 1, n))
            for name in WEIGHTS:
                buf = f"{name}.grad_buffer"
                done = w.piece(c, 0, buf, None, (first, ring.part(a) + 1, n), lver=1)
                w.node(c, "local_grad_accumulation", "none", [buffers[name], wgrads[name]],
                       [done], {}, buf)
                buffers[name] = done
        final[c] = buffers
    for name in WEIGHTS:
        group = [final[c][name] for c in range(C)]
        for c in range(C):
            out = w.piece(c, -1, f"{name}.grad_buffer", lver=1)
            w.node(c, "reducer", "none", group, [out], {"index": c}, f"{name}.grad_buffer",
                   mb=-1)
    return w.plan


def ring_pair(ring: Ring) -> tuple[Plan, Plan]:
    """The single-device plan and the ring's."""
    return single_plan(ring), ring_plan(ring)


def main(argv: list[str] | None = None) -> int:
    """python -m gen_model.ring --cp C [--balanced] [--fault F] --out DIR:
    write the pair as DIR/ring_single_sqS.pkl (S the sequence length;
    _no_shift for that fault, whose single-device step computes one more
    value) and DIR/ring_cpC[_bal][_F].pkl."""
    import argparse
    from pathlib import Path

    from backends.planfile import save_plan

    ap = argparse.ArgumentParser(prog="python -m gen_model.ring", description=main.__doc__)
    ap.add_argument("--cp", type=int, default=2, help="ranks of the ring (at least 2)")
    ap.add_argument("--chunk", type=int, default=2, help="sequence positions a chunk")
    ap.add_argument("--balanced", action="store_true",
                    help="two chunks a rank, head and tail (causal load balancing)")
    ap.add_argument("--fault", choices=FAULTS, default="", help="a fault of the last rank")
    ap.add_argument("--out", type=Path, default=Path("plans"), help="output directory")
    args = ap.parse_args(argv)
    if args.cp < 2 or args.chunk < 1:
        print("error: --cp must be at least 2 and --chunk at least 1", file=sys.stderr)
        return 2
    ring = Ring(cp=args.cp, chunk=args.chunk, balanced=args.balanced, fault=args.fault)
    single, parallel = ring_pair(ring)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"ring_cp{args.cp}" + ("_bal" if args.balanced else "") + (
        f"_{args.fault}" if args.fault else "")
    name = f"ring_single_sq{ring.seqlen}" + ("_no_shift" if args.fault == "no_shift" else "")
    save_plan(single, args.out / f"{name}.pkl")
    save_plan(parallel, args.out / f"{stem}.pkl")
    print(f"wrote {args.out}/{stem}.pkl and its single-device plan {args.out}/{name}.pkl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
