"""Where stage proofs run: in this process, in a local process pool, or on Ray.

An executor takes jobs ``(key, problem, seed)`` and yields ``(key, outcome)``
as they finish, in any order. Closing the iterator (``contextlib.closing``)
drops the work not yet done: that is how the engine stops at the first
failure. What crosses a process boundary is plain data: a ``Problem`` (lists,
tuples, dicts of ints, floats and strings) out, an ``Outcome`` (a status,
strings, numpy float arrays) back. Each worker builds its own Z3 terms.

A stage whose worker dies (killed, out of memory, its node lost) is run again
on another worker; if that worker dies too, the stage's outcome is an error
naming the deaths, which the engine reports as no verdict (exit 3): a stage
whose proof never finished is never proved and never refuted.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Protocol

from verdict.problem import Problem
from verdict.solve import Outcome

Job = tuple[str, Problem, int]
SolveFn = Callable[[Problem, int], Outcome]
EXECUTORS = ("process", "ray")
RAY_INSTALL = "pip install 'verdict[ray]' (or pip install ray)"
DIES_ALLOWED = 1  # a stage is retried once after its worker dies


class ExecutorUnavailable(Exception):
    """The executor asked for cannot run here (bad input: exit 2)."""


class Executor(Protocol):
    def results(self, jobs: list[Job]) -> Iterator[tuple[str, Outcome]]:
        """Outcome of every job, in any order; closing the iterator cancels the rest."""
        ...


def run_job(job: Job, solve_fn: SolveFn) -> tuple[str, Outcome]:
    key, problem, seed = job
    try:
        return key, solve_fn(problem, seed)
    except Exception as e:  # a stage that cannot be run is a failure, never a crash
        return key, Outcome("error", f"stage worker raised {type(e).__name__}: {e}")


def died_twice(why: str) -> Outcome:
    return Outcome("error", f"its worker died {DIES_ALLOWED + 1} times ({why})")


def death(code: int | None) -> str:
    """How a worker process ended, from its exit code."""
    if code is not None and code < 0:
        how = f"killed by signal {-code}"
        if -code == 9:
            how += ", which the kernel's out-of-memory killer sends"
        return how
    return f"exit code {code}"


@dataclass
class InlineExecutor:
    """Every job in this process, in order."""

    solve_fn: SolveFn

    def results(self, jobs: list[Job]) -> Iterator[tuple[str, Outcome]]:
        for job in jobs:
            yield run_job(job, self.solve_fn)


def _serve(conn: Connection, solve_fn: SolveFn) -> None:
    """A pool worker: solve jobs from the pipe until told to stop."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(run_job(job, solve_fn))


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    job: int = -1  # index of the job it is running, -1 when idle
    done: int = 0


@dataclass
class ProcessExecutor:
    """A pool of forked processes on this machine, one job at a time each.

    Unlike ``multiprocessing.Pool`` (which loses the task of a killed worker
    and then waits for it forever), the driver knows which job each worker
    holds, so a death is seen (the worker's sentinel fires with nothing in
    its pipe) and the job goes to a fresh worker. A worker is replaced after
    ``tasks_per_worker`` jobs so Z3's memory is given back.
    """

    workers: int
    solve_fn: SolveFn
    tasks_per_worker: int = 64

    def results(self, jobs: list[Job]) -> Iterator[tuple[str, Outcome]]:
        if len(jobs) <= 1:
            yield from InlineExecutor(self.solve_fn).results(jobs)
            return
        ctx = multiprocessing.get_context("fork")
        todo = deque(range(len(jobs)))
        deaths = [0] * len(jobs)
        pool: list[_Worker] = []
        try:
            pool += [self._start(ctx) for _ in range(min(self.workers, len(jobs)))]
            while todo or any(w.job >= 0 for w in pool):
                for w in pool:
                    if w.job < 0 and todo:
                        self._give(w, todo, jobs, ctx)
                busy = [w for w in pool if w.job >= 0]
                if not busy:  # every send found a dead worker, now replaced: send again
                    continue
                ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy]))
                for w in busy:
                    if w.conn not in ready and w.process.sentinel not in ready:
                        continue
                    index, result = w.job, self._receive(w)
                    if result is not None:
                        yield result
                    else:
                        deaths[index] += 1
                        if deaths[index] > DIES_ALLOWED:
                            yield jobs[index][0], died_twice(death(w.process.exitcode))
                        else:
                            todo.appendleft(index)
                    if not w.process.is_alive() or w.done >= self.tasks_per_worker:
                        self._replace(w, ctx)
        finally:
            for w in pool:
                self._stop(w)

    def _start(self, ctx) -> _Worker:
        mine, theirs = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(theirs, self.solve_fn), daemon=True)
        process.start()
        theirs.close()
        return _Worker(process, mine)

    def _give(self, w: _Worker, todo: deque, jobs: list[Job], ctx) -> None:
        """Send the next job to an idle worker; one that died while idle is
        replaced and the job, which never started, stays first in line."""
        try:
            w.conn.send(jobs[todo[0]])
        except OSError:
            self._replace(w, ctx)
            return
        w.job = todo.popleft()

    def _receive(self, w: _Worker) -> tuple[str, Outcome] | None:
        """The worker's result, or None if it died before sending one."""
        try:
            result = w.conn.recv() if w.conn.poll() else None
        except (EOFError, OSError):
            result = None
        if result is None:
            w.process.join(5)
        else:
            w.done += 1
        w.job = -1
        return result

    def _replace(self, w: _Worker, ctx) -> None:
        self._stop(w)
        fresh = self._start(ctx)
        w.process, w.conn, w.job, w.done = fresh.process, fresh.conn, -1, 0

    @staticmethod
    def _stop(w: _Worker) -> None:
        if w.job < 0 and w.process.is_alive():
            with suppress(OSError):
                w.conn.send(None)
            w.process.join(1)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def _ray_job(job: Job, solve_fn: SolveFn) -> tuple[str, Outcome]:
    return run_job(job, solve_fn)


