"""One rank's training step, recorded: ``python -m backends.torch.rank SPEC RANK OUT``.

SPEC is a JSON file of the spec dict ``backends.torch.__main__`` builds (model,
recipe, mesh sizes, seed, optimizer, clip). The rank joins a
fake process group of the spec's world (collectives run no communication
and return garbage; only the structure of what runs is used), builds the
model in float64 with the spec's seed, applies the recipe, runs forward and
backward on its data-parallel slice of the batch and the recipe's
``after_backward``, and pickles plain data to OUT.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import pickle
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from backends.torch.tracer.circular_pad import CircularPad
from backends.torch.tracer.exchange import Exchanges
from backends.torch.tracer.failure import StepFailed, failure_line
from backends.torch.tracer.loaded import SetupCollectives, loaded_values
from backends.torch.tracer.mesh import build as build_mesh
from backends.torch.tracer.mesh import coords as mesh_coords
from backends.torch.tracer.pipeline import OwnSchedule, Pipelined, PipelineStep
from backends.torch.tracer.placements import dims_axes
from backends.torch.tracer.record import Recorder, Tracker, ValueReads, local_of, traced_numbers
from backends.torch.tracer.routing import Routing
from backends.torch.tracer.wrapper_names import named_buffers, named_parameters


def imported_since(before: set[str]) -> list[str]:
    """The modules imported since ``before`` (a snapshot of ``sys.modules``),
    in import order, to name as ``trace_ranks``'s ``imports`` (a step that
    imports what an earlier one already did finds only the new ones: naming
    too few costs time in every rank, never a different trace)."""
    return [name for name in list(sys.modules) if name not in before and not name.startswith("__")]


def load(ref: str) -> Any:
    """``package.module:name`` -> the object."""
    module, _, name = ref.partition(":")
    if not name:
        raise ValueError(f"'{ref}' is not of the form package.module:name")
    return getattr(importlib.import_module(module), name)


def in_float64(t: torch.Tensor) -> torch.Tensor:
    """Real tensors in float64, complex ones in complex128 (``Module.to``
    would drop the imaginary part of a complex buffer such as torchtitan's
    ``freqs_cis``), integer and boolean ones as they are."""
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64) if t.is_floating_point() else t


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op parallelism off for the duration: the traced ops are
    small, what they compute is unchanged (only the structure of the run is
    recorded, at the dispatcher, above any kernel's threading), and idle
    OpenMP workers spinning on a loaded machine cost several times the
    step's own CPU (torchtitan's debugmodel on one device: 0.35 s of CPU with
    one thread, 2 to 4 s with two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def own_process_group() -> Iterator[None]:
    """The default process group the step initializes (a rank's fake group
    of the whole mesh, or Megatron's group of one rank on one device)
    destroyed after it, whatever it raised: the caller's process is left
    as it was. Left behind, a later step traced in the same process (a
    test worker's) would find it: Megatron's ``parallel_state`` built on
    one device over a world of two ranks (its data-parallel group not of
    one rank), or a rank failing to initialize its group twice. A group
    the caller initialized before stays."""
    had = dist.is_initialized()
    try:
        yield
    finally:
        if not had and dist.is_initialized():
            dist.destroy_process_group()


def run(spec: dict, rank: int) -> dict:
    """One rank's step (or, ``spec["parallel"]`` false, the single-device
    step), recorded: plain data (see ``main``)."""
    with one_thread(), own_process_group():
        return _run(spec, rank)


def _run(spec: dict, rank: int) -> dict:
    before = set(sys.modules)
    cp = spec.get("cp", 1) if spec["parallel"] else 1
    world = spec["dp"] * cp * spec["tp"] * spec["pp"]
    model, runner, after, mesh, loaded, coords = _setup(spec, rank, cp, world)
    order = sequence_order(model, spec["seqlen"], cp) if spec["parallel"] else None
    tokens, labels = _batch(spec, coords, cp, order)

    tracker = Tracker()
    rec = Recorder(tracker)
    block = (coords["dp"], spec["dp"]) if spec["parallel"] else (0, 1)
    # the rank's block of the positions: its context-parallel chunk, cut by
    # the tensor-parallel ranks under sequence parallelism
    seq_block = (coords["cp"] * spec["tp"] + coords["tp"], cp * spec["tp"]) \
        if spec["parallel"] else (0, 1)
    rec.routing = Routing(spec.get("routing"), block, seq_block,
                          bool(getattr(model, "sequence_first", False)))
    rec.routing.batch = spec["batch"]
    rec.routing.fill_skipped = bool(spec.get("fill_skipped"))
    if spec["parallel"]:
        # a step that all-reduces constants (torchtitan's expert counts) has them answered
        rec.exchanges = Exchanges(rank, spec.get("exchanges"),
                                  reduce=bool(getattr(model, "reduces_constants", False)))
    pipelined, own = None, None
    if isinstance(after, OwnSchedule):
        own, after = after, after.after_backward
    if isinstance(after, PipelineStep):
        pipelined = Pipelined(after, tokens, rec.set_mb)
        after = after.after_backward
    params, buffers, split = _held(rec, model, spec, cp)
    if spec["parallel"]:  # a parameter written in place that is none of these is a copy
        rec.held = {id(p) for p in model.parameters()} | {id(local_of(p)) for p in model.parameters()}
    data = rec.new_value(tokens)
    rec.from_ids.seed(data)
    label_data = rec.new_value(labels)
    try:
        with tracker, rec, ValueReads(rec), traced_numbers(rec), CircularPad():
            with train_context(model):
                if pipelined is not None:
                    losses = pipelined.run(tokens, labels)
                elif own is not None:
                    losses = own.run(tokens, labels, rec.set_mb)
                else:
                    losses = [runner(tokens, labels)]
                    losses[0].backward()
            if after is not None:
                after(model, mesh)
            optimizer = update(model, mesh, spec)
    except Exception as e:
        if rec.exchanges is None or not rec.exchanges.unanswered:
            if spec["parallel"]:  # the rank's one line: where, what, a real run's path (item 110 (c))
                raise StepFailed(failure_line(e, model, params, rec.events, rec.constants)) \
                    from None
            raise
        # shapes from an all-to-all the fake group answered: the next pass
        # answers it from what this one sent (exchange.settle)
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return {"rank": rank, "exchanges": rec.exchanges.sent, "unanswered": rec.exchanges.unanswered,
                "failed": f"{type(e).__name__}: {last}", "imports": imported_since(before)}
    grads, updates, states = _ends(rec, model, optimizer)
    copies = copies_written(rec, model) if spec["parallel"] else []
    final_buffers = _final_buffers(rec, model)
    if spec["parallel"]:
        updates = _written(updates, params)
    blocks = _grad_blocks(rec, model)
    values = _values(model, tokens, labels, losses) if spec.get("keep_values") else None
    return {
        "ties": _ties(model),
        "rank": rank, "coords": coords, "split": split, "events": rec.events, "shapes": rec.shapes,
        "parallel": bool(spec["parallel"]),
        "sequence_order": order,
        "updates": updates, "states": states,
        "consts": rec.consts, "constants": rec.constants, "constvals": rec.constvals,
        "answers": rec.answers,
        "int_values": rec.int_values,
        "from_buffer": rec.from_buffer,
        "params": params, "buffers": buffers,
        "data": (data, tuple(tokens.shape)), "labels": (label_data, tuple(labels.shape)),
        "batch_ids": {"tokens": tokens.numpy().copy(), "labels": labels.numpy().copy()},
        "loaded": loaded,  # what the rank holds before the step (check.check_loaded)
        "losses": [rec.value(local_of(loss)) for loss in losses], "grads": grads,
        "grad_blocks": blocks,
        "microbatches": pipelined.microbatches if pipelined is not None
        else own.microbatches if own is not None else 1,
        "values": values, "imports": imported_since(before) + modules_of(model),
        # activations laid out [s, b, h] (the model says so: Megatron's)
        "sequence_first": bool(getattr(model, "sequence_first", False)),
        "routing": rec.routing.recorded, "routing_summary": rec.routing.summary(),
        "routing_added": list(rec.routing.added),
        "routing_reached": list(rec.routing.reached),
        "routing_loops": sorted(rec.routing.loops),
        "routing_differ": list(rec.routing.differ),
        "copies_written": copies,
        # what the step ends with, by value, when an expert was run on no
        # token (compared with the step as the code runs it: routing.py)
        "ends": _end_values(model, losses) if rec.routing.added or spec.get("ends") else None,
        "exchanges": rec.exchanges.sent if rec.exchanges else [],
        "unanswered": rec.exchanges.unanswered if rec.exchanges else 0,
        "skips_unrouted_experts": bool(getattr(model, "skips_unrouted_experts", False)),
        "final_buffers": final_buffers,
    }


def copies_written(rec: Recorder, model: torch.nn.Module) -> list[tuple[str, str]]:
    """The in-place writes (``p.data.clamp_()``) into a parameter object the
    rank does not hold after its step: a copy of a parameter (FSDP2's
    gathered parameter, freed after the forward and gathered again from
    the unwritten shard for the backward, the shard being what the
    optimizer steps), as (op, scope): kept with the trace; the recorder
    follows the copy's memory (``copy_memory``; docs/soundness.md, "Plans
    traced from PyTorch", 128 (a) and 134)."""
    held = {id(p) for p in model.parameters()} | {id(local_of(p)) for p in model.parameters()}
    out = []
    for ref, op, scope in rec.param_writes:
        p = ref()
        if p is None or id(p) not in held:
            out.append((op, scope))
    return out


def _end_values(model: torch.nn.Module, losses: list) -> list:
    """The rank's losses, gradients and parameters after its step, as numpy
    arrays in a fixed order (the parameters' names)."""
    out = [local_of(loss).detach().numpy().copy() for loss in losses]
    for _, p in sorted(named_parameters(model), key=lambda kv: kv[0]):
        out.append(local_of(p.detach()).numpy().copy())
        if p.grad is not None:
            out.append(local_of(p.grad).detach().numpy().copy())
    return out


def _setup(spec: dict, rank: int, cp: int, world: int) -> tuple:
    """The rank's model under its recipe (the fake process group and the
    mesh first, when parallel): the model, what runs it, what runs after
    its backward, the mesh, the values it holds before the step and the
    rank's coordinates."""
    mesh = None
    if spec["parallel"]:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        mesh = build_mesh(spec)  # the user's mesh (--mesh) or ("pp", "dp", "tp")
    torch.manual_seed(spec["seed"])
    model = load(spec["model"])(**spec["model_kwargs"])._apply(in_float64)
    if hasattr(model, "global_tokens"):
        model.global_tokens = spec["batch"] * spec["seqlen"]
    after, runner, setup = None, model, SetupCollectives()
    if spec["parallel"]:
        with setup:
            runner, after = recipe_result(model, load(spec["recipe"])(model, mesh))
            init_replicated(model)
    loaded = loaded_values(model, setup.storages())
    del setup
    coords = {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    if mesh is not None:
        coords = mesh_coords(rank, spec["pp"], spec["dp"], spec["tp"], cp)
    return model, runner, after, mesh, loaded, coords


def _batch(spec: dict, coords: dict[str, int], cp: int,
           order: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's tokens and labels: its data-parallel rows of the batch,
    its context-parallel chunk of the sequence (laid out in ``order``, a
    load balancer's, when given)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    shape = (spec["batch"], spec["seqlen"])
    tokens = torch.randint(0, spec["vocab"], shape, generator=gen)
    labels = torch.randint(0, spec["vocab"], shape, generator=gen)
    local_batch = spec["batch"] // spec["dp"] if spec["parallel"] else spec["batch"]
    rows = slice(coords["dp"] * local_batch, (coords["dp"] + 1) * local_batch)
    tokens, labels = (sequence_chunk(t[rows], coords["cp"], cp, order) for t in (tokens, labels))
    return tokens, labels


def _held(rec: Recorder, model: torch.nn.Module, spec: dict, cp: int) -> tuple[dict, dict, dict]:
    """The parameters and buffers the rank holds, as recorded values (in
    the model's order), and HSDP's shard count when a parameter is sharded
    on part of the data-parallel ranks."""
    params = {}
    layout = (spec["pp"], spec["dp"], spec["tp"], cp) if spec["parallel"] else None
    split: dict[str, int] = {}  # HSDP's shard count, when a parameter is sharded on part of dp
    for name, p in named_parameters(model):
        params[name] = (rec.new_value(local_of(p)), tuple(p.shape), dims_axes(p, layout, split))
        rec.register_storage(local_of(p), params[name][0], shard=True)
    buffers = {}
    for name, b in named_buffers(model):
        causal = (b.dtype == torch.bool and b.dim() == 2 and b.shape[0] == b.shape[1]
                  and bool((b == torch.ones_like(b).triu(1)).all()))
        buffers[name] = (rec.new_value(local_of(b)), tuple(b.shape), "causal" if causal else str(b.dtype))
        rec.mark_constant(local_of(b), buffers[name][0], buffer=True)
    return params, buffers, split


def _ends(rec: Recorder, model: torch.nn.Module, optimizer) -> tuple[dict, dict, dict]:
    """What the step ends with: each parameter's gradient, and after an
    optimizer step its updated value and its optimizer states."""
    grads = {}
    for name, p in named_parameters(model):
        g = p.grad
        grads[name] = None if g is None else final_value(rec, local_of(g))
    updates, states = {}, {}
    if optimizer is not None:
        for name, p in named_parameters(model):
            updates[name] = rec.current(local_of(p))
            # a distributed optimizer's states are flat ranges of the parameter's
            flat = getattr(optimizer, "flat_states", False)
            states[name] = {k: rec.current(local_of(t)) for k, t in optimizer.state[p].items()
                            if isinstance(t, torch.Tensor)
                            and (t.shape == p.shape or flat and t.dim() == 1)}
    return grads, updates, states


def _final_buffers(rec: Recorder, model: torch.nn.Module) -> dict[str, tuple[bool, Any]]:
    """The buffers the step updates that the model names (``final_buffers``:
    torchtitan's expert biases and token counts after its load-balancing
    hook), each as (whether it is a constant of the step, its value as a
    numpy array; a DTensor's local tensor, replicated): what every rank must
    end with as the single-device step does (``tracer/final_buffers.py``)."""
    out = {}
    held = dict(named_buffers(model))
    for name in getattr(model, "final_buffers", ()):
        b = held[name]
        if not all(p.is_replicate() for p in getattr(b, "placements", ())):
            raise ValueError(f"the buffer {name} the step updates is a DTensor of placements "
                             f"{b.placements}, not replicated: not compared")
        out[name] = (rec.current(local_of(b)) in rec.constants,
                     local_of(b).detach().cpu().numpy().copy())
    return out


def _written(updates: dict, params: dict) -> dict:
    """A rank's updates without the parameters its step left as loaded (the
    value it ends with is the loaded one): the rank does not update them,
    which the verifier's final contract reports (docs/soundness.md, "Plans
    traced from PyTorch", 86 (c)). The single-device step keeps them, and
    its lowering refuses a parameter no optimizer step wrote."""
    return {n: v for n, v in updates.items() if v != params[n][0]}


def _grad_blocks(rec: Recorder, model: torch.nn.Module) -> dict[str, list]:
    """The final gradients a recipe gives as blocks (``grad_blocks`` on a
    parameter: the tensor holding them and each block's (starts, shape),
    Megatron's distributed optimizer's flat range of the gradient): each
    block's recorded value, read after the step, with its starts."""
    out = {}
    for name, p in named_parameters(model):
        given = getattr(p, "grad_blocks", None)
        if given is None:
            continue
        base, blocks = given
        out[name] = []
        for starts, shape in blocks:
            view = base[tuple(slice(s, s + n) for s, n in zip(starts, shape))]
            out[name].append((final_value(rec, view), tuple(starts)))
    return out


def _values(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor,
            losses: list) -> dict:
    """The real values of the step (``keep_values``)."""
    return {
        "params": {n: local_of(p).detach().numpy().copy() for n, p in named_parameters(model)},
        "buffers": {n: local_of(b).detach().numpy().copy() for n, b in named_buffers(model)},
        "tokens": tokens.numpy().copy(), "labels": labels.numpy().copy(),
        "losses": [float(local_of(loss).detach()) for loss in losses],
        "grads": {n: None if p.grad is None else local_of(p.grad).detach().numpy().copy()
                  for n, p in named_parameters(model)},
    }


def _ties(model: torch.nn.Module) -> dict[str, str]:
    """Parameters the model ties (one tensor under two names): alias -> the
    name kept."""
    kept = {id(p): n for n, p in named_parameters(model)}
    return {n: kept[id(p)] for n, p in named_parameters(model, remove_duplicate=False)
            if kept.get(id(p), n) != n}


def sequence_order(model: torch.nn.Module, seqlen: int, cp: int) -> list[int] | None:
    """The single-device positions in the order ``context_parallel`` lays
    out its buffers under the recipe's load balancer, or None without one.
    A recipe names the balancer as ``model.cp_load_balancer``: a function
    of (sequence length, cp size) returning one of PyTorch's
    ``_LoadBalancer``s (``_HeadTailLoadBalancer``, ...), whose indices are
    used as ``_context_parallel_buffers`` uses them. Indices that differ
    between batch rows, or that are no permutation, are refused in one
    line."""
    make = getattr(model, "cp_load_balancer", None)
    if make is None or cp == 1:
        return None
    indices = make(seqlen, cp)._generate_indices()
    rows = {tuple(int(i) for i in row) for row in indices.reshape(-1, indices.shape[-1])}
    if len(rows) != 1:
        raise ValueError("the load balancer orders the batch rows' positions differently: "
                         "not verified (one order for every row)")
    order = list(rows.pop())
    if sorted(order) != list(range(seqlen)):
        raise ValueError(f"the load balancer's indices {order} are no order of the "
                         f"{seqlen} positions")
    return order


def sequence_chunk(rows: torch.Tensor, c: int, cp: int,
                   order: list[int] | None = None) -> torch.Tensor:
    """Context-parallel rank ``c``'s piece of ``rows`` [batch, seq]: chunk c
    of ``cp`` equal chunks of the sequence, as ``context_parallel``'s
    buffers are cut (the whole when cp is 1), of the positions laid out in
    ``order`` first when a load balancer gives one (``sequence_order``)."""
    seqlen = rows.shape[1]
    if seqlen % cp:
        raise ValueError(f"the sequence length {seqlen} is not a multiple of the "
                         f"context-parallel size {cp}")
    if order is not None:
        rows = rows[:, order]
    n = seqlen // cp
    return rows[:, c * n:(c + 1) * n].clone()


def recipe_result(model: torch.nn.Module, result: Any) -> tuple[torch.nn.Module, Any]:
    """The module a rank's step runs and what runs after its backward, from
    what a recipe returned: a wrapper of the model (``DistributedDataParallel(
    model)``, as users write ``model = DDP(model)``) is run instead of the
    model, whose parameters it holds; anything else (an ``after_backward``
    function, a ``PipelineStep``, None) is returned as it is."""
    if isinstance(result, torch.nn.Module):
        own = {id(p) for p in model.parameters()}
        if result is not model and {id(p) for p in result.parameters()} != own:
            raise ValueError("the recipe returned a module that does not hold exactly the "
                             "model's parameters")
        return result, None
    return model, result


def init_replicated(model: torch.nn.Module) -> None:
    """Build the reducer of every module under ``torch.distributed.
    _composable.replicate`` now, with the arguments ``replicate`` recorded:
    its first forward would build it inside the traced step (its buffers
    then written by ops outside the step's computation), as a
    ``DistributedDataParallel`` returned by a recipe builds it before. The
    forward's hook then finds it built and runs DDP's forward as it would."""
    from torch.distributed._composable import replicate
    from torch.distributed._composable.contract import _get_registry
    for module in model.modules():
        if "replicate" in (_get_registry(module) or {}):
            state = replicate.state(module)
            if state._init_args or state._init_kwargs:
                state.lazy_init()


def final_value(rec: Recorder, t: torch.Tensor) -> int | None:
    """The recorded value a final gradient holds. A functional collective's
    result not yet waited for (an ``AsyncCollectiveTensor``, kept as the
    local tensor of ``DTensor.from_local``) is waited for here, under the
    recorder, as the optimizer's first read of it would."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    if isinstance(t, AsyncCollectiveTensor):
        with rec:
            t = t.trigger_wait()
    return rec.current(t)


def train_context(model: torch.nn.Module):
    """The context forward and backward run in: the model's
    ``train_context()`` when a recipe set one (as torchtitan's trainer
    enters DTensor's ``loss_parallel()`` around both), else none."""
    make = getattr(model, "train_context", None)
    return make() if callable(make) else contextlib.nullcontext()


def modules_of(model: torch.nn.Module) -> list[str]:
    """The modules defining the classes of ``model``'s submodules (a
    library's model code, such as transformers' ``modeling_llama``, and what
    it imports), whether or not this process imported them just now."""
    return list(dict.fromkeys(type(m).__module__ for m in model.modules()))


#: the optimizers a step may end with: torch.optim's, their default CPU
#: implementation (for-loop), one step from zero state
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, weight_decay=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.001, weight_decay=0.1),
}


def update(model: torch.nn.Module, mesh, spec: dict):
    """Clip the gradients and take the optimizer step the spec asks for:
    on one device with torch's ``clip_grad_norm_``, on a rank with the
    spec's clipper (``clipper(model, mesh, max_norm)``; the default is
    ``backends.torch.recipes:clip_grad_norm``). A clipper that says it runs
    on one device too (``one_device = True``: Megatron's, its code at world
    size 1) clips the single-device step itself, so that both read the same
    numbers with ``.item()`` and branch on them alike (docs/soundness.md,
    "Plans traced from PyTorch", 69). A recipe that sets ``own_optimizer``
    on the model (Megatron's) steps a rank with its own optimizer code,
    ``own_optimizer(name)``, asked for the hyperparameters of ``name``
    (item 86). The optimizer (what has its ``.state``), or None."""
    if spec.get("clip"):
        clipper = load(spec.get("clipper") or "backends.torch.recipes:clip_grad_norm")
        if mesh is None and not getattr(clipper, "one_device", False):
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), spec["clip"])
        else:
            clipper(model, mesh, spec["clip"])
    name = spec.get("optimizer") or "none"
    if name == "none":
        return None
    own = getattr(model, "own_optimizer", None)
    if own is not None and (mesh is not None or getattr(own, "one_device", False)):
        # the recipe's optimizer code, for the same hyperparameters (on one
        # device too when it says so: torchtitan's load-balancing hook)
        return own(name)
    optimizer = OPTIMIZERS[name](list(model.parameters()))
    optimizer.step()
    return optimizer


def run_isolated(spec: dict, rank: int) -> dict | str:
    """``run`` in a pool worker of its own: the trace, or the last line of the
    error (a rank runs once per process: re-initializing fails)."""
    import traceback
    import warnings
    warnings.filterwarnings("ignore")
    try:
        trace = run(spec, rank)
        trace["cpu"] = time.process_time()  # this process's CPU: imports after the fork, the run
        return trace
    except StepFailed as e:
        return str(e)
    except Exception as e:  # any failure of the user's model or recipe: reported, one line
        lines = [ln for ln in traceback.format_exception_only(e)[-1].strip().splitlines()
                 if ln.strip()]
        return lines[0] if lines else type(e).__name__


def main() -> None:
    spec_path, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(spec_path) as f:
        spec = json.load(f)
    result = run(spec, rank)
    with open(out, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
