"""Run jobs in recycled worker processes, and notice when one dies.

``multiprocessing.Pool`` replaces a worker the kernel killed (out of memory,
say) but never answers its job, so a run waiting for it hangs.
:func:`run_jobs` gives each worker one job at a time over a pipe and waits
on the pipes and on the processes themselves: a worker that ends without
answering raises :class:`WorkerDied`, which the engine turns into "no
verdict". A worker is replaced after ``tasks_per_worker`` jobs so that
memory a solver keeps per process is given back.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

TASKS_PER_WORKER = 64


class WorkerDied(RuntimeError):
    """A worker process ended before it answered its job."""


def _serve(fn: Callable[[Any], Any], conn: Connection) -> None:
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(fn(job))


class _Worker:
    def __init__(self, ctx, fn: Callable[[Any], Any]):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(fn, child), daemon=True)
        self.process.start()
        child.close()
        self.done = 0

    def give(self, job: Any) -> None:
        try:
            self.conn.send(job)
        except OSError:
            self.process.join()
            raise WorkerDied(_died(self.process.exitcode)) from None
        self.done += 1

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.conn.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def kill(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.join()


def run_jobs(fn: Callable[[Any], Any], jobs: list[Any], workers: int,
             tasks_per_worker: int = TASKS_PER_WORKER) -> Iterator[Any]:
    """``fn(job)`` for every job, in completion order, in ``workers`` forked
    processes. Closing the iterator early kills the workers still busy."""
    ctx = multiprocessing.get_context("fork")
    pending = list(reversed(jobs))
    busy: dict[Connection, _Worker] = {}

    def start() -> None:
        w = _Worker(ctx, fn)
        w.give(pending.pop())
        busy[w.conn] = w

    try:
        while pending and len(busy) < workers:
            start()
        while busy:
            sentinels = {w.process.sentinel: w for w in busy.values()}
            for ready in wait([*busy, *sentinels]):
                w = busy.get(ready) if isinstance(ready, Connection) else sentinels[ready]
                if w is None or w.conn not in busy:
                    continue
                try:
                    result = w.conn.recv()
                except (EOFError, OSError):
                    w.process.join()
                    raise WorkerDied(_died(w.process.exitcode)) from None
                del busy[w.conn]
                if pending and w.done < tasks_per_worker:
                    w.give(pending.pop())
                    busy[w.conn] = w
                else:
                    w.stop()
                    if pending:
                        start()
                yield result
    finally:
        for w in busy.values():
            w.kill()


def _died(code: int | None) -> str:
    if code is not None and code < 0:
        how = f"killed by signal {-code}"
        if -code == 9:
            how += " (the kernel's out-of-memory killer sends this)"
    else:
        how = f"exit code {code}"
    return f"a stage worker died without an answer ({how})"
