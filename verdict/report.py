"""What a run prints: the verdict, the evidence, the counterexample, Stats."""

from __future__ import annotations

import csv
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from verdict.columns import Columns
from verdict.engine import StageResult, Verdict
from verdict.plan import Plan
from verdict.structure import node_label


@dataclass
class Stats:
    success: bool
    num_layers: int
    num_dp: int
    num_tp: int
    num_pp: int
    num_ep: int
    num_nm: int
    gbs: int
    hidden: int
    seqlen: int
    model: str
    stages: int
    unique_stages: int
    memo_hits: int
    t_graph: float
    t_lineage: float
    t_schedule: float
    t_vrf: float
    t_total: float
    #: a folded plan (its num_dp, num_nm and gbs are the real run's): the sizes
    #: shown in the plan ("shown dp2 nm2 gbs32"; docs/soundness.md), else ""
    fold: str = ""
    #: blocks (replica x microbatch) of the plan: how many were checked
    #: against the representatives, proved, and assumed (a folded file's
    #: unshown blocks); "" when every node was proved
    blocks: str = ""

    def line(self) -> str:
        body = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v!r}"
                         for k, v in asdict(self).items())
        return f"Stats({body})"


def make_stats(verdict: Verdict, parallel: Plan, t_load: float) -> Stats:
    """The Stats row. t_graph and t_total include ``t_load`` (reading the
    plan files); a folded plan's row shows its real sizes (``fold`` says
    what was shown)."""
    w, t = parallel.world, verdict.times
    folded = parallel.is_folded()
    real = {k: w.get(f"fold_{k}" if folded else k, default)
            for k, default in (("dp", 1), ("nm", 1), ("gbs", 0))}
    return Stats(
        success=verdict.success, num_layers=w.get("layers", 0), num_dp=real["dp"],
        num_tp=w.get("tp", 1), num_pp=w.get("pp", 1), num_ep=w.get("ep", 1),
        num_nm=real["nm"], gbs=real["gbs"], hidden=w.get("hidden", 0),
        seqlen=w.get("seqlen", 0), model=w.get("model", ""), stages=len(verdict.stages),
        unique_stages=verdict.unique, memo_hits=verdict.memo_hits,
        t_graph=t.get("t_graph", 0.0) + t_load, t_lineage=t.get("t_lineage", 0.0),
        t_schedule=t.get("t_schedule", 0.0), t_vrf=t.get("t_vrf", 0.0),
        t_total=t.get("t_total", 0.0) + t_load,
        fold=f"shown dp{w['dp']} nm{w['nm']} gbs{w['gbs']}" if folded else "",
        blocks=blocks_label(verdict),
    )


def blocks_label(verdict: Verdict) -> str:
    checked, proved, assumed = verdict.blocks
    if not proved:
        return ""
    classes = (f" in {verdict.classes} class{'es' if verdict.classes > 1 else ''} of blocks"
               if verdict.classes else "")
    return f"{checked} checked{classes}, {proved} proved, {assumed} assumed"


#: Column for the values an old file held past its header (rows appended
#: under a shorter header by an older version).
UNLABELLED = "unlabelled"


def append_rows(path: Path, rows: list[dict]) -> Path:
    """Append rows to a CSV file, with a header line when the file is new.

    A file whose header lacks some of the new columns (written by an older
    version) is rewritten once with both sets of columns, its rows keeping
    their values, so that no row lands under another column's name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0])
    header: list[str] = []
    if path.exists():
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
    if header and not set(fields) <= set(header):
        with path.open(newline="") as f:
            old = list(csv.DictReader(f, restkey=UNLABELLED))
        for row in old:  # values past the header, from rows appended under it before
            if UNLABELLED in row:
                row[UNLABELLED] = ";".join(row[UNLABELLED])
        merged = header + [k for k in fields if k not in header]
        if any(UNLABELLED in row for row in old):
            merged.append(UNLABELLED)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=merged, restval="")
            writer.writeheader()
            writer.writerows(old + rows)
        tmp.replace(path)
        return path
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header or fields, restval="")
        if not header:
            writer.writeheader()
        writer.writerows(rows)
    return path


def time_line(stats: Stats, t_load: float) -> str:
    """What --time prints: the Stats row's figures, loading named apart."""
    return (f"times: t_graph={stats.t_graph:.3f}s (loading the plans {t_load:.3f}s), "
            f"t_lineage={stats.t_lineage:.3f}s, t_schedule={stats.t_schedule:.3f}s, "
            f"t_vrf={stats.t_vrf:.3f}s, t_total={stats.t_total:.3f}s")


