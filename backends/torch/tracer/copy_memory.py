"""The memory of a parameter's copy that the step wrote in place.

FSDP2 runs a module's forward on a gathered copy of each parameter (a
plain tensor over a buffer it all-gathers the shards into), frees that
buffer's memory after the forward and all-gathers the shards into it again
for the backward. A step that writes the copy in place (Gemma 3n's AltUp
clamps ``prediction_coefs.weight.data``) changes the copy only: the shard,
which the optimizer steps and which every later all-gather reads, keeps its
values. The tensors autograd saved in the forward (``t(weight)`` for the
backward's product) are views of the buffer, so the backward reads whatever
the buffer holds then: the shards gathered again, not the written copy.

The recorder knows tensors by identity and keeps the value each was bound
to; memory written later is invisible to such a binding. ``WrittenCopies``
remembers the storages of the copies written in place, and for an op that
writes into one of them (the all-gather's copy-out of the backward, or a
further in-place op), says which earlier-bound tensors of that storage the
write reaches, and how each is read from the written value: a strided view
of it (``Rebind.view``), or no known value when the tensor lies only partly
inside the write (docs/soundness.md, "Plans traced from PyTorch", 134).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from backends.torch.tracer.tensor_views import view_region


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage itself (not its address: FSDP2 frees
    a gathered buffer by resizing its storage to nothing and allocates it
    again for the backward, at another address)."""
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class Rebind:
    """An earlier-bound tensor that a write reached: ``view`` is the view's
    ``(shape, strides, offset, block)`` in the written tensor seen flat
    (``offset`` counted from the written tensor's first element, ``block``
    its region as ``tensor_views.view_region`` gives it), None when the
    tensor lies only partly inside the write (its contents are then known
    to no value)."""
    tensor: torch.Tensor
    view: tuple[list[int], list[int], int, tuple] | None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The first element of ``t``'s storage that ``t`` reads, and one past
    its last."""
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.storage_offset(), last + 1


class WrittenCopies:
    """Storages of parameter copies written in place, held (so that their
    identity is not given to other memory while recorded)."""

    def __init__(self) -> None:
        self.storages: dict[int, torch.UntypedStorage] = {}

    def __bool__(self) -> bool:
        return bool(self.storages)

    def mark(self, t: torch.Tensor) -> None:
        """``t`` is a parameter's copy, just written in place."""
        storage = t.untyped_storage()
        self.storages[storage._cdata] = storage

    def holds(self, t: torch.Tensor) -> bool:
        return bool(self.storages) and storage_key(t) in self.storages

    def reached(self, written: torch.Tensor, bound: Iterable[torch.Tensor]) -> list[Rebind]:
        """Of the tensors ``bound`` (bound to values before ``written`` was
        written), those of the same storage whose elements the write
        reaches, each with how it reads the written value."""
        key, numel = storage_key(written), written.numel()
        lo, hi = written.storage_offset(), written.storage_offset() + numel
        flat = written.detach().reshape(-1) if written.is_contiguous() else None
        out = []
        for t in bound:
            if t is written or t.numel() == 0 or storage_key(t) != key:
                continue
            start, end = _extent(t)
            if end <= lo or start >= hi:
                continue  # memory the write left as it was
            if flat is None or start < lo or end > hi:
                out.append(Rebind(t, None))
                continue
            region = view_region(flat, t)
            out.append(Rebind(t, None if region is None else
                              (list(t.shape), list(t.stride()), start - lo, region)))
        return out
