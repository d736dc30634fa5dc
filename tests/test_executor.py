"""Executors: plain data across processes, worker deaths, the command-line flags."""

from __future__ import annotations

import io
import os
import pickle
import signal
from pathlib import Path

import pytest

import main
import verdict.executor as executor_module
from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from main import PROVER, verify
from verdict.executor import InlineExecutor, ProcessExecutor, make_executor

MLP = ModelConfig("mlp", layers=2, hidden=8)


@pytest.fixture(scope="module")
def pair():
    return make_plan(MLP, Parallelism(), 8), make_plan(MLP, Parallelism(dp=2, tp=2, pp=2, nm=2), 8)


def die_once(marker: Path):
    """A solve that kills its own process the first time any worker runs it."""
    def run(problem, seed=0):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return PROVER(problem, seed)
        os.kill(os.getpid(), signal.SIGKILL)
    return run


def die_always(problem, seed=0):
    os.kill(os.getpid(), signal.SIGKILL)


def test_problems_and_outcomes_are_plain_data(pair):
    """No Z3 object crosses a process boundary: what is sent and returned
    pickles without referring to z3."""
    seen = []

    def record(problem, seed=0):
        seen.append(problem)
        return PROVER(problem, seed)

    assert verify(*pair, executor=InlineExecutor(record)).success
    assert seen
    for problem in seen:
        assert not any(m.startswith("z3") for m in modules_pickled(problem))
        assert not any(m.startswith("z3") for m in modules_pickled(PROVER(problem)))


def modules_pickled(value) -> set[str]:
    """The modules whose classes or functions a pickle of value refers to."""
    found = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            found.add(module)
            return super().find_class(module, name)

    Recorder(io.BytesIO(pickle.dumps(value))).load()
    return found


def test_process_pool_gives_the_same_verdict(pair):
    one = verify(*pair, executor=InlineExecutor(PROVER))
    two = verify(*pair, executor=ProcessExecutor(2, PROVER))
    assert one.success and two.success
    assert [r.key for r in one.results] == [r.key for r in two.results]


def test_process_pool_retries_a_stage_whose_worker_died(pair, tmp_path):
    verdict = verify(*pair, executor=ProcessExecutor(2, die_once(tmp_path / "died")))
    assert (tmp_path / "died").exists()
    assert verdict.success


def test_process_pool_worker_dying_twice_is_no_verdict(pair):
    verdict = verify(*pair, executor=ProcessExecutor(2, die_always))
    assert not verdict.success and verdict.kind == "internal"
    assert verdict.message.startswith("stage ") and "died 2 times" in verdict.message


def test_process_pool_recycles_workers(pair):
    assert verify(*pair, executor=ProcessExecutor(2, PROVER, tasks_per_worker=1)).success


def test_make_executor_choices():
    assert isinstance(make_executor("process", 1, None, PROVER), InlineExecutor)
    assert isinstance(make_executor("process", 2, None, PROVER), ProcessExecutor)
    with pytest.raises(executor_module.ExecutorUnavailable, match="--executor ray"):
        make_executor("process", 2, "127.0.0.1:6379", PROVER)


def test_executor_ray_without_ray_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(executor_module, "ray_available", lambda: False)
    code = main.main(["--sm", "a.pkl", "--pm", "b.pkl", "--executor", "ray",
                      "--stats_dir", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 2 and not out.out
    assert len(out.err.strip().splitlines()) == 1 and "pip install" in out.err
