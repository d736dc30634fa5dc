"""Trace every rank of a mesh: one process per rank, all forked from one
clean process that has imported what the step needs once.

A rank joins a (fake) process group once per process (re-initializing
ranks in one process fails when groups are resolved), so each rank runs in
a process of its own. What a rank costs is then its own step plus how its
process starts: an interpreter and the imports of torch, the model's
library (transformers: about 1.7 s of CPU, torchtitan about 5 s) and the
recipe's would cost more than the step of a small model.

So the ranks of one trace are forked from a *zygote*: a child of
multiprocessing's fork server (a clean process that imported torch's
parallel APIs once) that first imports the modules the caller names (the
model's and recipe's modules, those the single-device step imported and
those defining the model's classes), then forks every rank, at most one
per core at a time (each runs with one intra-op thread,
``rank.one_thread``), imports what each finished rank imported before
forking the next, and relays their traces. A rank's process thus holds
exactly what a fresh process holds after some imports: nothing the
caller ran (the single-device step, earlier traces, a test runner's
threads) is inherited, so no cache filled there, and no lock held by
another thread of the caller, reaches a rank. Should an import leave a
thread running in the zygote, the ranks after it start afresh
(``spawn``) instead of forking.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import resource
import sys
import threading
from multiprocessing.connection import Connection, wait

from backends.torch.errors import LoweringError
from verdict.progress import progress

#: modules the fork server imports once: torch's parallel APIs (pipelining
#: alone imports torch._dynamo, 0.7 s of CPU) and the backend's recording
PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.fsdp", "torch.distributed.pipelining", "backends.torch.tracer.rank"]


def trace_ranks(spec: dict, world: int, imports: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """Every rank's trace (``rank.run``), in rank order. ``imports``: modules
    to import once before the ranks fork (a module that fails to import is
    left to the ranks). A rank that fails stops the run with its error's
    last line. Each trace also holds ``processes_cpu``: the CPU seconds of
    every process of the trace (the zygote's imports, the ranks)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    modules = [ref.partition(":")[0] for ref in (spec["model"], spec["recipe"])]
    recv, send = ctx.Pipe(duplex=False)
    zygote = ctx.Process(target=_zygote, args=(spec, world, [*imports, *modules], send))
    zygote.start()
    send.close()
    results: dict[int, dict | str] = {}
    bar = progress(None, "tracing ranks", total=world)  # on a terminal, after a second
    try:
        while len(results) < world:
            rank, payload = recv.recv()
            results[rank] = pickle.loads(payload) if isinstance(payload, bytes) else payload
            bar.update(1)
        _, processes_cpu = recv.recv()
    except EOFError:
        zygote.join()
        raise LoweringError(f"the ranks' parent process ended with exit code {zygote.exitcode} "
                            f"before every rank was traced") from None
    finally:
        bar.close()
        recv.close()
        zygote.join()
    for rank in range(world):
        if isinstance(results[rank], str):
            raise LoweringError(f"rank {rank} did not run: {results[rank]}")
    return [{**results[rank], "processes_cpu": processes_cpu} for rank in range(world)]


def _zygote(spec: dict, world: int, imports: list[str], out: Connection) -> None:
    """Import ``imports``, fork every rank (at most one per core at a time),
    send each ``(rank, pickled trace or error line)`` to ``out``. What a
    finished rank imported during its step is imported here too before the
    next ranks fork (a library the caller had imported before its
    single-device step, which ``imports`` then misses, is imported by the
    first ranks only)."""
    _import(imports)
    workers = min(world, os.cpu_count() or 2)
    pending = list(range(world))
    running: dict[Connection, tuple[int, multiprocessing.process.BaseProcess]] = {}
    while pending or running:
        while pending and len(running) < workers:
            rank = pending.pop(0)
            # forking is safe while this process runs one thread; should an import
            # have started another (one that could hold a lock), the rank starts afresh
            ctx = multiprocessing.get_context("fork" if threading.active_count() == 1 else "spawn")
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank, args=(spec, rank, send), daemon=False)
            proc.start()
            send.close()
            running[recv] = (rank, proc)
        for conn in wait(list(running)):
            rank, proc = running.pop(conn)
            try:
                learned, payload = conn.recv()
                _import(learned)
            except EOFError:
                proc.join()
                payload = f"its process ended with exit code {proc.exitcode}"
            conn.close()
            proc.join()
            out.send((rank, payload))
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    out.send(("cpu", sum(u.ru_utime + u.ru_stime for u in usage)))
    out.close()


def _import(names: list[str]) -> None:
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # e.g. a module only importable as a side effect of another: the ranks import it
            continue


def _rank(spec: dict, rank: int, out: Connection) -> None:
    """A rank's process: the modules its step imported and its trace (or its
    error's last line), pickled."""
    from backends.torch.tracer.rank import run_isolated
    trace = run_isolated(spec, rank)
    out.send((trace["imports"] if isinstance(trace, dict) else [], pickle.dumps(trace)))
    out.close()
