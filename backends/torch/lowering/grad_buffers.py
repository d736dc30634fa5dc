"""Lowering of gradient buffers as a training loop zeroes, fills and reduces
them by hand (Megatron-Core's ``main_grad`` buffers and
``finalize_model_grads``); docs/soundness.md, "Plans traced from PyTorch",
35 (c) and (h).

- ``t.zero_()`` is zeros of its shape whatever it held (``Zeroed``), and
  ``zeros + x`` of the same shape is ``x``;
- ``torch.cat`` along dim 0 of 1-d tensors that only in-place all-reduces
  read (``_flatten_dense_tensors``) is a ``Bucket`` of them, all-reduced
  piece by piece (item 19), a flattened part being the value it flattens,
  and a slice of the bucket the pieces there;
- ``allreduce_coalesced_`` is each tensor all-reduced in place, and an
  all-reduce of a computed value or a bucket over a group of one rank is
  that value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.torch.errors import LoweringError
from backends.torch.lowering.bucket_pieces import bucket_view
from backends.torch.lowering.context import pg, tensor_args
from backends.torch.lowering.ir import Bucket, PatternOnly, Pending
from backends.torch.lowering.registry import Handler, lowers, refines

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class Zeroed(Pending):
    """``t.zero_()``: zeros of ``shape`` (a gradient buffer's view before the
    backward adds into it); an addition of it is the other operand."""
    shape: tuple[int, ...]

    def materialize(self, lw: Lowerer) -> int:
        return lw.emit("zeros", [], [self.shape], {"shape": list(self.shape)}, direction="none")[0]


def _env(lw: Lowerer, a: Any) -> Any:
    if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == "v":
        return lw.env.get(a[1])
    return None


@lowers("aten.zero_.default")
def zero_(lw: Lowerer, args, kwargs, shapes, group):
    if isinstance(_env(lw, args[0]), PatternOnly):
        lw.val(args[0])  # a helper value of a pattern is refused here, in one line
    return Zeroed(tuple(shapes[0]))


@refines("aten.add_.Tensor", "aten.add.Tensor")
def add_zero(base: Handler) -> Handler:
    """``zeros + x`` (``main_grad.add_(grad)`` into a zeroed buffer) is x."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        for i in (0, 1):
            if len(args) > 1 and isinstance(_env(lw, args[i]), Zeroed) \
                    and isinstance(args[1 - i], (list, tuple)) and kwargs.get("alpha", 1) == 1:
                x = lw.val(args[1 - i])
                if tuple(lw.shapes[x]) == tuple(shapes[0]):
                    return x
        return base(lw, args, kwargs, shapes, group)
    return lower


def _readers(lw: Lowerer, value: int) -> list[tuple]:
    """The events after the current one that read ``value``."""
    return [e for e in lw.trace["events"][lw.event + 1:] if value in tensor_args(e[1])]


@refines("aten.cat.default")
def cat_flat(base: Handler) -> Handler:
    """``torch.cat`` of 1-d tensors along dim 0 that only in-place all-reduces
    read (``_flatten_dense_tensors`` of the sequence-parallel gradients in
    ``finalize_model_grads``): a ``Bucket`` of them, all-reduced piece by
    piece. A part that is another value flattened (a ``view(-1)`` of a 2-d
    gradient) is that value in the bucket, with its own shape: its elements
    in the same order."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        parts = args[0] if isinstance(args[0], (list, tuple)) else []
        outs = lw.trace["events"][lw.event][2]
        if dim == 0 and parts and all(isinstance(_env(lw, a), int) for a in parts) \
                and all(len(lw.shapes[lw.val(a)]) == 1 for a in parts):
            readers = _readers(lw, outs[0])
            if readers and all(e[0] == "c10d.allreduce_.default" for e in readers):
                return Bucket(tuple(lw.flat_of.get(lw.val(a), lw.val(a)) for a in parts))
        return base(lw, args, kwargs, shapes, group)
    return lower


@refines("aten.slice.Tensor")
def slice_bucket(base: Handler) -> Handler:
    """``flat[a:b]`` of a bucket (``_unflatten_dense_tensors``): its pieces there."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        b = _env(lw, args[0])
        if not isinstance(b, Bucket):
            return base(lw, args, kwargs, shapes, group)
        dim = int(args[1]) if len(args) > 1 else 0
        start = int(args[2]) if len(args) > 2 and args[2] is not None else 0
        step = int(args[4]) if len(args) > 4 else 1
        if dim != 0 or step != 1:
            raise LoweringError(f"{lw.name}: a strided slice of a gradient bucket is not lowered")
        return bucket_view(lw, b, start, tuple(shapes[0]))
    return lower


def one_rank_identity(base: Handler) -> Handler:
    """c10d's in-place all-reduce over a group of one rank (Megatron's at a
    parallel size of 1) of a computed value or a bucket: that value,
    whatever the reduction."""
    def lower(lw: Lowerer, args, kwargs, shapes, group):
        tensors = args[0]
        if len(tensors) == 1 and len(pg(lw, args[1])) == 1:
            x = _env(lw, tensors[0])
            if isinstance(x, Bucket):
                return [x]
            if isinstance(x, int):
                return [lw.val(tensors[0])]
        return base(lw, args, kwargs, shapes, group)
    return lower


refines("c10d.allreduce_.default")(one_rank_identity)


@refines("c10d.allreduce_coalesced_.default", base="c10d.allreduce_.default")
def all_reduce_coalesced(base: Handler) -> Handler:
    """c10d's ``allreduce_coalesced_`` (Megatron's coalescing manager around
    its buckets' all-reduces): each tensor all-reduced in place, as one
    ``allreduce_`` of it."""
    all_reduce = one_rank_identity(base)

    def lower(lw: Lowerer, args, kwargs, shapes, group):
        out = []
        for t, shape in zip(args[0], shapes):
            out += all_reduce(lw, [[t], args[1], args[2], None], {}, [shape], group)
        return out
    return lower
