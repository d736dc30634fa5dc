"""Cut the two plans into stages along lineages.

One stage per single-device node: its Gs side is that node; its Gp side is
every parallel node needed to compute the Tp's of the node's output
lineages from Tp's of lineages verified before (or assumed: the inputs).
The search walks producers backwards from the target Tp's and stops at
verified Tp's. Reaching a tensor that no node writes, or a Tp of a lineage
not verified yet, is a broken dataflow: the target is not reachable from
the sources its lineage allows.

Parallel tensors that claim to be pieces of an input (a parameter split on
the fly, say) but are computed get an 'input' stage first, with no Gs side.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from verdict.lineage import Lineage, StructureError
from verdict.plan import INPUT_KINDS, Plan
from verdict.progress import progress
from verdict.structure import node_label


@dataclass
class Stage:
    id: int
    gs_node: int  # -1 for an input stage
    gp_nodes: list[int]
    inputs: list[int]  # lineage ids read
    outputs: list[int]  # lineage ids proved
    sources: list[int] = field(default_factory=list)  # Gp tensors read from verified lineages


def _describe(plan: Plan, i: int) -> str:
    t = plan.tensors[i]
    return f"Tensor(rank={t.rank}, mb={t.mb}, tid={t.tid}, v={t.version})"


class _Cutter:
    def __init__(self, single: Plan, parallel: Plan, lineages: list[Lineage],
                 of_gs: list[int], of_gp: list[int]):
        self.s, self.p = single, parallel
        self.lineages, self.of_gs, self.of_gp = lineages, of_gs, of_gp
        self.producer = parallel.producers()
        self.verified_lineages: set[int] = set()
        # loaded: producer-less pieces of a tensor that is an input of the
        # single-device plan too (not, say, a parameter's updated version)
        single_producer = single.producers()
        computed_in_s = {(t.tid, t.version) for i, t in enumerate(single.tensors)
                         if single_producer[i] >= 0}
        self.verified: set[int] = {
            i for i, prod in enumerate(self.producer)
            if prod < 0 and parallel.logical[parallel.tensors[i].tid].kind in INPUT_KINDS
            and (parallel.tensors[i].tid, parallel.tensors[i].lver) not in computed_in_s
        }
        self.stages: list[Stage] = []
        self.stopped: list[StructureError] | None = None
        for i in sorted(self.verified):
            if not parallel.tensors[i].is_whole():
                raise StructureError("lineage", (
                    f"input {_describe(parallel, i)} "
                    f"({parallel.logical[parallel.tensors[i].tid].name}) claims to be part "
                    f"{parallel.tensors[i].parts} of a partial sum; an input is loaded whole"))

    def lineage_name(self, lid: int) -> str:
        t = self.s.tensors[self.lineages[lid].ts]
        return f"Tensor(wtype='s', tid={t.tid}, v={t.version}) {self.s.logical[t.tid].name}"

    def cut(self, gs_node: int, targets: set[int], outputs: list[int]) -> Stage:
        nodes: set[int] = set()
        sources: set[int] = set()
        stack = list(targets)
        seen: set[int] = set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            if t in self.verified and t not in targets:
                sources.add(t)
                continue
            lid = self.of_gp[t]
            if t not in targets and lid not in self.verified_lineages:
                self.unreachable(gs_node, targets, t, "depends on", lid)
            prod = self.producer[t]
            if prod < 0:
                if t in self.verified:
                    sources.add(t)
                    continue
                self.unreachable(gs_node, targets, t, "needs", lid, unwritten=True)
            if prod not in nodes:
                nodes.add(prod)
                stack.extend(i for i in self.p.nodes[prod].inputs if i >= 0)
        inputs = sorted({self.of_gp[t] for t in sources})
        stage = Stage(len(self.stages), gs_node, self.dataflow_order(nodes), inputs, outputs,
                      sorted(sources))
        self.stages.append(stage)
        # a loose part (of an |n|-way partial maximum, n < 0: never grouped, so
        # nothing was proved of it) is no source of a later stage: one that
        # reads it recomputes it from its producers
        self.verified |= {t for t in targets if self.p.tensors[t].parts[2] >= 0}
        self.verified_lineages |= set(outputs)
        return stage

    def dataflow_order(self, nodes: set[int]) -> list[int]:
        """The stage's nodes in plan order, or, when a node reads a tensor a
        later node of the stage writes (a collective reading another rank's
        value listed after it), in the dataflow order nearest to it: the
        lowest ready node first. The plan's list order is not an SSA order
        the verifier relies on; a stage's dependencies are."""
        order = sorted(nodes)
        at = {n: k for k, n in enumerate(order)}
        needs = {n: {self.producer[t] for t in self.p.nodes[n].inputs
                     if t >= 0 and self.producer[t] in at} for n in order}
        if all(at[m] < at[n] for n in order for m in needs[n]):
            return order
        readers: dict[int, list[int]] = {}
        for n in order:
            for m in needs[n]:
                readers.setdefault(m, []).append(n)
        left = {n: len(needs[n]) for n in order}
        ready = [n for n in order if not left[n]]
        heapq.heapify(ready)
        out = []
        while ready:
            n = heapq.heappop(ready)
            out.append(n)
            for r in readers.get(n, []):
                left[r] -= 1
                if not left[r]:
                    heapq.heappush(ready, r)
        if len(out) != len(order):
            raise StructureError("structure", "the plan's nodes read each other's outputs in a "
                                              "cycle")
        return out

    def unreachable(self, gs_node: int, targets: set[int], t: int, how: str, lid: int,
                    unwritten: bool = False) -> None:
        target = next(iter(sorted(targets)))
        what = "which no node writes" if unwritten else "whose lineage is not verified before it"
        where = f"stage of {node_label(self.s, gs_node)}" if gs_node >= 0 else "an input stage"
        raise StructureError("unreachable", (
            f"Target Tp is not reachable from any source Tp bound to its lineage's inputs. "
            f"target_Tp: {_describe(self.p, target)}, Ts: {self.lineage_name(self.of_gp[target])}; "
            f"it {how} {_describe(self.p, t)} ({self.p.logical[self.p.tensors[t].tid].name}), "
            f"{what}; in the {where}"))

    def run(self) -> list[Stage]:
        single_producer = self.s.producers()  # an updated parameter is computed
        for lin in self.lineages:
            ts = self.s.tensors[lin.ts]
            if self.s.logical[ts.tid].kind not in INPUT_KINDS or single_producer[lin.ts] >= 0:
                continue  # computed (an updated parameter is its optimizer step's output)
            self.verified_lineages.add(lin.id)
            computed = {t for t in lin.members if self.producer[t] >= 0}
            if computed:
                self.cut(-1, computed, [lin.id])
        for i, node in enumerate(progress(self.s.nodes, "cutting stages")):
            outputs = sorted({self.of_gs[o] for o in node.outputs if o >= 0 and self.of_gs[o] >= 0})
            targets = {t for lid in outputs for t in self.lineages[lid].members}
            if not targets:
                continue
            try:
                self.cut(i, targets, outputs)
            except StructureError as e:
                if self.stopped is None:
                    raise
                self.stopped.append(e)
                break
        return self.stages


def cut_stages(single: Plan, parallel: Plan, lineages: list[Lineage], of_gs: list[int],
               of_gp: list[int], stopped: list[StructureError] | None = None) -> list[Stage]:
    """The stages in single-device order. With ``stopped``, a node's stage
    that finds the plan wrong (a target it cannot reach) ends the list: its
    finding is appended to ``stopped`` and the stages before it returned, so
    that a stage among them that fails can be reported first."""
    cutter = _Cutter(single, parallel, lineages, of_gs, of_gp)
    cutter.stopped = stopped
    return cutter.run()
