"""Verify a parallelization from Python: one call, a result object.

    from backends.torch.api import verify

    result = verify("mypkg.model:build", "mypkg.parallel:apply_tp", mesh="dp=2,tp=2")
    assert result, result.explain()

``verify`` traces one training step of the model on one device and on
every rank of the mesh (CPU, fake process group, one process per rank),
lowers both, proves them equal with Z3 and returns a :class:`Result`. The
model factory and the parallelize function are ``package.module:name``
references or functions defined at the top level of an importable module
(each rank's process imports them); a script calls it under
``if __name__ == "__main__":`` (the ranks start from multiprocessing's
fork server). ``backends/torch/pytest_plugin.py`` wraps it as an
assertion for a test suite.
"""

from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EQUIVALENT, NOT_EQUIVALENT, REFUSED, NO_VERDICT = 0, 1, 2, 3
STATUS = {EQUIVALENT: "equivalent", NOT_EQUIVALENT: "not equivalent", REFUSED: "refused",
          NO_VERDICT: "no verdict"}


@dataclass
class Result:
    """What ``verify`` found. True when the parallel step is proved equal to
    the single-device step."""
    #: 0 equivalent, 1 not equivalent, 2 refused (bad input), 3 no verdict:
    #: the exit codes of ``verdict torch``
    code: int
    #: the first line of the verdict (the reason, for anything but a SUCCESS)
    message: str
    #: a FAIL's lead lines in the model's names (verdict/diagnosis.py)
    diagnosis: list[str] = field(default_factory=list)
    #: the counterexample's rank, module (scope) and parallel node, when found
    rank: int | None = None
    module: str | None = None
    node: str | None = None
    #: what a SUCCESS proved (stages, lineages, coverage), one line each
    proved: list[str] = field(default_factory=list)
    #: what it took without a proof (``assumed, not proved: ...``)
    assumed: str = ""
    #: seconds: trace (single device and every rank, lowering, plans), verify, total
    timings: dict[str, float] = field(default_factory=dict)
    #: the full report: what ``main.py`` prints, the counterexample's dump included
    report: str = ""
    #: the plan files, when ``keep`` was given
    plans: tuple[Path, Path] | None = None

    @property
    def equivalent(self) -> bool:
        return self.code == EQUIVALENT

    @property
    def status(self) -> str:
        return STATUS[self.code]

    def __bool__(self) -> bool:
        return self.equivalent

    def explain(self) -> str:
        """A few lines: the verdict and, for a FAIL, the diagnosis."""
        if self.equivalent:
            return "\n".join(["✅ equivalent", *self.proved, self.assumed])
        head = {NOT_EQUIVALENT: "❌ not equivalent", REFUSED: "refused",
                NO_VERDICT: "no verdict"}[self.code]
        return "\n".join(self.diagnosis or [f"{head}: {self.message}"])

    def __str__(self) -> str:
        return self.explain()


def reference(obj: Any, what: str) -> str:
    """A ``package.module:name`` reference to ``obj`` (a string is taken as one)."""
    if isinstance(obj, str):
        return obj
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or not name or "<" in name or "." in name:
        raise ValueError(f"the {what} {obj!r} is not a function at the top level of an "
                         f"importable module (each rank's process imports it): pass it as "
                         f"'package.module:name' or define it in a module")
    return f"{module}:{name}"


def verify(model: Any, parallelize: Any, mesh: Any = None, batch: int = 4, *,
           data_dims: list[str] | tuple[str, ...] | None = None, seqlen: int = 4,
           vocab: int = 16, layers: int | None = None, hidden: int = 16, heads: int = 4, ffn: int = 32,
           optimizer: str = "none", clip: float | None = None, clipper: Any = None,
           seed: int = 0, keep: str | Path | None = None) -> Result:
    """Prove ``parallelize`` (called as ``parallelize(model, mesh)`` on every
    rank) keeps the training step of ``model`` (a factory called with the
    size keywords ``layers, hidden, heads, ffn, vocab, seqlen``) equal to
    its single-device step.

    ``mesh``: the recipe's mesh, in your order: ``"dp_shard=2,tp=2"``, a
    dict ``{"dp_shard": 2, "tp": 2}``, (name, size) pairs, or a
    DeviceMesh-like object (``mesh_dim_names`` and ``shape``); None is the
    default mesh ``("pp", "dp", "tp")`` of sizes (1, 2, 2). ``data_dims``:
    the dims that split the batch (default: those named dp, dp_replicate,
    dp_shard, fsdp, ...). ``batch``: the step's global batch size
    (``seqlen`` tokens a row). ``keep``: a directory to write the two plan
    files into (verify them again with ``verdict check``)."""
    from backends.torch.__main__ import parser, trace_and_build
    from backends.torch.errors import LoweringError, WrongStep
    from backends.torch.tracer.check import LoadedValueMismatch
    from backends.torch.tracer.mesh import default_spec, from_device_mesh

    start = time.perf_counter()
    try:
        spec = default_spec(1, 2, 2) if mesh is None else from_device_mesh(mesh, data_dims)
        refs = [reference(model, "model factory"), reference(parallelize, "parallelize function")]
        if clipper is not None:
            refs.append(reference(clipper, "clipper"))
    except (ValueError, LoweringError) as e:
        return Result(REFUSED, str(e), timings={"total": time.perf_counter() - start})
    args = parser().parse_args([])
    pp, dp, tp = spec.layout()
    vars(args).update(model=refs[0], recipe=refs[1], clipper=refs[2] if clipper else None,
                      mesh=None if mesh is None else spec, pp=pp, dp=dp, tp=tp,
                      cp=spec.size("cp"), batch=batch,
                      seqlen=seqlen, vocab=vocab, layers=layers, hidden=hidden, heads=heads,
                      ffn=ffn, optimizer=optimizer, clip=clip, seed=seed)
    try:
        (single, parallel), _ = trace_and_build(args)
    except WrongStep as e:  # a finding before any proof (a LoweringError's subclass)
        return _mismatch(str(e), start)
    except LoweringError as e:
        return Result(REFUSED, str(e), timings={"total": time.perf_counter() - start})
    except LoadedValueMismatch as e:
        return _mismatch(str(e), start)
    traced = time.perf_counter()
    result = prove(single, parallel, keep)
    result.timings = {"trace": traced - start, "verify": time.perf_counter() - traced,
                      "total": time.perf_counter() - start}
    return result