def append_stats(stats: Stats, directory: Path) -> Path:
    return append_rows(directory / "stats.csv", [asdict(stats)])


def ts_label(single: Plan, i: int) -> str:
    t = single.tensors[i]
    return f"Tensor(wtype='s', rank={t.rank}, mb={t.mb}, tid={t.tid}, v={t.version})"


def tp_label(parallel: Plan, i: int) -> str:
    t = parallel.tensors[i]
    scaled = "" if t.scale == (1, 1) else f", scale={t.factor()}"
    return f"Tensor(wtype='p', rank={t.rank}, mb={t.mb}, tid={t.tid}, v={t.version}{scaled})"


def _short(parallel: Plan, i: int) -> str:
    t = parallel.tensors[i]
    return f"r{t.rank}/mb{t.mb}/tid{t.tid}/v{t.version}"


def _fmt(a: np.ndarray, indent: str) -> str:
    text = np.array2string(np.asarray(a), precision=6, threshold=64, edgeitems=2)
    return text.replace("\n", "\n" + indent)


def evidence(verdict: Verdict, single: Plan) -> list[str]:
    """What a SUCCESS rests on: stages by kind, lineages, coverage, memo."""
    kinds = Counter()
    for r in verdict.results:
        if r.stage.gs_node < 0:
            kinds["input"] += 1
        else:
            node = single.nodes[r.stage.gs_node]
            kinds[node.dir] += 1
    solver = sum(1 for r in verdict.results if r.outcome.solver and not r.memo)
    proved = {lid for r in verdict.results for lid in r.stage.outputs}
    groups = sum(len(verdict.lineages[lid].groups) for lid in proved)
    lines = [
        f"stages proved: {len(verdict.results)} (forward {kinds['fw']}, backward {kinds['bw']}, "
        f"step {kinds['none']}, input {kinds['input']}); {verdict.unique} distinct, "
        f"{verdict.memo_hits} by memo, {solver} needed the solver",
        f"lineages verified: {len(proved)} ({groups} groups of parallel tensors)",
        f"final coverage: the loss and {len(single.grads)} weight gradients, on every rank",
    ]
    if verdict.fold:
        lines.append(f"folded plan: {verdict.fold}")
    lines += symmetry_lines(verdict)
    return lines


def loads(parallel: Plan | Columns) -> tuple[Counter, int]:
    """The tensors no node writes, by kind of logical tensor, and the ranks
    that hold them."""
    kinds = [lg.kind for lg in parallel.logical]
    if isinstance(parallel, Columns):
        t = parallel.tensors
        written = parallel.written()
        tids = np.asarray(t.tid)[~written]
        counts = np.bincount(tids, minlength=len(kinds))
        by_kind = Counter()
        for tid in np.flatnonzero(counts):
            by_kind[kinds[tid]] += int(counts[tid])
        return by_kind, len(np.unique(np.asarray(t.rank)[~written]))
    written_set = {o for n in parallel.nodes for o in n.outputs}
    loaded = [t for i, t in enumerate(parallel.tensors) if i not in written_set]
    return Counter(kinds[t.tid] for t in loaded), len({t.rank for t in loaded})


def assumed(parallel: Plan | Columns, verdict: Verdict, cached: int = 0) -> str:
    """What a SUCCESS took without a proof, for this plan, in one line
    (docs/soundness.md, "What a SUCCESS assumes")."""
    by_kind, ranks = loads(parallel)
    shards = by_kind["param"] + by_kind["buffer"]
    batch = by_kind["data"] + by_kind["tokens"]
    parts = [f"the {sum(by_kind.values())} loaded tensors on {ranks} rank"
             f"{'s' if ranks != 1 else ''} are the slices they claim, factor 1 "
             f"({shards} parameter and buffer shards of the checkpoint, {batch} batch pieces)",
             "the plan's nodes are what the ranks ran"]
    if verdict.fold:
        parts.append(f"the blocks a folded file leaves out run its shown blocks' programs "
                     f"({verdict.fold})")
    if cached:
        parts.append(f"{cached} stage{'s' if cached != 1 else ''} proved by an earlier run "
                     f"(the proof cache)")
    return "assumed, not proved: " + "; ".join(parts)


