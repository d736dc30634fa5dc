"""A mixture of experts with expert parallelism whose shapes are static.

    python -m backends.torch --model backends.torch.moe:moe --recipe backends.torch.moe:ep --dp 2 --tp 1

The Llama of ``backends.torch.models`` with every feed-forward replaced by
``SoftMoE``: E experts (``w1`` [E, F, H], ``w2`` [E, H, F], a SiLU between)
and a gate whose softmax weighs every expert's output for every token (soft
routing: no top-k, so which token reaches which expert does not depend on
the values, and every shape is fixed; docs/soundness.md, "Plans traced from
PyTorch", 12, says what this proves and what it does not).

Expert parallelism (``ep``) borrows the data-parallel ranks, as torchtitan's
dp2ep does, with ep = dp: rank d holds experts [d * E / dp, (d + 1) * E / dp)
(``w1``, ``w2`` DTensors sharded on dim 0 over "dp"). Its tokens are
dispatched by an all-gather over "dp" (every rank's tokens reach every
rank's experts: Megatron's all-gather token dispatcher), each rank runs its
own experts on all of them, weighted by its experts' gate columns, and the
outputs are combined by a reduce-scatter over "dp" (the sum over experts,
each rank keeping its own rows). The backward runs the reverse collectives.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from backends.torch.zoo.models import Llama, LlamaArgs

#: experts per MoE layer
EXPERTS = 8


class SoftMoE(nn.Module):
    """Every token through every expert, weighted by the gate's softmax."""

    def __init__(self, hidden: int, ffn: int, experts: int = EXPERTS):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, ffn, hidden) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn) * ffn ** -0.5)
        self.ep_mesh = None  # set by an EP recipe: the 1-D mesh the experts are sharded over

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, hidden = x.shape
        if self.ep_mesh is not None:  # dispatch: every rank's tokens to every rank
            x = funcol.all_gather_tensor_autograd(x, 0, self.ep_mesh)
        tokens = x.reshape(-1, hidden)
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        local = w1.shape[0]
        scores = torch.softmax(self.gate(tokens), dim=-1)
        # this rank's experts' columns (on one device all of them: the same
        # slice, so that its backward has a single-device counterpart)
        first = self.ep_mesh.get_local_rank() * local if self.ep_mesh is not None else 0
        scores = torch.narrow(scores, 1, first, local)
        # every expert's first projection as one matmul (no broadcast of the
        # tokens over the experts), then each expert's second by a batched one
        h = (tokens @ w1.reshape(-1, hidden).t()).reshape(-1, local, w1.shape[1])
        h = torch.bmm(F.silu(h).transpose(0, 1), w2.transpose(1, 2))
        out = (scores.t().unsqueeze(-1) * h).sum(0).reshape(-1, seqlen, hidden)
        if self.ep_mesh is not None:  # combine: the sum over experts, each rank its rows
            out = funcol.reduce_scatter_tensor_autograd(out, "sum", 0, self.ep_mesh)
        return out


class MoELlama(Llama):
    """The Llama with ``SoftMoE`` feed-forwards."""

    def __init__(self, args: LlamaArgs):
        super().__init__(args)
        for block in self.layers.values():
            block.feed_forward = SoftMoE(args.hidden, args.ffn)


class MoELlamaMean(MoELlama):
    """The MoE Llama whose loss is the mean over the tokens it is given (on a
    data-parallel rank, dp times its share of the step's mean)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return total / labels.numel()


def moe(**kw) -> MoELlama:
    return MoELlama(LlamaArgs(**kw))


def moe_mean(**kw) -> MoELlamaMean:
    return MoELlamaMean(LlamaArgs(**kw))


def _experts(model) -> list[SoftMoE]:
    return [m for m in model.modules() if isinstance(m, SoftMoE)]


def shard_experts(model, mesh) -> set[str]:
    """Expert parallelism over "dp" (ep = dp, no tensor parallelism): each
    MoE layer's experts sharded on dim 0, its dispatch and combine over
    "dp". The names of the expert parameters."""
    if mesh["tp"].size() != 1 or mesh["pp"].size() != 1:
        raise ValueError("the EP recipes run expert parallelism over dp only (--tp 1 --pp 1)")
    ep_mesh = mesh["dp"]
    for layer in _experts(model):
        experts = layer.w1.shape[0]
        if experts % ep_mesh.size() or experts // ep_mesh.size() < 2:
            # one expert per rank leaves size-1 expert dims, which the
            # alignment cannot tell from broadcast dims: not traced
            raise ValueError(f"{experts} experts do not split over ep {ep_mesh.size()} into "
                             f"two or more per rank")
        layer.w1 = nn.Parameter(distribute_tensor(layer.w1.data, ep_mesh, [Shard(0)]))
        layer.w2 = nn.Parameter(distribute_tensor(layer.w2.data, ep_mesh, [Shard(0)]))
        layer.ep_mesh = ep_mesh
    return {n for n, p in model.named_parameters() if isinstance(p, DTensor)}


def reduce_grads(model, mesh, experts: set[str], op: str, expert_divide: int) -> None:
    """The data-parallel reduction with expert parallelism: every gradient
    but the experts' reduced over "dp" with ``op`` (the gate's gradient is
    partial over the experts, the others over the batch); each expert
    gradient already sums every rank's tokens, and is divided by
    ``expert_divide``."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name in experts:
            if expert_divide != 1:
                p.grad.to_local().div_(expert_divide)
            continue
        p.grad.copy_(funcol.all_reduce(p.grad, op, mesh["dp"]))


def ep(model, mesh):
    """Expert parallelism over dp for the loss shared out over the step
    (``moe``): the replicas' gradients summed, the experts' left whole."""
    experts = shard_experts(model, mesh)
    return lambda m, mesh: reduce_grads(m, mesh, experts, "sum", 1)


def ep_mean(model, mesh):
    """Expert parallelism over dp for a per-rank mean loss (``moe_mean``):
    every rank's loss is dp times its share, so the dense gradients are
    averaged over dp and every expert gradient, which sums the tokens of all
    ep ranks, is divided by ep (the fix of pytorch issue 160285)."""
    experts = shard_experts(model, mesh)
    return lambda m, mesh: reduce_grads(m, mesh, experts, "avg", mesh["dp"].size())
