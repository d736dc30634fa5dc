"""How the torch backend starts its ranks (backends/torch/tracer/ranks.py): every
rank forked from one clean process that imported the step's modules.

A rank traced that way is the rank a fresh interpreter traces; nothing the
caller ran (a cache it filled) reaches a rank; a rank that fails is named
in one line.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from backends.torch.lowering import LoweringError, lower_trace
from backends.torch.tracer.build import build_plans
from backends.torch.tracer.rank import run
from backends.torch.tracer.ranks import trace_ranks
from backends.torch.zoo.models import llama

ROOT = Path(__file__).resolve().parent.parent
ME = __name__
SIZES = {"layers": 1, "hidden": 16, "heads": 4, "ffn": 32, "vocab": 16, "seqlen": 4}


def spec(model: str = "backends.torch.models:llama", recipe: str = "backends.torch.recipes:tp_sp",
         **sizes) -> dict:
    return {"model": model, "model_kwargs": {**SIZES, **sizes}, "recipe": recipe, "dp": 1,
            "tp": 2, "pp": 1, "batch": 2, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"],
            "seed": 0, "parallel": True}


#: what a trace holds that depends on how its process started, not on the step
PROCESS_KEYS = ("cpu", "processes_cpu", "imports")


def step_of(trace: dict) -> dict:
    return {k: v for k, v in trace.items() if k not in PROCESS_KEYS}


def test_a_forked_rank_is_the_rank_a_fresh_interpreter_traces(tmp_path: Path) -> None:
    s = spec()
    forked = trace_ranks(s, 2)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(s))
    out = tmp_path / "rank1.pkl"
    subprocess.run([sys.executable, "-m", "backends.torch.rank", str(path), "1", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    fresh = pickle.loads(out.read_bytes())
    assert repr(step_of(fresh)) == repr(step_of(forked[1]))
    single = lower_trace(run({**s, "parallel": False}, 0), SIZES["vocab"])
    world = {"model": s["model"], "variant": "torch", "gbs": 2, "dp": 1, "tp": 2, "pp": 1,
             "ep": 1, "nm": 1, "recipe": s["recipe"], **SIZES}
    _, plan_forked = build_plans(single, [lower_trace(t, SIZES["vocab"]) for t in forked], world)
    single = lower_trace(run({**s, "parallel": False}, 0), SIZES["vocab"])
    _, plan_mixed = build_plans(single, [lower_trace(forked[0], SIZES["vocab"]),
                                         lower_trace(fresh, SIZES["vocab"])], world)
    assert plan_forked.nodes == plan_mixed.nodes
    assert plan_forked.tensors == plan_mixed.tensors


def test_an_import_that_starts_a_thread_still_traces_each_rank(tmp_path: Path,
                                                               monkeypatch) -> None:
    """Forking a process that runs another thread is unsafe: the zygote then
    starts the ranks afresh instead, and they trace the same."""
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    threaded = trace_ranks(spec(), 2, imports=["starts_a_thread"])
    plain = trace_ranks(spec(), 2)
    assert [repr(step_of(t)) for t in threaded] == [repr(step_of(t)) for t in plain]


@functools.lru_cache
def cached_rank() -> int:
    """The rank, read once per process (a cache of the kind that would hold
    rank 0 on every rank if the ranks inherited the caller's memory)."""
    return dist.get_rank() if dist.is_initialized() else 0


def layers_by_rank(**sizes):
    """The default Llama with 1 + the cached rank blocks."""
    return llama(**{**sizes, "layers": 1 + cached_rank()})


def test_what_the_caller_cached_does_not_reach_a_rank() -> None:
    assert cached_rank() == 0  # filled here, in the caller, as a single-device step would
    traces = trace_ranks(spec(model=f"{ME}:layers_by_rank"), 2, imports=[ME])
    blocks = [{name.split(".")[1] for name in t["params"] if name.startswith("layers.")}
              for t in traces]
    assert blocks == [{"0"}, {"0", "1"}]


def fails_on_rank_1(model, mesh):
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")


def dies_on_rank_1(model, mesh):
    if dist.get_rank() == 1:
        os._exit(3)


@pytest.mark.parametrize(("recipe", "message"), [
    ("fails_on_rank_1", "rank 1 did not run: ValueError: rank one refuses"),
    ("dies_on_rank_1", "rank 1 did not run: its process ended with exit code 3"),
])
def test_a_failing_rank_is_named(recipe: str, message: str) -> None:
    with pytest.raises(LoweringError, match=message):
        trace_ranks(spec(recipe=f"{ME}:{recipe}"), 2, imports=[ME])
