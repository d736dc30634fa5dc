"""An oracle for plans that trusts no claim of the parallel plan.

    judge(single, parallel, seed) -> Judgement

It runs the single-device plan and the parallel plan in float64 on the same
seeded inputs with its own interpreter (harness/evaluator.py: torch and
torch autograd, collectives and the training step from their definitions),
each rank loading the slice of every input its input tensors name (those
are load-time facts), and compares what every rank ends with against the
single-device step, by value. What to compare comes from the single-device
plan alone: its loss, its gradient map (parameter -> final gradient
buffer), its optimizer steps, its logical tensors and their shapes. The
parallel plan's own loss and gradient map must be the same, or the plan is
wrong; they are never read in their place.

* for every parameter piece a rank loads, the gradient buffer the rank
  writes last must equal the single-device final gradient at that slice,
  and with an optimizer step the parameter and the optimizer state (Adam's
  moments) it writes last must equal the single-device updated ones there;
* the loss tensors a rank writes last (one per microbatch), summed with
  those of its data-parallel replicas, must equal the single-device loss,
  or their mean must (each the mean over its own data, the convention of a
  per-rank mean loss);
* a node that reads another rank's tensor without being a collective, a
  tensor read before any node writes it, or a shape a node cannot make,
  is wrong: no real execution could run it.

It shares nothing with the verifier (verdict/) but the plan data model
(verdict/plan.py): no operator rule, no numeric backend, no lineage, no
stage, no claim.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from harness.evaluator import EvaluationError, execute, is_collective
from verdict.plan import Plan


@dataclass
class Judgement:
    right: bool
    why: str = ""


def _run(plan: Plan, seed: int) -> list:
    """Values of every tensor; raises EvaluationError on anything no machine could run."""
    with np.errstate(all="ignore"):
        return execute(plan, seed)


def _maps_problem(single: Plan, parallel: Plan) -> str:
    """Why the parallel plan's description of the model is not the
    single-device plan's, or "": the same logical tensors (names, shapes,
    kinds), the same loss and the same parameter -> gradient buffer map."""
    if len(single.logical) != len(parallel.logical) or any(
            a != b for a, b in zip(single.logical, parallel.logical)):
        return "its logical tensors are not the single-device plan's"
    if parallel.loss != single.loss:
        return "its loss is not the single-device plan's"
    if parallel.grads != single.grads:
        return "its gradient map is not the single-device plan's"
    return ""


def _close(a: np.ndarray, b: np.ndarray, rtol: float = 1e-7) -> bool:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        return False
    scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-9)
    with np.errstate(invalid="ignore"):
        diff = np.where(a == b, 0.0, np.abs(a - b))
    return bool(np.all(np.nan_to_num(diff, nan=np.inf) <= rtol * scale))


def _covers(got: np.ndarray, box: tuple, expected: np.ndarray, held: tuple) -> bool:
    """A rank's last update is right when its box contains the shard the rank
    holds and its values are the expected ones over the whole box (the
    shard itself, or the whole parameter gathered after a ZeRO-1/2 step).
    The box is the tensor's claim; checking every value in it means a false
    claim fails (no claim is taken on trust)."""
    inside = all(a <= c and d <= b for (a, b), (c, d) in zip(box, held))
    return inside and _close(got, expected[tuple(slice(a, b) for a, b in box)])


def _layout_problem(parallel: Plan) -> str:
    """Why the world's (pp, dp, cp, tp) layout cannot be the plan's, or "".

    Which ranks are data-parallel replicas (whose losses add up) comes from
    the layout, so it is checked against what each rank loads: per data
    input, the batch rows (dim 0) of ranks of one data-parallel index are
    equal, and those of different indices do not overlap. Context-parallel
    ranks count as data-parallel indices (d * cp + c) and load (row,
    sequence position) pairs."""
    pp, dp, tp = (int(parallel.world.get(k, 1)) for k in ("pp", "dp", "tp"))
    cp = int(parallel.world.get("cp", 1))
    dp *= cp
    if any(t.rank >= pp * dp * tp for t in parallel.tensors):
        return "a rank lies outside the world's layout"
    written = {o for n in parallel.nodes for o in n.outputs}
    rows: dict[tuple[int, int], set] = defaultdict(set)  # (tid, rank) -> batch rows
    for i, t in enumerate(parallel.tensors):
        if i not in written and t.shape and parallel.logical[t.tid].kind in ("data", "tokens"):
            if cp > 1:
                rows[(t.tid, t.rank)].update(itertools.product(range(*t.slices[0]),
                                                               range(*t.slices[1])))
            else:
                rows[(t.tid, t.rank)].update(range(*t.slices[0]))
    by_index: dict[tuple[int, int], set] = {}
    for (tid, rank), got in sorted(rows.items()):
        d = (rank // tp) % dp
        if by_index.setdefault((tid, d), got) != got:
            return f"ranks of data-parallel index {d} load different rows"
    for (tid, d), got in by_index.items():
        for (tid2, e), other in by_index.items():
            if tid == tid2 and d < e and got & other:
                return f"data-parallel indices {d} and {e} load the same rows"
    return ""


def judge(single: Plan, parallel: Plan, seed: int = 0) -> Judgement:
    problem = _maps_problem(single, parallel)
    if problem:
        return Judgement(False, f"the plan does not describe the model: {problem}")
    ref = _run(single, seed)
    opt_states = {single.tensors[n.inputs[0]].tid: [single.tensors[o].tid for o in n.outputs[1:]]
                  for n in single.nodes if n.op in ("sgd_step", "adam_step")}
    last_single: dict[int, int] = {}
    for node in single.nodes:
        for o in node.outputs:
            if o >= 0:
                last_single[single.tensors[o].tid] = o
    try:
        values = _run(parallel, seed)
    except EvaluationError as e:
        return Judgement(False, f"cannot run: {e}")
    written = set()
    last: dict[tuple[int, int], int] = {}
    last_at: dict[tuple[int, int], dict] = defaultdict(dict)  # (rank, tid) -> slices -> tensor
    loss_last: dict[tuple[int, int], int] = {}
    for node in parallel.nodes:
        for o in node.outputs:
            if o >= 0:
                t = parallel.tensors[o]
                written.add(o)
                last[(t.rank, t.tid)] = o
                last_at[(t.rank, t.tid)][t.slices] = o
                if t.tid == single.loss:
                    loss_last[(t.rank, t.mb)] = o
    held = defaultdict(set)
    for i, t in enumerate(parallel.tensors):
        if i not in written and t.tid in single.grads:
            held[t.tid].add((t.rank, t.slices))
    for param, buf in single.grads.items():
        name = single.logical[param].name
        expected = ref[last_single[buf]]
        cover = np.zeros(np.shape(expected), dtype=bool)
        if parallel.world.get("grad_blocks"):
            # each rank's final gradient is the blocks it ends with (the ranges
            # its distributed optimizer reads); together they cover the parameter
            for rank, _ in sorted(held[param]):
                for blocks, got in sorted(last_at[(rank, buf)].items()):
                    region = tuple(slice(a, b) for a, b in blocks)
                    if not _close(values[got], expected[region]):
                        return Judgement(False, f"rank {rank} ends with a wrong gradient of "
                                                f"{name}")
                    cover[region] = True
            if not cover.all():
                return Judgement(False, f"no rank ends with part of the gradient of {name}")
            continue
        for rank, slices in sorted(held[param]):
            region = tuple(slice(a, b) for a, b in slices)
            cover[region] = True
            got = last.get((rank, buf))
            if got is None:
                return Judgement(False, f"rank {rank} ends with no gradient of {name}")
            if not _close(values[got], expected[region]):
                return Judgement(False, f"rank {rank} ends with a wrong gradient of {name}")
            updated = last_single.get(param)
            if updated is not None:  # an optimizer step: the updated shard
                for tid in (param, *opt_states.get(param, ())):
                    got = last.get((rank, tid))
                    if got is None or not _covers(values[got], parallel.tensors[got].slices,
                                                  ref[last_single[tid]], slices):
                        return Judgement(False, f"rank {rank} ends with a wrong update of "
                                                f"{single.logical[tid].name}")
        if not cover.all():
            return Judgement(False, f"no rank holds part of {name}")
    layout = _layout_problem(parallel)
    if layout:
        return Judgement(False, f"the world's layout does not describe the plan: {layout}")
    dp, tp = int(parallel.world.get("dp", 1)), int(parallel.world.get("tp", 1))
    dp *= int(parallel.world.get("cp", 1))
    groups: dict[tuple[int, int], float] = defaultdict(float)
    count: dict[tuple[int, int], int] = defaultdict(int)
    ranks: dict[tuple[int, int], set] = defaultdict(set)
    for (rank, _), o in loss_last.items():
        groups[(rank // (dp * tp), rank % tp)] += float(np.sum(values[o]))
        count[(rank // (dp * tp), rank % tp)] += 1
        ranks[(rank // (dp * tp), rank % tp)].add(rank)
    if not groups:
        return Judgement(False, "no rank ends with the loss")
    loss = float(np.sum(ref[last_single[single.loss]]))
    w = parallel.world
    # a folded plan shows some of the real blocks: a mean over a block's own
    # data is real blocks / shown blocks times a mean over the shown ones
    real = (w["fold_dp"] * w["fold_nm"]) / (w["dp"] * w["nm"]) if "fold_dp" in w else 1
    for (stage, tp_index), total in groups.items():
        # each rank's loss is its share of the loss (they sum to it), or the
        # mean over its own data (their mean is the loss)
        mean = total / count[(stage, tp_index)] / real
        # or, for a plan whose ranks end with gradient blocks (Megatron's
        # distributed optimizer), each rank's mean over its own data as the
        # sum of its microbatches' means over their count (Megatron's
        # schedule); not for other plans, where accepting it too would judge
        # a loss scaled by the microbatch count harmless (a canary's blind spot)
        conventions = [total, mean]
        if w.get("grad_blocks"):
            conventions.append(total / len(ranks[(stage, tp_index)]) / real)
        if not any(_close(np.array(x), np.array(loss)) for x in conventions):
            return Judgement(False, f"the loss of stage {stage} tp {tp_index} is {total}, "
                                    f"not {loss}")
    return Judgement(True)


# -- folded plans ---------------------------------------------------------------
#
# A folded plan shows 2 replicas and 2 microbatches of a larger run
# (docs/soundness.md, "Folded plans"). The oracle judges it without trusting
# the fold: its keys must be consistent with the single-device plan and with
# the rows the plan loads; every shown block (replica, microbatch) of a class
# of ranks must run one program, compared here by naming tensors in order of
# first use; and the plan run in float64 must match the single-device plan
# traced at the shown rows with the real constants (made by the generator,
# passed in as ``single_shown``).


def _fold_keys_problem(single: Plan, single_shown: Plan, parallel: Plan) -> str:
    w = parallel.world
    real_dp, real_nm, real_gbs = (w.get(k) for k in ("fold_dp", "fold_nm", "fold_gbs"))
    if not all(isinstance(x, int) and x >= 1 for x in (real_dp, real_nm, real_gbs)):
        return "fold keys missing or not positive ints"
    if real_gbs != single.world.get("gbs"):
        return "fold_gbs is not the real batch"
    if real_gbs % (real_dp * real_nm):
        return "fold_gbs does not split into fold_dp x fold_nm blocks"
    rows = real_gbs // (real_dp * real_nm)
    dp = int(w.get("dp", 1))
    nm = len({n.mb for n in parallel.nodes if n.mb >= 0})
    if dp not in (min(real_dp, 2), real_dp) or nm not in (min(real_nm, 2), real_nm):
        return f"shows dp {dp} nm {nm} of fold_dp {real_dp} fold_nm {real_nm}"
    loaded = {lg.shape[0] for lg in parallel.logical if lg.kind in ("data", "tokens") and lg.shape}
    if loaded != {dp * nm * rows} or single_shown.world.get("gbs") != dp * nm * rows:
        return f"loads {sorted(loaded)} rows, not dp x nm x {rows}"
    return ""


def _block_programs(parallel: Plan) -> dict[tuple, list[int]]:
    w = parallel.world
    dp, cp, tp = (int(w.get(k, 1)) for k in ("dp", "cp", "tp"))
    out: dict[tuple, list[int]] = defaultdict(list)
    for i, n in enumerate(parallel.nodes):
        inner = n.rank % (tp * cp)
        d = (n.rank // (tp * cp)) % dp
        out[(n.rank // (tp * cp * dp), inner, n.mb, d)].append(i)
    return out


def _canonical(parallel: Plan, nodes: list[int], written: dict[int, int]) -> list:
    """A block's program with its tensors named by first use; tensors from
    outside the block by what they are, relative to the block's first row."""
    w = parallel.world
    dp, cp, tp = (int(w.get(k, 1)) for k in ("dp", "cp", "tp"))

    def place(rank: int) -> tuple[tuple[int, int], int]:
        return (rank // (tp * cp * dp), rank % (tp * cp)), (rank // (tp * cp)) % dp

    own_rank = parallel.nodes[nodes[0]].rank
    mb = parallel.nodes[nodes[0]].mb
    first = min((parallel.tensors[t].slices[0][0] for i in nodes for t in parallel.nodes[i].inputs
                 if t >= 0 and t not in written and parallel.tensors[t].slices
                 and parallel.logical[parallel.tensors[t].tid].kind in ("data", "tokens")),
                default=0)
    names: dict[int, int] = {}
    inside = set(nodes)
    prog = []
    for i in nodes:
        n = parallel.nodes[i]
        across = is_collective(n.op) and any(
            t >= 0 and place(parallel.tensors[t].rank)[1] != place(own_rank)[1] for t in n.inputs)
        if across and (mb >= 0 or n.op not in ("reducer", "all_reduce")):
            return [("crosses replicas other than as a sum after the microbatches", i)]
        refs = []
        for t in n.inputs:
            x = parallel.tensors[t] if t >= 0 else None
            if x is not None and mb >= 0 and x.mb == -1 and t in written and \
                    parallel.nodes[written[t]].op not in ("zeros", "ones"):
                return [("a block reads a value computed outside microbatches", i)]
            if x is None:
                refs.append(None)
            elif t in names and not across:
                refs.append(("v", names[t]))
            else:
                cls, d = place(x.rank)
                if d != place(own_rank)[1] and not across:
                    return [("reads another replica", i)]
                same_mb = "same" if x.mb == mb else ("step" if x.mb == -1 else "chain")
                if mb >= 0 and parallel.logical[x.tid].kind == "gradbuf":
                    same_mb = "chain"  # the running buffer: zeros, or the last microbatch's
                slices = x.slices if t not in written else None  # a claim is not the program
                if t not in written and parallel.logical[x.tid].kind in ("data", "tokens"):
                    slices = ((x.slices[0][0] - first, x.slices[0][1] - first), *x.slices[1:])
                version = x.version if same_mb != "chain" and written.get(t, -1) not in inside \
                    else None
                refs.append(("x", cls, d if across else None, same_mb if mb >= 0 else x.mb,
                             x.tid, version, x.shape, slices))
        outs = []
        for t in n.outputs:
            if t >= 0:
                names[t] = len(names)
                outs.append((parallel.tensors[t].tid, parallel.tensors[t].shape))
            else:
                outs.append(None)
        kwargs = dict(n.kwargs)
        if across:
            index = kwargs.pop("index", None)
            if not isinstance(index, int) or not 0 <= index < len(n.inputs) or \
                    n.inputs[index] < 0 or parallel.tensors[n.inputs[index]].rank != own_rank:
                return [("index not own", i)]
        if n.op == "send_recv":
            kwargs = {k: place(v)[0] for k, v in kwargs.items()}
        prog.append((n.op, n.dir, repr(sorted(kwargs.items())), refs, outs))
    return prog


def _uniform_problem(parallel: Plan) -> str:
    written = {o: i for i, n in enumerate(parallel.nodes) for o in n.outputs if o >= 0}
    programs = _block_programs(parallel)
    base: dict[tuple, list] = {}
    for (stage, inner, mb, _), nodes in sorted(programs.items(), key=lambda kv: kv[0][3]):
        prog = _canonical(parallel, nodes, written)
        key = (stage, inner, mb >= 0)
        if key not in base:
            base[key] = prog
        elif base[key] != prog:
            return f"rank {parallel.nodes[nodes[0]].rank} mb {mb} runs another program"
    return ""


def judge_folded(single: Plan, single_shown: Plan, parallel: Plan, seed: int = 0) -> Judgement:
    """A folded plan against the real single-device plan ``single``:
    consistent fold keys, one program per class of ranks, and right at the
    shown rows against ``single_shown`` (the generator's single-device plan
    at the shown rows with the real constants)."""
    problem = _fold_keys_problem(single, single_shown, parallel)
    if problem:
        return Judgement(False, f"fold: {problem}")
    try:
        problem = _uniform_problem(parallel)
    except (ValueError, TypeError, IndexError, KeyError) as e:
        problem = f"cannot read: {e}"
    if problem:
        return Judgement(False, f"fold: not uniform: {problem}")
    problem = _glue_problem(parallel, seed)
    if problem:
        return Judgement(False, f"fold: {problem}")
    return judge(single_shown, parallel, seed)


def _glue_problem(parallel: Plan, seed: int) -> str:
    """By value: the gradient buffer each rank ends with is the sum of the
    gradients its microbatches accumulated, or a sum of such sums over a
    group. Only then do more replicas and microbatches add up the same way."""
    try:
        values = _run(parallel, seed)
    except EvaluationError as e:
        return f"cannot run: {e}"
    total: dict[tuple[int, int], np.ndarray] = {}
    end: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for i, n in enumerate(parallel.nodes):
        if n.op == "local_grad_accumulation" and n.mb >= 0 and len(n.inputs) == 2:
            key = (n.rank, parallel.tensors[n.outputs[0]].tid)
            total[key] = total.get(key, 0.0) + values[n.inputs[1]]
            end[key] = n.outputs[0]
        for o in n.outputs:
            if o >= 0 and parallel.logical[parallel.tensors[o].tid].kind == "gradbuf":
                last[(n.rank, parallel.tensors[o].tid)] = i
    for key, i in last.items():
        n = parallel.nodes[i]
        if key not in total:
            return f"rank {key[0]} ends with a gradient buffer no microbatch accumulated"
        parts = [key] if n.op == "local_grad_accumulation" else [
            (parallel.tensors[t].rank, parallel.tensors[t].tid) for t in n.inputs if t >= 0]
        if n.op not in ("local_grad_accumulation", "reducer", "all_reduce") or any(
                p not in total or (n.op != "local_grad_accumulation" and t != end[p])
                for p, t in zip(parts, [t for t in n.inputs if t >= 0])):
            return f"rank {key[0]} ends with a gradient buffer that is not a sum of accumulations"
        want = sum(total[p] for p in parts)
        if not _close(values[n.outputs[0]], want):
            return f"rank {key[0]} ends with a gradient buffer other than the sum of its " \
                   f"microbatches' gradients"
    return ""
