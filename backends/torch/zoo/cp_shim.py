"""The one CPU adaptation PyTorch's context parallelism needs, in one place.

``torch.distributed.tensor.experimental.context_parallel`` replaces SDPA's
kernels by its ring attention through DTensor's table of custom op handlers
(``_context_parallel._attention.custom_ops``), which names only the CUDA
kernels (flash, efficient, cuDNN) and their backwards. On the CPU, SDPA runs
``aten._scaled_dot_product_flash_attention_for_cpu`` (which returns the
log-sum-exp like the CUDA flash kernel) and its backward, which the table
lacks: CP stops there.

``apply()`` adds the CPU kernel and its backward to that table, with a
handler that does what CP's own handler does for the CUDA flash kernel:
it takes the local query, key and value (each cut along the sequence, dim
2, over a one-dim mesh) and calls CP's ``_templated_ring_attention`` (or
its backward) with the CPU kernel as the per-block attention. The ring's
rotation (all-gather or all-to-all, ``set_rotate_method``), its causal
block choice, its load-balanced halves and its merge (``_SDPAMerger``) run
as they ship; only the kernel each block calls is the CPU one. The merged
result passes through ``ring_result``, a copy that names it for the trace.
It says so on stderr every time (a changed run is never silent). The argument that
this changes nothing the step computes is docs/soundness.md, "Plans traced
from PyTorch", item 38.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2


class ShimError(RuntimeError):
    """A call the shim does not route (stated in one line)."""


def _block_forward(query, key, value, *, is_causal: bool, dropout_p: float = 0.0,
                   scale: float | None = None):
    """One ring block: the CPU flash kernel, ``(out, lse)``."""
    return FORWARD(query, key, value, dropout_p, is_causal, scale=scale)


def _block_backward(*, grad_out, query, key, value, out, logsumexp, is_causal: bool,
                    dropout_p: float = 0.0, scale: float | None = None):
    """One ring block's backward: the CPU flash kernel's, ``(dq, dk, dv)``."""
    return BACKWARD(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                    scale=scale)


def _local(tensors: list[Any]) -> tuple[Any, list[torch.Tensor]]:
    """The mesh and the local pieces of DTensors cut along the sequence."""
    from torch.distributed.tensor import DTensor, Shard
    mesh = None
    out = []
    for t in tensors:
        if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 \
                or tuple(t.placements) != (Shard(SEQ_DIM),):
            raise ShimError("context-parallel attention on the CPU: every tensor argument must "
                            "be a DTensor cut along the sequence (dim 2) over a one-dim mesh")
        if mesh is not None and t.device_mesh != mesh:
            raise ShimError("context-parallel attention on the CPU: arguments on two meshes")
        mesh = t.device_mesh
        out.append(t.to_local())
    return mesh, out


def _wrap(mesh, local: torch.Tensor, like: Any):
    """``local`` as a DTensor cut along the sequence, shaped as ``like`` globally
    along every dim but the last ones ``local`` lacks."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    shape = list(local.shape)
    shape[SEQ_DIM] = like.shape[SEQ_DIM]
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, (Shard(SEQ_DIM),),
                       TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _options(args: tuple, kwargs: dict, at: int) -> tuple[float, bool]:
    if kwargs.get("attn_mask") is not None:
        raise ShimError("context-parallel attention on the CPU with an attn_mask is not routed "
                        "(CP's ring takes no mask)")
    dropout = float(args[at] if len(args) > at else kwargs.get("dropout_p", 0.0))
    causal = bool(args[at + 1] if len(args) > at + 1 else kwargs.get("is_causal", False))
    return dropout, causal


@torch.library.custom_op("verdict_cp::ring_result", mutates_args=())
def ring_result(out: torch.Tensor, lse: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's merged (out, lse) for the rank's local query, keys and
    values, as they are (copies): it names, for the trace, what the merge
    computed (the attention of that query over the keys and values the
    local ones are pieces of; docs/soundness.md, "Plans traced from
    PyTorch", 53 (d)). It computes nothing, so a real run is
    unchanged."""
    del query, key, value
    return out.clone(), lse.clone()


@torch.library.custom_op("verdict_cp::ring_grads", mutates_args=())
def ring_grads(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring backward's dq, dk and dv for the rank's local query, keys
    and values, as they are (copies): it names, for the trace, what the
    ring's backward computed (the gradients of the attention of that query
    over the keys and values the local ones are pieces of, at the local
    rows; docs/soundness.md, "Plans traced from PyTorch", 66). It computes
    nothing, so a real run is unchanged."""
    del query, key, value
    return dq.clone(), dk.clone(), dv.clone()


def _forward_handler(op_call, args: tuple, kwargs: dict):
    """CP's ring with the CPU kernel per block (what CP's handler does for
    ``_scaled_dot_product_flash_attention``), its result named by
    ``ring_result``."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    dropout, causal = _options(args, kwargs, 3)
    mesh, (q, k, v) = _local(list(args[:3]))
    out, lse = cp._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, _block_forward, query=q, key=k, value=v, is_causal=causal,
        dropout_p=dropout, scale=kwargs.get("scale"))
    out, lse = ring_result(out, lse, q, k, v)
    return _wrap(mesh, out, args[0]), _wrap(mesh, lse, args[0])


def _backward_handler(op_call, args: tuple, kwargs: dict):
    """CP's ring backward with the CPU kernel's backward per block."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    dropout, causal = _options(args, kwargs, 6)
    mesh, (g, q, k, v, out, lse) = _local(list(args[:6]))
    dq, dk, dv = cp._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, _block_backward, grad_out=g, grad_out_name="grad_out",
        query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=causal, dropout_p=dropout,
        scale=kwargs.get("scale"))
    dq, dk, dv = ring_grads(dq, dk, dv, q, k, v)
    return _wrap(mesh, dq, args[1]), _wrap(mesh, dk, args[2]), _wrap(mesh, dv, args[3])


def apply() -> None:
    """Add the CPU kernel and its backward to CP's table of replaced kernels
    and say so on stderr."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    if cp.custom_ops.get(FORWARD) is not _forward_handler:
        cp.custom_ops[FORWARD] = _forward_handler
        cp.custom_ops[BACKWARD] = _backward_handler
    print("context-parallel CPU shim (backends/torch/cp_shim.py): CP's ring attention calls "
          "_scaled_dot_product_flash_attention_for_cpu and its backward per block; its rotation "
          "and merge run as they ship; its merged result is named by verdict_cp::ring_result "
          "and its backward's by verdict_cp::ring_grads (copies)", file=sys.stderr)
