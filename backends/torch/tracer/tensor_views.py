"""Tensors as the recorder sees them: the tensors in an op's arguments,
those it writes, and where a view lies in its base's storage (its region:
offsets and steps per dim), which the recorder registers writes and reads by.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (nested lists, tuples and
    dicts), in order: what ``tree_flatten`` would find, without its cost on
    every op."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors_in(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in tensors_in(item)]
    return []


def written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        given = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        out.extend(tensors_in(given))
    return out


def view_region(base: torch.Tensor, view: torch.Tensor) -> tuple[list[int], list[list[int]]] | None:
    """Where a view lies in its base, as the shape the base is read with (its
    own when contiguous; for a flat buffer, the contiguous shape whose
    strides are the view's) and ``[start, length, kept, step]`` per dim of
    that shape: the view holds the indices ``start + k step``, k < length
    (``kept``: the view's order of the dim, -1 for a dim it holds one index
    of), or None when the view is no such region (an overlapping or outside
    view)."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return None
    offset = view.storage_offset() - base.storage_offset()
    sizes = list(base.shape)
    if not base.is_contiguous():
        if not dense(base):
            return None
        strides = list(base.stride())  # a permuted layout (zeros_like of a transposed tensor)
    else:
        if base.dim() == 1:
            sizes = flat_shape(base.numel(),
                                [st for st, n in zip(view.stride(), view.shape) if n > 1])
            if sizes is None:
                return None
        strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    starts = [offset // st % n if n > 1 else 0 for st, n in zip(strides, sizes)]
    if sum(i * st for i, st in zip(starts, strides)) != offset:
        return None
    mapped: dict[int, tuple[int, int]] = {}
    for n, st in zip(view.shape, view.stride()):
        if n == 1:
            continue
        # the base dim along which the view steps: the one whose stride
        # divides the view's with every index inside it (one at most, as the
        # base fills its memory once: a larger dim's stride is at least this
        # dim's stride times its size)
        d = next((d for d, (bst, m) in enumerate(zip(strides, sizes))
                  if m > 1 and st > 0 and st % bst == 0
                  and starts[d] + (n - 1) * (st // bst) < m), None)
        if d is None or d in mapped:
            return None  # not a block (an overlapping or outside view)
        mapped[d] = (n, st // strides[d])
    order = {d: k for k, d in enumerate(mapped)}
    return sizes, [[starts[d], mapped.get(d, (1, 1))[0], order.get(d, -1), mapped.get(d, (1, 1))[1]]
                   for d in range(len(sizes))]


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s entries fill its memory once each in some order of its
    dims (a contiguous tensor with its dims permuted): each dim's stride,
    in decreasing order, is the product of the sizes of the dims after it."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def outputs_written(name: str, args: tuple, kwargs: dict, out: Any,
                    func: Any = None) -> list[torch.Tensor]:
    """The tensors an op writes: those it returns, or, for an op that
    writes in place and returns nothing (or only its work), the tensors it
    writes into; for any other such op (``_fused_adamw_``), its schema's
    mutable arguments, so that no write goes unrecorded."""
    outs = tensors_in(out)
    if name == "c10d.alltoall_base_.default":
        outs = [args[0]]  # received in place
    if "out" in kwargs and not outs:
        outs = tensors_in(kwargs["out"])
    if name in ("c10d.recv_.default", "c10d.allreduce_coalesced_.default"):
        outs = list(args[0])  # received or reduced in place: the buffers hold new values
    if name.startswith("c10d.") and name.split(".")[1].endswith("_") and not outs:
        # an in-place collective that returns only its work (a coalesced
        # reduce-scatter or all-gather, a reduce): it writes the tensors of
        # its first argument, which then hold new values, never the old
        outs = tensors_in(args[0])
    if name.startswith("aten._foreach_") and name.split(".")[1].endswith("_") and not outs:
        outs = list(args[0])  # an in-place foreach op returns nothing: its list is written
    if not outs and func is not None:
        outs = written_tensors(func, args, kwargs)
    return outs


def same_order(base: torch.Tensor, view: torch.Tensor) -> bool:
    """A view of all of ``base`` that lists its entries in the same order
    (both contiguous, or the same shape and strides): a reshape of it."""
    return (base.is_contiguous() and view.is_contiguous()) \
        or (base.shape == view.shape and base.stride() == view.stride())


def flat_shape(numel: int, strides: list[int]) -> list[int] | None:
    """The contiguous shape of ``numel`` entries whose dims' strides include
    ``strides`` (each dividing the one before), or None."""
    strides = sorted(set(strides) | {1}, reverse=True)
    if not strides or numel % strides[0]:
        return None
    sizes = [numel // strides[0]]
    for a, b in zip(strides, strides[1:]):
        if a % b:
            return None
        sizes.append(a // b)
    return sizes


def storage_of(t: torch.Tensor) -> int:
    """The address of a tensor's memory (shared by its views)."""
    return t.untyped_storage().data_ptr()