def _mismatch(message: str, start: float) -> Result:
    """A finding before the proof: a rank's loaded shard or batch rows that are not
    its claimed piece, or a step wrong on its face."""
    found = re.search(r"\brank (\d+)\b", message)
    return Result(NOT_EQUIVALENT, message, diagnosis=[f"❌ not equivalent: {message}"],
                  rank=int(found.group(1)) if found else None,
                  timings={"total": time.perf_counter() - start})


def prove(single, parallel, keep: str | Path | None = None) -> Result:
    """Prove a plan pair made in memory as ``main.py`` proves a pair of files
    (written and read back, so the files' checks apply). No stage cache."""
    import contextlib

    import main
    from backends.planfile import load_plan, save_plan
    from verdict.diagnosis import diagnose
    from verdict.plan import pair_problem
    from verdict.report import assumed, evidence, failure

    with contextlib.ExitStack() as stack:
        folder = Path(keep) if keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        sm, _ = save_plan(single, folder / "single.pkl")
        pm, _ = save_plan(parallel, folder / "parallel.pkl")
        single, parallel = load_plan(sm), load_plan(pm)
    plans = (sm, pm) if keep else None
    problem = pair_problem(single, parallel)
    if problem:
        return Result(REFUSED, problem, plans=plans)
    try:
        verdict = main.verify(single, parallel)
    except Exception as e:  # never a verdict from an exception
        return Result(NO_VERDICT, f"{type(e).__name__}: {e}", plans=plans)
    if verdict.kind == "internal":
        return Result(NO_VERDICT, verdict.message, plans=plans)
    if verdict.pair:
        single, parallel = verdict.pair
    if verdict.success:
        proved = evidence(verdict, single)
        took = assumed(parallel, verdict)
        return Result(EQUIVALENT, "✅ SUCCESS", proved=proved, assumed=took,
                      report="\n".join([*proved, took, "✅ SUCCESS"]), plans=plans)
    lines = diagnose(verdict, single, parallel)
    dump = failure(verdict, single, parallel)
    result = Result(NOT_EQUIVALENT, verdict.message or lines[0], diagnosis=lines,
                    report="\n".join([*lines, "", *dump, "❌ FAIL"]), plans=plans)
    where(result, verdict, parallel)
    return result


def where(result: Result, verdict, parallel) -> None:
    """The counterexample's rank, module and node into ``result``."""
    from verdict.structure import node_label
    if verdict.kind == "stage" and verdict.failed:
        r = verdict.failed[0]
        bad = [r.problem.tp_global[m] for c, g in r.outcome.bad if g >= 0
               for m in r.problem.claims[c].groups[g][1]]
        nodes = [i for i in r.stage.gp_nodes if bad and bad[0] in parallel.nodes[i].outputs]
        i = nodes[0] if nodes else (r.stage.gp_nodes[0] if r.stage.gp_nodes else None)
        if i is not None:
            node = parallel.nodes[i]
            result.rank, result.module, result.node = node.rank, node.name, node_label(parallel, i)
        if bad:
            result.rank = parallel.tensors[bad[0]].rank
        return
    found = re.search(r"\brank (\d+)\b", verdict.message)
    result.rank = int(found.group(1)) if found else None
    found = re.search(r"name='([^']*)'", verdict.message)
    result.module = found.group(1) if found else None
    found = re.search(r"Node\([^)]*\)", verdict.message)
    result.node = found.group(0) if found else None
