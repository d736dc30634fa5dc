"""Stage proofs on a real local Ray instance (2 CPUs), started once for the module.

The same plans and the same output as the process pool; a worker killed
during a run has its stage run again; a stage whose worker dies twice is no
verdict (exit 3). CI installs the `ray` extra (the Makefile does), so there
these tests must run; elsewhere they are skipped when Ray is not installed.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest
from helpers import mlp_plan_files

import main
from gen_model.config import Parallelism
from main import PROVER, verify
from verdict.executor import RayExecutor, import_ray, local_ray_options, ray_available

if not ray_available():
    if os.environ.get("CI"):
        pytest.fail("Ray is not installed: make test installs the 'ray' extra", pytrace=False)
    pytest.skip("Ray is not installed (pip install '.[ray]')", allow_module_level=True)



@pytest.fixture(scope="module")
def ray_instance():
    ray = import_ray()
    ray.init(**local_ray_options(2))
    # the solve functions below travel by value: Ray's workers cannot import tests/
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    return mlp_plan_files(tmp_path_factory.mktemp("ray_plans"), Parallelism(dp=2, tp=2, pp=2, nm=2))


def run(args: list[str], tmp_path: Path, capsys) -> tuple[int, str, str]:
    code = main.main([*args, "--no_cache_stages", "--stats_dir", str(tmp_path / "stats"),
                      "--cache_dir", str(tmp_path / "cache"), "--log_dir", str(tmp_path / "logs")])
    out = capsys.readouterr()
    return code, out.out, out.err


def untimed(out: str) -> str:
    return re.sub(r"PID: \d+", "PID", re.sub(r"(t_\w+)=[0-9.]+", r"\1", out))


@pytest.mark.parametrize(("pm", "extra", "code"), [
    ("parallel", [], 0),
    ("wrong", [], 1),
    ("wrong", ["--keep-going"], 1),
])
def test_same_output_as_the_process_pool(ray_instance, plans, tmp_path, capsys, pm, extra, code):
    args = ["--sm", str(plans["single"]), "--pm", str(plans[pm]), "--max_vrf_proc", "2", *extra]
    pool = run(args, tmp_path, capsys)
    on_ray = run([*args, "--executor", "ray"], tmp_path, capsys)
    assert pool[0] == on_ray[0] == code
    if code == 1:
        assert "❌ FAIL" in on_ray[1] and "🚨" in on_ray[1]
    if pm == "wrong" and not extra:  # which stages ran before the first failure may differ
        pool, on_ray = [(c, out.rsplit("\nStats(", 1)[0], err) for c, out, err in (pool, on_ray)]
    assert untimed(pool[1]) == untimed(on_ray[1]) and pool[2] == on_ray[2] == ""


def die_once(marker: Path):
    """A solve that kills its own worker process the first time it runs."""
    def run_or_die(problem, seed=0):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return PROVER(problem, seed)
        os.kill(os.getpid(), signal.SIGKILL)
    return run_or_die


def die_always(problem, seed=0):
    os.kill(os.getpid(), signal.SIGKILL)


def test_killed_worker_has_its_stage_retried(ray_instance, plans, tmp_path):
    from backends.planfile import load_plan
    single, parallel = load_plan(plans["single"]), load_plan(plans["parallel"])
    verdict = verify(single, parallel, executor=RayExecutor(solve_fn=die_once(tmp_path / "died")))
    assert (tmp_path / "died").exists()
    assert verdict.success


def test_worker_dying_twice_exits_3_naming_the_stage(ray_instance, plans, tmp_path, capsys,
                                                     monkeypatch):
    monkeypatch.setattr(main, "make_executor", lambda *args: RayExecutor(solve_fn=die_always))
    code, out, err = run(["--sm", str(plans["single"]), "--pm", str(plans["parallel"])],
                         tmp_path, capsys)
    assert code == 3 and "SUCCESS" not in out and "FAIL" not in out
    assert len(err.strip().splitlines()) == 1
    assert re.search(r"stage \d+ was not decided: .*died 2 times", err)
