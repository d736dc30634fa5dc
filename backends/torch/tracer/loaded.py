"""What a rank holds before its step: every parameter's local shard and
every buffer, as numpy arrays, for ``check.check_loaded``.

A value a collective wrote while the recipe ran (DTensor's
``distribute_tensor`` scatters each piece from rank 0, DDP broadcasts the
module's state) is what the fake process group made up, not what a real
group delivers: it is kept as None, and its claim rests on the library's
collective instead (docs/soundness.md, "Plans traced from PyTorch", 28).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from backends.torch.tracer.record import local_of
from backends.torch.tracer.tensor_views import tensors_in
from backends.torch.tracer.wrapper_names import named_buffers, named_parameters

#: the tensor types whose values are the rank's own memory
PLAIN = (torch.Tensor, torch.nn.Parameter)


class SetupCollectives(TorchDispatchMode):
    """Remembers the memory collectives read or write while it is active,
    and the memory of every op's output computed from such memory (FSDP2
    sharding a parameter that DTensor scattered copies what the fake group
    made up). It holds the tensors, so that no other tensor takes their
    memory meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.touched: list[torch.Tensor] = []
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if any(type(t) not in PLAIN and not isinstance(t, FakeTensor) for t in tensors):
            return NotImplemented  # a DTensor's op: its local ops come back here
        out = func(*args, **kwargs)
        plain = [t for t in tensors if type(t) in PLAIN]
        if str(func).startswith(("c10d.", "_c10d_functional.")):
            self.add(plain + [t for t in tensors_in(out) if type(t) in PLAIN])
        if any(_storage(t) in self.seen for t in plain):
            self.add([t for t in tensors_in(out) if type(t) in PLAIN])
        return out

    def add(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.touched.append(t)
            self.seen.add(_storage(t))
        self.seen.discard(0)  # no memory (an empty tensor)

    def storages(self) -> set[int]:
        return set(self.seen)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def loaded_values(model: torch.nn.Module, faked: set[int]) -> dict[str, dict]:
    """Each parameter's and buffer's local values, None for one whose memory
    a setup collective touched (``faked``: storage addresses)."""
    def value(t: torch.Tensor):
        local = local_of(t).detach()
        if local.numel() and local.untyped_storage().data_ptr() in faked:
            return None
        return local.numpy().copy()
    return {"params": {n: value(p) for n, p in named_parameters(model)},
            "buffers": {n: value(b) for n, b in named_buffers(model)}}
