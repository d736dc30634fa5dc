"""The model PyTorch tests its own tensor parallelism with
(``torch.testing._internal.distributed._tensor.common_dtensor.Transformer``)
and its own ``Transformer.parallelize``, unmodified: learned token and
position embeddings (the position table sharded by rows under tensor
parallelism and looked up at ``torch.arange`` positions), LayerNorm, SDPA
causal attention, a GELU MLP, the output projection tied to the token
table or not. Factories for ``--model``, recipes for ``--recipe``. The
recipes pass ``local_output_for_attn=True``, as a CPU run must: DTensor has
no sharding rule for the CPU attention kernel, so the projections hand
their local heads to it.

``common_dtensor`` imports PyTorch's test utilities, which import
``expecttest``; when that test-only package is missing, a stand-in module
with ``expecttest.TestCase = unittest.TestCase`` is registered first (no
test of PyTorch's is run here)."""

from __future__ import annotations

import sys
import types
import unittest

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from backends.torch.zoo.recipes import all_reduce_dp, reduce_tp_partials


def _common_dtensor():
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stand_in
    from torch.testing._internal.distributed._tensor import common_dtensor
    return common_dtensor


class TransformerLM(nn.Module):
    """The test Transformer's logits under a cross-entropy summed over the
    rank's tokens and divided by the step's token count."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.global_tokens = 1

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return loss / self.global_tokens


def _build(tied: bool, layers: int, hidden: int, heads: int, vocab: int, seqlen: int) -> nn.Module:
    cd = _common_dtensor()
    args = cd.ModelArgs(n_layers=layers, vocab_size=vocab, max_seq_len=seqlen, dim=hidden,
                        n_heads=heads, dropout_p=0.0, use_attn_mask=True, weight_tying=tied)
    return TransformerLM(cd.Transformer(args))


def transformer(layers: int = 1, hidden: int = 16, heads: int = 4, ffn: int = 64,
                vocab: int = 16, seqlen: int = 4) -> nn.Module:
    """The test Transformer with its output projection untied."""
    return _build(False, layers, hidden, heads, vocab, seqlen)


def transformer_tied(layers: int = 1, hidden: int = 16, heads: int = 4, ffn: int = 64,
                     vocab: int = 16, seqlen: int = 4) -> nn.Module:
    """The test Transformer with its output projection tied to the token table."""
    return _build(True, layers, hidden, heads, vocab, seqlen)


def tp(model, mesh):
    """``Transformer.parallelize`` on "tp" without sequence parallelism;
    gradients summed over "dp"."""
    _common_dtensor().Transformer.parallelize(model.model, mesh["tp"], use_seq_parallel=False,
                                                local_output_for_attn=True)
    return all_reduce_dp


def tp_sp(model, mesh):
    """``Transformer.parallelize`` with sequence parallelism; gradients
    summed over "dp"."""
    _common_dtensor().Transformer.parallelize(model.model, mesh["tp"], use_seq_parallel=True,
                                                local_output_for_attn=True)
    return all_reduce_dp


def fsdp_tp(model, mesh):
    """``Transformer.parallelize`` with sequence parallelism, then FSDP2 over
    "dp" (each block, then the root), divide factor 1 (the loss is the
    step's mean shared out)."""
    _common_dtensor().Transformer.parallelize(model.model, mesh["tp"], use_seq_parallel=True,
                                                local_output_for_attn=True)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for module in (model, *model.model.layers):
        module.set_gradient_divide_factor(1.0)
    return reduce_tp_partials


def tp_sp_dp_averaged(model, mesh):
    """A mistake: the sequence-parallel plan with the gradients averaged over
    "dp" although the loss is already each rank's share of the step's
    mean (every gradient 1/dp of the single-device one)."""
    tp_sp(model, mesh)

    def after(model, mesh) -> None:
        all_reduce_dp(model, mesh)
        for p in model.parameters():
            if p.grad is not None:
                local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                local.div_(mesh["dp"].size())
    return after
