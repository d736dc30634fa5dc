"""A received value read as another message (``align/messages.py``),
written into the parallel plan: its tensor named as the value it is read
as, at its claim, and its ``send_recv`` reading a fresh input of the
sender, an input of the ranks only that no node writes and no
single-device node reads, so that nothing is known of the message
(docs/soundness.md, "Plans traced from PyTorch", 102)."""

from __future__ import annotations

from typing import Any

from verdict.plan import Tensor


def redeliver(writer: Any, r: Any) -> None:
    """Rank r's received values read as another message, not yet written
    so, rewritten (``writer``: the parallel plan's ``_Writer``)."""
    done = writer.redelivered.setdefault(r.low.rank, set())
    for v in r.misdelivered:
        if v not in done:
            done.add(v)
            _rewrite(writer, r, v)


def _rewrite(writer: Any, r: Any, v: int) -> None:
    plan, b = writer.plan, writer.b
    t = writer.t_of[(r.low.rank, v)]
    n = writer.recv_node[t]
    node, old = plan.nodes[n], plan.tensors[t]
    mb = max(r.mb.get(v, -1), 0)
    tid = b.s.tid[r.sv[v]]
    sent, read = b.logical[old.tid], b.logical[tid]
    name = (f"rank {node.kwargs['src']}'s message {n} to rank {r.low.rank}, sent as the "
            f"{sent.kind} {sent.name} (microbatch {old.mb}), read at {r.read_at[v]} as the "
            f"{read.kind} {read.name} (microbatch {mb})")
    slices, parts = r.view(v)
    fresh = b.own_input(name, b.logical[tid].shape, "buffer")
    plan.logical.extend(b.logical[len(plan.logical):])
    plan.tensors.append(Tensor(node.kwargs["src"], -1, fresh, 0, old.shape, 0, slices,
                               (0, 1, 1)))
    plan.nodes[n] = node._replace(mb=mb, inputs=(len(plan.tensors) - 1,))
    key = (old.rank, old.mb, old.tid)
    if writer.versions.get(key) == old.version + 1:
        writer.versions[key] = old.version  # given back (else a version left unused)
    version = writer.versions.get((old.rank, mb, tid), 0)
    writer.versions[(old.rank, mb, tid)] = version + 1
    f = r.claim[v].scale
    plan.tensors[t] = old._replace(mb=mb, tid=tid, version=version,
                                   lver=b.s.lver.get(r.sv[v], 0), slices=slices, parts=parts,
                                   scale=(f.numerator, f.denominator))