def symmetry_lines(verdict: Verdict) -> list[str]:
    """Which blocks were checked, proved or assumed (docs/soundness.md)."""
    lines = []
    if verdict.symmetry:
        lines.append(f"symmetry: {verdict.symmetry}")
    if verdict.ranks:
        lines.append(f"representatives' ranks (proved plan -> plan): {verdict.ranks}")
    return lines


def failure(verdict: Verdict, single: Plan, parallel: Plan) -> list[str]:
    if verdict.kind != "stage":
        return [*symmetry_lines(verdict), f"❌ not equivalent: {verdict.message}"]
    lines = symmetry_lines(verdict)
    for r in verdict.failed:
        lines += stage_failure(r, verdict, single, parallel)
    return lines


def stage_failure(r: StageResult, verdict: Verdict, single: Plan, parallel: Plan) -> list[str]:
    out = r.outcome
    stage = r.stage
    if out.status == "counterexample":
        head = (f"❌ Stage {stage.id} not equivalent: 🚨 the solver found inputs on which "
                f"the plans differ (sat)")
    elif out.status == "unknown":
        head = f"❌ Stage {stage.id} could not be decided ({out.detail})"
    else:
        head = f"❌ Stage {stage.id} cannot run at reduced shapes: {out.detail}"
    lines = [head, ""]
    if stage.gs_node >= 0:
        lines.append(node_label(single, stage.gs_node).replace("Node(", "Node(wtype='s', "))
    for i in stage.gp_nodes:
        node = parallel.nodes[i]
        lines.append(node_label(parallel, i).replace("Node(", "Node(wtype='p', "))
        reads = ", ".join(_short(parallel, t) for t in node.inputs if t >= 0)
        writes = ", ".join(_short(parallel, t) for t in node.outputs if t >= 0)
        lines.append(f"    reads [{reads}] writes [{writes}]")
    if out.status != "counterexample":
        return [*lines, ""]
    p = r.problem
    lines += ["", "🔗 OUTPUT LINEAGES"]
    for c, fact in enumerate(p.claims):
        ts_global = p.ts_global[fact.ts]
        lines.append(f"👉 {ts_label(single, ts_global)} "
                     f"{single.logical[single.tensors[ts_global].tid].name}")
        full = out.ts_values[fact.ts]
        lines.append("    " + _fmt(full, "    "))
        for g, (slices, members) in enumerate(fact.groups):
            region = tuple(slice(a, b) for a, b in slices)
            orig = parallel.tensors[p.tp_global[members[0]]].slices
            lines.append(f"🕐 {tuple(orig)} {_fmt(full[region], '   ')}")
            for m in members:
                lines.append(f"    =  ⨁ {tp_label(parallel, p.tp_global[m])} "
                             f"{_fmt(out.tp_values[m], '      ')}")
                if (c, g) in out.bad and len(members) == 1:
                    lines.append("    🚨 ⬆️")
            if (c, g) in out.bad and len(members) > 1:
                lines.append("    🚨 ⬆️ (their sum differs)")
            if (c, g) in out.bad and any(parallel.tensors[p.tp_global[m]].scale != (1, 1)
                                         for m in members):
                lines.append("    (a scaled tensor counts divided by its scale)")
        for k, (first, others) in enumerate(fact.aliases):
            if (c, -1 - k) not in out.bad:
                continue
            t = parallel.tensors[p.tp_global[first]]
            lines.append(f"🕐 {tuple(t.slices)} parts {t.parts}: replicas of one part")
            for m in (first, *others):
                lines.append(f"    =  {tp_label(parallel, p.tp_global[m])} "
                             f"{_fmt(out.tp_values[m], '      ')}")
            lines.append("    🚨 ⬆️ (they differ)")
    lines += [f"Stage {stage.id}: the parallel plan does not compute what the single-device "
              f"plan computes (values above, 🚨 where they differ).", ""]
    return lines
