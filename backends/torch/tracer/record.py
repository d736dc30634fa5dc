"""Record what one rank executes in one training step: its local aten ops and
its collectives, as plain data.

Runs inside the rank's own process (``backends.torch.rank``). A
TorchDispatchMode sees every op: ops on DTensors and on collective wrapper
tensors are handed on (``NotImplemented``) so that the local ops they run
are seen instead; ops on fake tensors (DTensor's shape inference) are run
and not recorded. Tensors are known by identity; the registry holds weak
references only, so recording does not change when autograd frees or
accumulates a tensor.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from backends.torch.lowering.constants import GUARD_EVENT, TRACED_READ_EVENT, VALUE_READ_EVENT
from backends.torch.tracer import numbers
from backends.torch.tracer.copy_memory import WrittenCopies
from backends.torch.tracer.empty_sends import run_sending_nothing, sends_nothing
from backends.torch.tracer.exchange import BROADCAST, Exchanges
from backends.torch.tracer.hash_routing import FromIds
from backends.torch.tracer.hidden_memory import HiddenMemory, Read, is_partial_view
from backends.torch.tracer.numbers import TracedNumber, TracedNumbers
from backends.torch.tracer.placements import data_parallel_axis as data_parallel_axis
from backends.torch.tracer.placements import dims_axes as dims_axes
from backends.torch.tracer.reduce_ops import recorded_reduce_op
from backends.torch.tracer.routing import ROUTED, Routing
from backends.torch.tracer.tensor_views import (
    outputs_written,
    same_order,
    storage_of,
    tensors_in,
    view_region,
    written_tensors,
)

#: ops whose output is the input value itself (no computation).
ALIASES = {
    "aten.detach.default", "aten.alias.default", "aten.clone.default",
    "aten.lift_fresh.default", "aten.contiguous.default",
    "_c10d_functional.wait_tensor.default", "_c10d_functional._wrap_tensor_autograd.default",
}


#: aliases that are views of their input's memory (a write into one writes the other)
SAME_MEMORY = {"aten.detach.default", "aten.alias.default"}


#: ops whose value depends on their tensor arguments' shapes only: of integer
#: ids (``torch.zeros_like(tokens)``, token types) they make a constant
SHAPE_ONLY = {
    "aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default",
    "aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default",
}
#: writes of a number at an index (``mask.scatter_(1, idx, 1)``): of a
#: tensor made by a ``SHAPE_ONLY`` op at a constant index, a constant
SCATTER_FILLS = {"aten.scatter_.value", "aten.scatter.value"}

#: constants up to this many elements keep their value (masks, positions, tables)
CONSTANT_NUMEL = 1 << 16



def host_values(t: torch.Tensor) -> Any:
    """``t``'s values as a numpy array; a bfloat16 tensor's in float32
    (numpy has no bfloat16; every bfloat16 value is a float32 value)."""
    host = t.detach().cpu().resolve_conj()
    return (host.float() if host.dtype == torch.bfloat16 else host).numpy().copy()

class Recorder(TorchDispatchMode):
    """Records events ``(op, args, outputs, shapes, scope, group, mb)``.

    ``args`` mirrors the op's positional and keyword arguments with each
    tensor replaced by ``("v", value id)``; ``outputs`` are value ids.
    """

    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker = tracker
        self.refs: dict[int, tuple[int, weakref.ref, int]] = {}
        self.memory = HiddenMemory()  # buffers allocated before recording (DDP's buckets)
        self.shapes: list[tuple[int, ...]] = []
        self.events: list[tuple] = []
        self.consts: dict[int, Any] = {}
        #: memory of a parameter or a view of one -> (value, the storage held):
        #: the storage is held so that its memory is not given to another tensor
        #: while the entry stands (``storage_view``)
        self.storages: dict[tuple[int, int, int], tuple[int, torch.UntypedStorage]] = {}
        #: the keys of ``storages`` that are the memory of a shard the rank holds
        self.shard_keys: set[tuple[int, int, int]] = set()
        #: a shard's memory -> (value, numel, the storage held)
        self.shard_starts: dict[tuple[int, int], tuple[int, int, torch.UntypedStorage]] = {}
        self.constants: set[int] = set()  # values that depend on no parameter, data or collective
        self.shape_only: set[int] = set()  # SHAPE_ONLY results of computed tensors (zeros_like(x))
        self.constvals: dict[int, Any] = {}  # their values (numpy), when small
        #: the recorded values of small integer and boolean tensors computed from
        #: the data (counts and masks of the ids): what a comparison of them held
        self.int_values: dict[int, Any] = {}
        self.from_buffer: set[int] = set()  # constants computed from a module's buffer
        #: values a SHAPE_ONLY op made (a fill of a shape, of any dtype)
        self.fills: set[int] = set()
        self.const_storages: set[int] = set()  # memory of the constants whose value is kept
        self.tainted: set[int] = set()  # of that memory, what a non-constant op wrote
        self.mb = -1  # the microbatch a pipeline schedule is running, -1 outside one
        # per storage, the value each bound view of it (offset, shape, strides) holds, until
        # an op writes into the storage: a tensor whose ``.data`` was reassigned (no op
        # runs) is the value its new memory holds
        self.by_memory: dict[int, dict[tuple, int]] = {}
        self.routing: Routing | None = None  # top-k routing recorded or replayed (routing.py)
        self.exchanges: Exchanges | None = None  # all-to-alls of constants answered (exchange.py)
        self.answers: dict[int, float] = {}  # a broadcast's output -> the root's number written
        #: a same-region view -> the tensor it views (``DTensor.to_local()`` of a
        #: gradient): an in-place write into either writes both
        self.twins: dict[int, weakref.ref] = {}
        #: parameters written in place through an alias of their memory
        #: (``.data``): (the parameter, the op, the scope), checked by the rank
        #: against the parameters it holds (``rank.copies_written``)
        self.param_writes: list[tuple[weakref.ref, str, str]] = []
        #: the parameters (and their local tensors) the rank holds, set by the
        #: rank before its step; None: every parameter is the rank's own
        self.held: set[int] | None = None
        #: storages of parameter copies written in place (FSDP2's gathered
        #: parameter): a later write into one is followed into the tensors
        #: bound to its memory before (``copy_memory``)
        self.copies = WrittenCopies()
        #: integer values computed from the batch's ids alone (``hash_routing``)
        self.from_ids = FromIds()

    # -- values ---------------------------------------------------------------
    def new_value(self, t: torch.Tensor) -> int:
        v = len(self.shapes)
        self.shapes.append(tuple(t.shape))
        self.bind(t, v)
        return v

    def bind(self, t: torch.Tensor, v: int) -> None:
        self.refs[id(t)] = (v, weakref.ref(t), self.memory.generation(t))
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel() > 1:
            self.by_memory.setdefault(storage_of(t), {})[_view_key(t)] = v

    def written(self, t: torch.Tensor, v: int) -> None:
        """``t``'s memory written by an op: of its storage's views, only ``t``'s
        value is known."""
        self.by_memory[storage_of(t)] = {_view_key(t): v}

    def reassigned(self, t: torch.Tensor, v: int) -> int | None:
        """The value of ``t``, bound to ``v`` of another shape: its ``.data``
        was reassigned (Megatron's ``make_viewless_tensor``: an ``empty`` whose
        data becomes another tensor's); the value the same view of its memory
        was last bound to with no write since, or None."""
        found = self.by_memory.get(storage_of(t), {}).get(_view_key(t))
        if found is None or self.shapes[found] != tuple(t.shape):
            return None
        self.bind(t, found)
        return found

    def value(self, t: torch.Tensor) -> int | None:
        """The value ``t`` holds; None when unknown, or when ``t`` is memory
        tracked by ``self.memory`` written since ``t`` was bound."""
        entry = self.refs.get(id(t))
        if entry is None or entry[1]() is not t:
            return None
        if self.memory and entry[2] != self.memory.generation(t):
            return None
        return entry[0]

    def current(self, t: torch.Tensor) -> int | None:
        """The value ``t`` holds now: as bound, or read from tracked memory."""
        v = self.value(t)
        return v if v is not None else self.from_memory(t)

    def from_memory(self, t: torch.Tensor) -> int | None:
        """``t`` read from tracked memory (``HiddenMemory``): the value of
        the region it is, or a new value recorded as a slice of a region
        (``mem.slice``) or the concatenation of regions (``mem.cat``)."""
        read = self.memory.read(t) if self.memory else None
        if read is None:
            return None
        if read.kind == "same" and self.shapes[read.values[0]] == tuple(t.shape):
            self.bind(t, read.values[0])
            return read.values[0]
        if read.kind == "cuts":  # regions cut at the ends: each part a flat slice first
            parts = []
            for value, offset, numel in read.cuts:
                part = len(self.shapes)
                self.shapes.append((numel,))
                self.events.append(("mem.slice", [[("v", value), offset, [numel]], {}], [part],
                                    [(numel,)], self.scope(), None, self.mb))
                parts.append(part)
            read = Read("cat", tuple(parts))
        v = self.new_value(t)
        op, args = "mem.cat", [[("v", x) for x in read.values], list(t.shape)]
        if read.kind != "cat":  # a slice, or the region seen with another shape
            op, args = "mem.slice", [("v", read.values[0]), read.offset, list(t.shape)]
        self.events.append((op, [args, {}], [v], [tuple(t.shape)], self.scope(), None, self.mb))
        return v

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            v = self.current(a)
            if v is not None and self.shapes[v] != tuple(a.shape):
                v = self.reassigned(a, v)
            if v is None and a.numel() > 0:
                v = self.storage_view(a)
            if v is None:
                v = self.new_value(a)
                if a.numel() <= 1 and a.dtype != torch.bool and not a.is_complex():
                    self.consts[v] = float(a.item()) if a.numel() else 0.0
                    self.mark_constant(a, v)
                elif not (a.is_floating_point() or a.is_complex() or a.requires_grad) \
                        and a.numel() <= CONSTANT_NUMEL:
                    # integers or booleans made from Python numbers
                    # (``torch.tensor(list(range(n))[::-1])``): a reading of a
                    # computed tensor's value on the way is recorded and refused
                    # (``ValueReads``), so these are the same in every run
                    self.mark_constant(a, v)
                self.events.append(("unknown", [[], {}], [v], [tuple(a.shape)], self.scope(),
                                    None, self.mb))
            return ("v", v)
        if isinstance(a, (list, tuple)):
            return [self.arg(x) for x in a]
        if isinstance(a, (bool, int, float, str)) or a is None:
            return a
        if isinstance(a, torch.dtype):
            return str(a)
        if isinstance(a, torch.distributed.ProcessGroup):
            return ("pg", group_ranks(a))
        if isinstance(a, torch.ScriptObject):
            kind = a._type().qualified_name()
            if kind.endswith("c10d.ProcessGroup"):
                return ("pg", group_ranks(torch.distributed.ProcessGroup.unbox(a)))
            if kind.endswith("c10d.ReduceOp"):
                return recorded_reduce_op(int(a.op()))
            return "script-object"
        return repr(a)

    def register_storage(self, t: torch.Tensor, v: int, shard: bool = False) -> None:
        """Remember a tensor's storage: FSDP reads a parameter through other
        tensor objects (flat views of the same memory). For a parameter's
        local ``shard`` also where it starts: FSDP2 pads a shard of a dim the
        group size does not divide to its full chunk (an empty shard is all
        padding), and its all-gather reads the shard with its padding."""
        storage = t.untyped_storage()
        self.storages[(storage.data_ptr(), t.storage_offset(), t.numel())] = (v, storage)
        if shard:
            self.shard_starts[(storage.data_ptr(), t.storage_offset())] = (v, t.numel(), storage)
            self.shard_keys.add((storage.data_ptr(), t.storage_offset(), t.numel()))

    def shard_written(self, o: torch.Tensor, v: int) -> None:
        """An op wrote ``o`` in place, exactly the memory of a shard the
        rank holds (``register_storage(shard=True)``; a clamp under
        ``torch.no_grad()`` of the parameter FSDP2 shards): the tensor
        objects that read that memory later through the registry (FSDP2's
        flat ``_sharded_param_data``, which its all-gathers read) read the
        written value (docs/soundness.md, "Plans traced from PyTorch", 134)."""
        if not o.is_contiguous():
            return
        storage = o.untyped_storage()
        key = (storage.data_ptr(), o.storage_offset(), o.numel())
        if key in self.shard_keys:
            self.storages[key] = (v, storage)
            self.shard_starts[key[:2]] = (v, o.numel(), storage)

    def storage_view(self, t: torch.Tensor) -> int | None:
        """The value of a tensor that is registered memory seen through
        another tensor object. An entry counts only while its storage still
        has the address it was registered at: the entry holds the storage, so
        the memory cannot pass to another tensor unless the storage itself
        gives it up (FSDP2 frees an unsharded parameter by resizing its
        storage to nothing), and then its address has moved. Without that
        check, a freed parameter's address reused by an unrelated tensor (an
        optimizer's step count) would be read as the parameter."""
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        entry = self.storages.get(key)
        src = entry[0] if entry is not None and entry[1].data_ptr() == key[0] else None
        if not t.is_contiguous():
            return None
        op = "aten.view.default"
        if src is None:
            # a parameter's shard read with FSDP2's padding rows after it:
            # recorded as that (the padding's values are not recorded; no
            # lowering reads them)
            shard = self.shard_starts.get(key[:2])
            if shard is None or shard[1] >= t.numel() or shard[2].data_ptr() != key[0]:
                return None
            src, op = shard[0], "fsdp.padded_shard"
        v = self.new_value(t)
        self.events.append((op, [[("v", src), list(t.shape)], {}], [v],
                            [tuple(t.shape)], self.scope(), None, self.mb))
        if op == "aten.view.default":
            for held, ref, _ in list(self.refs.values()):
                a = ref() if held == src else None
                if a is not None and a is not t:
                    self.note_twins(op, [a], [t], [v])
        return v

    def mark_constant(self, t: torch.Tensor, v: int, buffer: bool = False) -> None:
        """``t`` (value ``v``) is the same in every run: keep its value when
        small; ``buffer``: a module's buffer, or computed from one."""
        self.constants.add(v)
        if buffer:
            self.from_buffer.add(v)
        if t.numel() <= CONSTANT_NUMEL:
            self.constvals[v] = host_values(t)
            self.const_storages.add(storage_of(t))

    def refresh_constants(self, tensors: list[torch.Tensor]) -> None:
        """A constant written in place through a view (``mask[:, 0] = 0.5``)
        holds another value than the one kept: it becomes a new value, a
        constant with its current contents when only constant ops wrote its
        memory, else a value of unknown origin (which no lowering reads)."""
        for t in tensors:
            v = self.value(t)
            kept = self.constvals.get(v) if v is not None else None
            if kept is None or t.is_complex() or np.array_equal(host_values(t), kept):
                continue
            fresh = self.new_value(t)
            if storage_of(t) not in self.tainted:
                self.mark_constant(t, fresh)
            self.events.append(("unknown", [[], {}], [fresh], [tuple(t.shape)], self.scope(),
                                None, self.mb))

    def is_constant_op(self, name: str, tensors: list[torch.Tensor], kwargs: dict | None = None) -> bool:
        """An op whose tensor arguments (``tensors``) are all constants (or
        that has none) computes a constant, unless it communicates or leaves
        memory unset."""
        if name == "c10d.broadcast_.default":  # equal on every member (buckets)
            return all(self.value(a) in self.constants for a in tensors)
        if name.startswith(("c10d", "_c10d_functional", "fsdp")) or "empty" in name:
            return False
        if name in SHAPE_ONLY and not any(a.is_floating_point() or a.is_complex() for a in tensors):
            return True
        dtype = (kwargs or {}).get("dtype")
        if name in SHAPE_ONLY and dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            return True  # zeros_like(scores, dtype=torch.bool): a mask to fill, of the shape only
        if name in SCATTER_FILLS and tensors and self.value(tensors[0]) in self.shape_only \
                and all(self.value(a) in self.constants for a in tensors[1:]):
            # zeros_like(group_scores).scatter_(1, group_idx, 1): every element
            # the fill of a shape, or the number written at a recorded index
            return True
        if name == "aten._to_copy.default" and tensors and self.value(tensors[0]) in self.fills \
                and dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            return True  # zeros_like(scores).int(): the same mask to fill, cast after
        return all(self.value(a) in self.constants for a in tensors)

    def mark_partial_writes(self, name: str, func, args, kwargs) -> None:
        """An op writing in place into part of a tensor (``y[:, 0] = 0``
        writes through a view of ``y``) changes the tensor without an op
        that produces it: from then on it is a new value made by a
        ``partial_write`` event, which the lowering refuses. A constant's
        new contents are read by value instead (``refresh_constants``)."""
        if not name.startswith("aten."):
            return
        for t in written_tensors(func, args, kwargs):
            base = t._base
            if base is None or base.numel() == t.numel() and same_order(base, t):
                continue
            if self.memory and self.memory.tracks(storage_of(t)):
                continue  # memory whose regions the recorder follows (``record_writes``)
            b = self.value(base)
            if b is None or b in self.constants and not self.ids_into_constant(base, t, args):
                continue
            written = self.value(t)
            block = view_region(base, t)
            fresh = self.new_value(base)
            self.events.append(("partial_write", [[("v", b), name, block,
                                                   None if written is None else ("v", written)], {}],
                                [fresh], [tuple(base.shape)], self.scope(), None, self.mb))

    def ids_into_constant(self, base: torch.Tensor, t: torch.Tensor, args) -> bool:
        """Integers computed from the batch (not constants) written into a
        block of a constant integer tensor (ProphetNet's n-gram labels, the
        labels copied into each block of a tensor filled with the ignore
        index): a ``partial_write`` the lowering reads as the constant's
        one-hot rows with the block replaced, where the constant's new
        contents would be a value of unknown origin."""
        if base.is_floating_point() or base.is_complex() or t.is_floating_point() \
                or t.is_complex():
            return False
        sources = [a for a in args[1:] if isinstance(a, torch.Tensor)]
        return bool(sources) and all(self.value(a) is not None
                                     and self.value(a) not in self.constants for a in sources)

    def set_mb(self, mb: int) -> None:
        self.mb = mb

    def scope(self) -> str:
        names = sorted(p for p in self.tracker.parents if p != "Global")
        name = max(names, key=len) if names else ""
        return ("bw:" if self.tracker.is_bw else "") + name

    # -- dispatch -------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if any(isinstance(a, FakeTensor) for a in tensors):
            return func(*args, **kwargs)
        if any(isinstance(a, DTensor) or (type(a) is not torch.Tensor
                                          and type(a) is not torch.nn.Parameter)
               for a in tensors):
            return NotImplemented
        name = str(func)
        unseen = {id(a) for a in tensors if self.value(a) is None}
        self.refresh_constants(tensors)
        # the arguments first seen here are given their values (and judged
        # constant or not) before the op is: an op is a constant by its
        # arguments, whichever op reads a tensor first (docs/soundness.md,
        # "Plans traced from PyTorch", 82)
        in_args = [self.arg(a) for a in args]
        in_kwargs = {k: self.arg(v) for k, v in kwargs.items()}
        constant = self.is_constant_op(name, tensors, kwargs)
        buffer = constant and any(self.value(a) in self.from_buffer for a in tensors)
        if sends_nothing(name, args):  # the fake group cannot run it (empty_sends.py)
            out = run_sending_nothing(func, name, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.routing is not None and name in ROUTED:
            out = self.routing.call(func, args, kwargs, out)
        if self.routing is not None and constant:
            out = self.routing.hits(name, args, out)
        answer = None
        if self.exchanges is not None and self.exchanges.handles(name):
            x = self.exchanges.input_of(name, args)
            if name in BROADCAST and x is not None:  # a number: the root's (exchange.py)
                root_constant = self.exchanges.broadcast(name, args, self.value(x) in self.constants,
                                                         self.group_of)
                if root_constant is not None:
                    constant = constant and root_constant
                    answer = self.exchanges.answered[-1]
            elif x is not None and self.value(x) in self.constants:  # token counts: answered
                constant = self.exchanges.call(name, args, kwargs, out, self.group_of)
        if name.startswith("c10d."):
            out = with_completed_work(out)
        outs = outputs_written(name, args, kwargs, out, func)
        group = None
        if name.startswith("_c10d_functional.") and "group_name" in func._schema.arguments[-1].name:
            group = group_from_name(args[-1] if isinstance(args[-1], str) else kwargs.get("group_name"))
        if name in ALIASES and len(outs) == 1 and in_args and in_args[0][0] == "v":
            self.bind(outs[0], in_args[0][1])
            if name in SAME_MEMORY and isinstance(args[0], torch.Tensor):
                # ``g.detach()``: the same memory, so an in-place write into
                # either (Megatron's clipping writes the detached gradient)
                # writes both
                self.note_twins("aten.view.default", args, outs, [])
            return out
        ids = [self.new_value(o) for o in outs]
        if answer is not None and ids:
            self.answers[ids[0]] = answer  # the number a broadcast wrote (count_scales)
        if name in SHAPE_ONLY:
            self.fills.update(ids)
        for o, v in zip(outs, ids):
            if o._base is None or any(o is a for a in tensors):
                self.written(o, v)  # written in place, or new memory
            if self.shard_keys and any(o is a for a in tensors):
                self.shard_written(o, v)
        self.record_writes(outs, ids, {id(a) for a in tensors}, unseen)
        if not constant and self.from_ids.is_lookup(name, args, outs, self.value, self.constants,
                                                          self.from_buffer):
            constant = True  # a hash router's experts: recorded data of the step (hash_routing)
            if self.routing is not None:
                self.routing.lookup(args[0], outs[0], self.scope())
        elif not constant:
            self.from_ids.note(name, tensors, outs, ids, self.value, self.constants)
        if not constant:
            self.tainted.update(s for s in map(storage_of, outs) if s in self.const_storages)
        if constant:
            for o, v in zip(outs, ids):
                self.mark_constant(o, v, buffer)
        else:
            for o, v in zip(outs, ids):
                if type(o) is torch.Tensor and not (o.is_floating_point() or o.is_complex()) \
                        and o.numel() <= CONSTANT_NUMEL and o.device.type == "cpu" \
                        and o.layout == torch.strided:
                    self.int_values[v] = o.detach().numpy().copy()
        if not constant and name in SHAPE_ONLY:
            self.shape_only.update(ids)
        if self.routing is not None and name in ROUTED:
            self.mark_constant(outs[1], ids[1])  # the routing: recorded data of the step
        if name == "aten.as_strided.default":
            for o, v in zip(outs, ids):
                self.register_storage(o, v)
            if outs and isinstance(args[0], torch.Tensor):
                # where the view lies in its input, when a block of it (the
                # offset argument counts from the memory's start, not the input's)
                in_kwargs["block"] = view_region(args[0], outs[0])
        self.events.append((name, [in_args, in_kwargs], ids, [tuple(o.shape) for o in outs],
                            self.scope(), group, self.mb))
        self.mark_partial_writes(name, func, args, kwargs)
        self.note_twins(name, args, outs, ids)
        self.write_whole_bases(outs, ids)
        if self.copies and ids:
            self.rewrite_copies(outs, ids, {id(a) for a in tensors})
        return out

    def rewrite_copies(self, outs: list[torch.Tensor], ids: list[int], inputs: set[int]) -> None:
        """An op wrote (in place or through ``out=``) into the memory of a
        parameter's copy written in place before (FSDP2's all-gather into
        the gathered parameter's buffer again, for the backward): every
        tensor bound to that memory before the op (the copy, the views
        autograd saved of it) now holds the view of the written value it
        is, recorded as that strided view, or, lying only partly inside
        the write, a value no lowering reads (docs/soundness.md, "Plans
        traced from PyTorch", 134)."""
        first = ids[0]
        for o, v in zip(outs, ids):
            if id(o) not in inputs or not self.copies.holds(o):
                continue
            bound, was = [], {}
            for held, ref, _ in list(self.refs.values()):
                t = ref()
                if t is not None and held < first and type(t) in (torch.Tensor, torch.nn.Parameter):
                    bound.append(t)
                    was[id(t)] = held
            hits = self.copies.reached(o, bound)
            # each view is recorded at the module that made it (its forward's
            # scope), where the single-device step reads the copy's value
            made_at = {w: e[4] for e in self.events for w in e[2]} if hits else {}
            flat = None
            for hit in hits:
                t = hit.tensor
                at = made_at.get(was[id(t)], self.scope())
                if hit.view is None:
                    stale = self.new_value(t)
                    self.events.append(("fsdp.stale_copy", [[("v", v)], {}], [stale],
                                        [tuple(t.shape)], at, None, self.mb))
                    continue
                if flat is None:
                    flat = len(self.shapes)
                    self.shapes.append((o.numel(),))
                    self.events.append(("aten.view.default", [[("v", v), [o.numel()]], {}],
                                        [flat], [(o.numel(),)], self.scope(), None, self.mb))
                shape, stride, offset, block = hit.view
                fresh = self.new_value(t)
                self.events.append(("aten.as_strided.default",
                                    [[("v", flat), shape, stride, offset], {"block": block}],
                                    [fresh], [tuple(shape)], at, None, self.mb))

    def write_whole_bases(self, outs: list[torch.Tensor], ids: list[int]) -> None:
        """A write through a view of a whole buffer, in its memory order,
        writes the buffer (another order: a partial write): the buffer's
        new value recorded as a view of the written one."""
        for o, v in zip(outs, ids):
            base = o._base
            if base is not None and base.numel() == o.numel() and self.value(base) is not None \
                    and same_order(base, o):
                b = self.new_value(base)
                if v in self.constants:
                    self.mark_constant(base, b, v in self.from_buffer)
                self.events.append(("aten.view.default", [[("v", v), list(base.shape)], {}],
                                    [b], [tuple(base.shape)], self.scope(), None, self.mb))

    @staticmethod
    def group_of(group: Any) -> tuple[int, ...]:
        """A collective's members, from its group's name or its group (boxed
        as a script object when a c10d op reads it)."""
        if isinstance(group, torch.ScriptObject):
            group = torch.distributed.ProcessGroup.unbox(group)
        return group_from_name(group) if isinstance(group, str) else group_ranks(group)

    def note_twins(self, name: str, args, outs: list[torch.Tensor], ids: list[int]) -> None:
        """A view of exactly the memory of its input, with its shape and
        strides (``DTensor.to_local()`` of a gradient FSDP2 keeps in a
        larger buffer), is remembered with it; an in-place write into one
        of the two (clipping's ``mul_``) gives the other the new value too,
        since both read the same memory."""
        if name == "aten.view.default" and len(outs) == 1 and isinstance(args[0], torch.Tensor):
            a, o = args[0], outs[0]
            if (storage_of(a), a.storage_offset(), a.shape, a.stride()) == \
                    (storage_of(o), o.storage_offset(), o.shape, o.stride()):
                self.twins[id(o)] = weakref.ref(a)
                self.twins[id(a)] = weakref.ref(o)
            return
        if not name.startswith("aten.") or not name.split(".")[1].endswith("_"):
            return
        for o, v in zip(outs, ids):
            ref = self.twins.get(id(o))
            twin = ref() if ref is not None else None
            if twin is not None and self.value(twin) is not None and \
                    (storage_of(twin), twin.storage_offset(), twin.shape) == \
                    (storage_of(o), o.storage_offset(), o.shape):
                self.bind(twin, v)
                if isinstance(twin, torch.nn.Parameter):  # ``p.data.clamp_()``: p written
                    self.param_writes.append((weakref.ref(twin), name, self.scope()))
                    if self.held is not None and id(twin) not in self.held:
                        self.copies.mark(o)  # a copy of the parameter (FSDP2's gathered one)

    def record_writes(self, outs: list[torch.Tensor], ids: list[int], inputs: set[int],
                      unseen: set[int]) -> None:
        """Outputs written in place (or through ``out=``) into memory that
        ``self.memory`` tracks, or into part of a larger memory through a view
        no recorded op made (a C++ buffer): the memory now holds them."""
        for o, v in zip(outs, ids):
            if id(o) not in inputs or not o.is_contiguous():
                continue
            tracked = self.memory and self.memory.tracks(storage_of(o))
            if tracked or (id(o) in unseen and is_partial_view(o)):
                # what a partial overwrite of a region leaves: slices of its value
                kept = []
                for region, start, numel in self.memory.remainders(o) if tracked else []:
                    part = len(self.shapes)
                    self.shapes.append((numel,))
                    self.events.append(("mem.slice", [[("v", region.value), start - region.start,
                                                       [numel]], {}], [part], [(numel,)],
                                        self.scope(), None, self.mb))
                    kept.append((start, numel, part))
                self.memory.write(o, v)
                for start, numel, part in kept:
                    self.memory.keep(o, start, numel, part)
                self.bind(o, v)


def _view_key(t: torch.Tensor) -> tuple:
    return (t.storage_offset(), tuple(t.shape), t.stride())


def with_completed_work(out: Any) -> Any:
    """A c10d op's ``(tensors, work)`` with the fake group's work, whose
    future holds no value, replaced by a completed one holding the tensors,
    as a real group's does: DDP's reducer and comm hooks read the reduced
    bucket from that future (``fut.value()[0]``)."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list)
            and isinstance(out[1], torch.ScriptObject)):
        return out
    from torch._C._distributed_c10d import _create_work_from_future
    future = torch.futures.Future()
    future.set_result(out[0])
    return out[0], _create_work_from_future(future).boxed()


class Tracker(ModuleTracker):
    """PyTorch's module tracker, except that a module's backward is not
    marked as left at its leaf inputs (a pipeline stage's received
    activation): the hook that would mark it fails under ``autograd.grad``
    with such inputs, which zero-bubble schedules run to split the backward
    into input and weight gradients. Only scope names depend on it."""

    def _fw_pre_hook(self, mod, input) -> None:
        leaves = tuple(a for a in tree_flatten(input)[0]
                       if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is None)
        if not leaves:
            super()._fw_pre_hook(mod, input)
            return
        name = self._get_mod_name(mod)
        self._get_append_fn(name, False)()


def group_from_name(name: str) -> tuple[int, ...]:
    from torch._C._distributed_c10d import _resolve_process_group
    return group_ranks(_resolve_process_group(name))


def group_ranks(pg: Any) -> tuple[int, ...]:
    """The members of a process group, given as one or as the boxed group a
    c10d op receives."""
    import torch.distributed as dist
    if isinstance(pg, torch.ScriptObject):
        pg = dist.ProcessGroup.unbox(pg)
    return tuple(dist.get_process_group_ranks(pg))


#: Python-level reads of a tensor's values that dispatch no aten op
VALUE_READ_METHODS = ("tolist", "numpy", "__array__")


class ValueReads(TorchFunctionMode):
    """Records ``t.tolist()``, ``t.numpy()`` and ``np.asarray(t)`` as events
    reading t: they hand its values to Python without an aten op (unlike
    ``.item()``, which is ``_local_scalar_dense``), so the dispatch mode
    never sees them, and a branch on such a value would go unseen."""

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in VALUE_READ_METHODS and args \
                and isinstance(args[0], torch.Tensor):
            t = args[0]
            v = self.rec.current(local_of(t)) if not isinstance(t, FakeTensor) else None
            if v is not None:
                self.rec.events.append((VALUE_READ_EVENT, [[("v", v)], {}], [], [],
                                        self.rec.scope(), None, self.rec.mb))
        return func(*args, **(kwargs or {}))


def traced_numbers(rec: Recorder) -> TracedNumbers:
    """The mode keeping ``.item()`` of a traced tensor traced (``tracer.numbers``);
    each comparison of such a number is recorded as a guard event reading it."""
    def traced(t: torch.Tensor) -> bool:
        """A computed value's number is traced; a constant's (of shapes and the
        batch's ids only) is a fact of the step and stays a plain float."""
        if isinstance(t, FakeTensor):
            return False
        v = rec.current(local_of(t))
        return v is not None and v not in rec.constants

    def read(t: torch.Tensor) -> float:
        value = t.item()
        last = rec.events[-1] if rec.events else None
        if last is not None and last[0] == "aten._local_scalar_dense.default":
            # the number stays traced: its uses are ops on ``t``, not a read
            rec.events[-1] = (TRACED_READ_EVENT, *last[1:])
        return value

    def guard(number: TracedNumber, name: str, other: Any, taken: bool) -> None:
        v = rec.current(number.tensor)
        rec.events.append((GUARD_EVENT, [[("v", v), name, float(other), taken,
                                          _comparing_code()], {}], [], [],
                           rec.scope(), None, rec.mb))

    return TracedNumbers(traced, read, guard)


def _comparing_code() -> str:
    """The function and line that compared a traced number (the guard's
    caller, past ``TracedNumber``'s comparison methods): how a report names
    the branch."""
    frame = sys._getframe(2)  # the caller of the guard callback: TracedNumber's methods
    while frame is not None and frame.f_code.co_filename == numbers.__file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    short = path.split("site-packages/", 1)[-1] if "site-packages/" in path else Path(path).name
    return f"{frame.f_code.co_name} ({short}:{frame.f_lineno})"


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
