"""Trace every rank of a mesh: one process per rank, forked from this one.

A rank joins a (fake) process group once per process (re-initializing
ranks in one process fails when groups are resolved), so each rank runs in
a process of its own. The process is forked from the caller, which has
already imported torch, the model's and the recipe's modules and the
libraries they use (the single-device step ran here first): a rank pays
neither an interpreter start nor an import, only its own step. At most
one rank per core runs at a time, each with one intra-op thread.

Forking a process in which other threads run is unsafe (a lock another
thread holds stays held in the child), so when other threads are alive
(a test runner's worker, for one) the ranks are started from a fork
server instead: a clean process with torch's parallel APIs imported once,
in which each rank imports what else it needs.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from multiprocessing.connection import Connection, wait

import torch

from backends.torch.errors import LoweringError
from backends.torch.rank import load, run_isolated

#: modules the fork server imports once: torch's parallel APIs (pipelining
#: alone imports torch._dynamo, 0.7 s of CPU) and the backend's recording
PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.fsdp", "torch.distributed.pipelining", "backends.torch.rank"]


def start_method() -> str:
    """"fork" when this process runs no other thread, else "forkserver"."""
    return "fork" if threading.active_count() == 1 else "forkserver"


def trace_ranks(spec: dict, world: int, method: str | None = None) -> list[dict]:
    """Every rank's trace (``rank.run``), in rank order. ``method``: how the
    rank processes start, "fork" or "forkserver" (default: ``start_method``).
    A rank that fails stops the run with its error's last line."""
    method = method or start_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        modules = [ref.partition(":")[0] for ref in (spec["model"], spec["recipe"])]
        ctx.set_forkserver_preload([*PRELOAD, *modules])
    else:
        for ref in (spec["model"], spec["recipe"]):
            load(ref)  # imported here once, inherited by every rank
    workers = min(world, os.cpu_count() or 2)
    pending = list(range(world))
    running: dict[Connection, tuple[int, multiprocessing.process.BaseProcess]] = {}
    results: dict[int, dict | str] = {}
    while pending or running:
        while pending and len(running) < workers:
            rank = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_process, args=(spec, rank, send), daemon=True)
            proc.start()
            send.close()
            running[recv] = (rank, proc)
        for conn in wait(list(running)):
            rank, proc = running.pop(conn)
            try:
                results[rank] = conn.recv()
            except EOFError:
                proc.join()
                results[rank] = f"its process ended with exit code {proc.exitcode}"
            conn.close()
            proc.join()
    for rank in range(world):
        if isinstance(results[rank], str):
            raise LoweringError(f"rank {rank} did not run: {results[rank]}")
    return [results[rank] for rank in range(world)]


def _rank_process(spec: dict, rank: int, conn: Connection) -> None:
    """The body of a rank's process: its trace (or its error) sent back."""
    torch.set_num_threads(1)  # one rank per core: the ranks' ops are small
    conn.send(run_isolated(spec, rank))
    conn.close()
