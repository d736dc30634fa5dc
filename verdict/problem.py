"""A stage as a self-contained, picklable proof problem, and its canonical key.

Tensors get local ids in a fixed traversal order, so two stages that differ
only in tensor ids, ranks and microbatches (layer 3 and layer 17, say)
become the same problem with the same key: the stage memo proves it once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from verdict.lineage import Lineage
from verdict.ops import get_op
from verdict.plan import UNIT, Plan, Slices
from verdict.reduce import Reduction
from verdict.stages import Stage
from verdict.structure import fw_shapes

Group = tuple[Slices, tuple[int, ...]]


@dataclass
class LineageFact:
    """Ts (local id) and its groups of Tp's (local ids) at reduced slices;
    ``aliases`` are (Tp, its replicas): tensors claiming the same parts."""

    ts: int
    groups: list[Group]
    loose: list[int]
    aliases: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


@dataclass
class Problem:
    ts_shapes: list[tuple[int, ...]]
    tp_shapes: list[tuple[int, ...]]
    gs: tuple | None  # (op, dir, kwargs, inputs, outputs) over Ts ids
    gp: list[tuple]  # (op, dir, kwargs, inputs, outputs) over Tp ids
    given: list[LineageFact]  # input lineages: assumed to hold
    claims: list[LineageFact]  # output lineages: to prove
    constants: dict[int, tuple] = field(default_factory=dict)  # Ts id -> input-less Gs node
    # Tp id -> its view's factor (num, den), for the Tp's that are scaled
    scales: dict[int, tuple[int, int]] = field(default_factory=dict)
    # not part of the key: where the local ids come from, for reports
    ts_global: list[int] = field(default_factory=list)
    tp_global: list[int] = field(default_factory=list)

    def key(self) -> str:
        body = [self.ts_shapes, self.tp_shapes, self.gs, self.gp, sorted(self.constants.items()),
                sorted(self.scales.items()),
                [(f.ts, f.groups, f.loose, f.aliases) for f in self.given],
                [(f.ts, f.groups, f.loose, f.aliases) for f in self.claims]]
        text = json.dumps(body, sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def _resized(plan: Plan, node, shape_of) -> dict:
    ins, outs = fw_shapes(plan, node, shape_of)
    return get_op(node.op).resized(node.kwargs, ins, outs)


def build_problem(single: Plan, parallel: Plan, stage: Stage, lineages: list[Lineage],
                  red: Reduction, producer: list[int]) -> Problem:
    """The stage as a problem; ``producer`` is ``single.producers()``."""
    ts_ids: dict[int, int] = {}
    tp_ids: dict[int, int] = {}

    def ts(i: int) -> int:
        if i < 0:
            return -1
        if i not in ts_ids:
            ts_ids[i] = len(ts_ids)
        return ts_ids[i]

    def tp(i: int) -> int:
        if i < 0:
            return -1
        if i not in tp_ids:
            tp_ids[i] = len(tp_ids)
        return tp_ids[i]

    gs = None
    if stage.gs_node >= 0:
        node = single.nodes[stage.gs_node]
        kw = _resized(single, node, red.gs_shape.get)
        gs = (node.op, node.dir, kw, [ts(i) for i in node.inputs], [ts(o) for o in node.outputs])
    for lid in (*stage.inputs, *stage.outputs):
        ts(lineages[lid].ts)
    constants = {}
    for lid in stage.inputs:
        ts_index = lineages[lid].ts
        prod = producer[ts_index]
        if prod >= 0 and not single.nodes[prod].inputs:
            node = single.nodes[prod]
            kw = get_op(node.op).resized(node.kwargs, [], [red.gs_shape[ts_index]])
            constants[ts(ts_index)] = (node.op, node.dir, kw)
    given = [_given(lineages[lid], ts(lineages[lid].ts), set(stage.sources), red, tp)
             for lid in stage.inputs]
    gp = []
    for i in stage.gp_nodes:
        node = parallel.nodes[i]
        ins = [tp(t) for t in node.inputs]
        outs = [tp(t) for t in node.outputs]
        kw = _resized(parallel, node, red.gp_shape)
        gp.append((node.op, node.dir, kw, ins, outs))
    claims = []
    for lid in stage.outputs:
        lin = lineages[lid]
        groups = [(_red(red, members[0]), tuple(tp(m) for m in members))
                  for _, members in sorted(lin.groups) if all(m in tp_ids for m in members)]
        aliases = [(tp(s[0]), tuple(tp(m) for m in s[1:])) for s in lin.same]
        claims.append(LineageFact(ts(lin.ts), groups, sorted(tp(m) for m in lin.loose
                                                             if m in tp_ids), aliases))
    ts_global = sorted(ts_ids, key=ts_ids.get)
    tp_global = sorted(tp_ids, key=tp_ids.get)
    scales = {local: parallel.tensors[t].scale for local, t in enumerate(tp_global)
              if parallel.tensors[t].scale != UNIT}
    return Problem(
        ts_shapes=[red.gs_shape[i] for i in ts_global],
        tp_shapes=[red.gp_shape(i) for i in tp_global],
        gs=gs, gp=gp, given=given, claims=claims, constants=constants, scales=scales,
        ts_global=ts_global, tp_global=tp_global,
    )


def _given(lin: Lineage, ts_id: int, sources: set[int], red: Reduction, tp) -> LineageFact:
    """What a stage may assume of an input lineage, on the Tp's it reads.

    Each part stands for its replicas (a 'same' set): a group is usable when
    every part in it has a replica among the stage's sources; that replica
    takes the part's place, and the other replicas read are its aliases.
    """
    replicas = {s[0]: [m for m in s if m in sources] for s in lin.same}

    def read(rep: int) -> list[int]:
        return replicas.get(rep, [rep] if rep in sources else [])

    groups, loose, aliases = [], [], []
    used = set()
    for _, members in sorted(lin.groups):
        chosen = [read(m) for m in members]
        if all(chosen):
            groups.append((_red(red, chosen[0][0]), tuple(tp(c[0]) for c in chosen)))
            used.update(members)
        else:
            loose += [c[0] for c in chosen if c]
            used.update(m for m, c in zip(members, chosen) if c)
    loose += [read(m)[0] for m in lin.loose if read(m)]
    used.update(m for m in lin.loose if read(m))
    for rep in used:
        if len(read(rep)) > 1:
            first, *others = read(rep)
            aliases.append((tp(first), tuple(tp(o) for o in others)))
    return LineageFact(ts_id, groups, sorted(tp(m) for m in loose), sorted(aliases))


def _red(red: Reduction, tp: int) -> Slices:
    return red.gp_slices[tp]
