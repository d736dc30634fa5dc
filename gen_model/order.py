"""Plan-wide passes after emission: one execution order from per-rank
sequences, and SSA version numbers in that order. The bug suites
(harness/) use them too after editing a plan."""

from __future__ import annotations

from verdict.plan import INPUT_KINDS, Node, Plan


def number_versions(plan: Plan, tids: frozenset[int] | None = None) -> None:
    """SSA versions in execution order, per (rank, mb, tid); gradient buffers,
    updated across microbatches, count per (rank, tid). Only the logical
    tensors ``tids`` when given; tensors never written get version 0, and
    an input relaid on a rank (a local split) numbers on from it."""
    count: dict[tuple, int] = {}
    tensors = plan.tensors
    outputs = {o for node in plan.nodes for o in node.outputs if o >= 0}
    for i, t in enumerate(tensors):  # inputs read from memory: versions 0, 1, ...
        if i not in outputs and plan.logical[t.tid].kind in INPUT_KINDS and (
                tids is None or t.tid in tids):
            key = (t.rank, t.mb, t.tid)  # two pieces with causal load balancing
            tensors[i] = t._replace(version=count.get(key, 0))
            count[key] = count.get(key, 0) + 1
    written = set()
    for node in plan.nodes:
        for o in node.outputs:
            if o < 0 or (tids is not None and tensors[o].tid not in tids):
                continue
            t = tensors[o]
            gradbuf = plan.logical[t.tid].kind == "gradbuf"
            key = (t.rank, None if gradbuf else t.mb, t.tid)
            tensors[o] = t._replace(version=count.get(key, 0))
            count[key] = count.get(key, 0) + 1
            written.add(o)
    for i, t in enumerate(tensors):
        if i not in written and t.version < 0:
            tensors[i] = t._replace(version=0)


def merge(seq: dict[int, list[Node]], plan: Plan) -> list[Node]:
    """One global execution order from per-rank sequences: repeatedly run, on
    each rank, the nodes whose inputs are already written."""
    produced = [False] * len(plan.tensors)
    written = {o for nodes in seq.values() for n in nodes for o in n.outputs if o >= 0}
    for i in range(len(plan.tensors)):
        if i not in written:
            produced[i] = True
    pos = dict.fromkeys(seq, 0)
    out: list[Node] = []
    while True:
        progress = False
        for rank, nodes in seq.items():
            while pos[rank] < len(nodes):
                n = nodes[pos[rank]]
                if not all(i < 0 or produced[i] for i in n.inputs):
                    break
                out.append(n)
                for o in n.outputs:
                    if o >= 0:
                        produced[o] = True
                pos[rank] += 1
                progress = True
        if all(pos[r] == len(nodes) for r, nodes in seq.items()):
            return out
        if not progress:
            stuck = {r: nodes[pos[r]].name for r, nodes in seq.items() if pos[r] < len(nodes)}
            raise AssertionError(f"schedule deadlock: {stuck}")