@dataclass
class RayExecutor:
    """Stage proofs as Ray tasks, on a cluster or on a Ray instance started here.

    ``address`` None starts a local instance with ``workers`` CPUs, bound to
    the loopback address, without dashboard or usage statistics, and shuts it
    down afterwards; an instance already started in this process (by
    ``ray.init``) is used as it is. Ray runs a task again when its worker
    dies (``max_retries=1``); a second death comes back as an exception,
    turned into the outcome ``died_twice``. At most twice the cluster's CPUs
    are in flight, so cancelling after a failure is quick.
    """

    solve_fn: SolveFn
    address: str | None = None
    workers: int = 2

    def results(self, jobs: list[Job]) -> Iterator[tuple[str, Outcome]]:
        ray = import_ray()
        started = self._connect(ray)
        task = ray.remote(num_cpus=1, max_retries=DIES_ALLOWED, retry_exceptions=False)(_ray_job)
        solve_ref = ray.put(self.solve_fn)
        window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        todo = deque(jobs)
        running: dict = {}
        try:
            while todo or running:
                while todo and len(running) < window:
                    job = todo.popleft()
                    running[task.remote(job, solve_ref)] = job
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    job = running.pop(ref)
                    try:
                        yield ray.get(ref)
                    except ray.exceptions.RayTaskError as e:
                        cause = getattr(e, "cause", e)
                        yield job[0], Outcome("error", f"stage task raised {type(cause).__name__}")
                    except ray.exceptions.RayError as e:
                        yield job[0], died_twice(type(e).__name__)
        finally:
            for ref in running:
                ray.cancel(ref)
            if started:
                ray.shutdown()

    def _connect(self, ray) -> bool:
        """Connect to Ray; whether this call started the instance it uses."""
        if ray.is_initialized():
            return False
        if self.address:
            ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
        else:
            ray.init(**local_ray_options(self.workers))
        return True


def import_ray():
    """Ray, set up before it is first imported: no usage statistics, and a
    local instance on the loopback address (Ray otherwise takes the address
    of the machine's outward interface and listens on every interface)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError as e:
        raise ExecutorUnavailable(f"--executor ray needs Ray: {RAY_INSTALL}") from e
    return ray


def local_ray_options(cpus: int) -> dict:
    """ray.init options for a new instance on this machine only ("local": not
    one that ``ray start`` left running, which plain ``ray.init()`` would join)."""
    return dict(address="local", num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                log_to_driver=False, logging_level="ERROR", configure_logging=True)


def make_executor(kind: str, workers: int, address: str | None, solve_fn: SolveFn) -> Executor:
    """The executor for ``--executor kind`` running ``solve_fn`` (a
    ``verdict.solve.Prover``); ExecutorUnavailable if it cannot run."""
    if kind == "ray":
        if not ray_available():
            raise ExecutorUnavailable(f"--executor ray needs Ray: {RAY_INSTALL}")
        return RayExecutor(solve_fn, address, max(workers, 1))
    if address:
        raise ExecutorUnavailable("--ray-address needs --executor ray")
    if workers <= 1:
        return InlineExecutor(solve_fn)
    return ProcessExecutor(workers, solve_fn)
