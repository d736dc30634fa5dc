"""transformers' Mixtral with its load-balancing loss in its data-parallel
form: the token fractions of the whole step (Megatron's
``switch_load_balancing_loss_func`` with its counts all-reduced).

    python -m backends.torch --model backends.torch.zoo.hf_moe_global:mixtral \\
        --recipe backends.torch.zoo.hf_moe_global:tp_fsdp --dp 2 --tp 1

transformers' ``load_balancing_loss_func`` is ``E * sum_e f_e * P_e`` with
``f_e`` the fraction of the top-k assignments that go to expert e and
``P_e`` the mean router probability of e, both over the tokens it is
given: on a data-parallel rank, its own tokens (``hf_moe:mixtral``, which
FAILs: the ranks' products of means do not sum to the step's). Here a
rank all-reduces its assignment counts over the data-parallel group (the
recipe names it) and divides both sums by the step's token count: its
term ``E * sum_e (C_e / T) * (S_e / T)``, with ``S_e`` its own probability
sum, and the ranks' terms sum to the step's loss, which is the same
function on one device (no group: the counts are the batch's). The model's
step is MixtralForCausalLM's own (its router loss off) with this loss
added, the routers' logits read by a forward hook (docs/soundness.md, "Plans
traced from PyTorch", 105 (e)).
"""

from __future__ import annotations

import torch

from backends.torch.zoo import hf
from backends.torch.zoo.hf_moe import AUX_COEF


class GlobalBalanceLM(hf.CausalLM):
    """A Mixtral causal LM whose loss adds the load-balancing loss over the
    step's tokens (``group``: the data-parallel group its counts are
    all-reduced over; None on one device)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.group = None
        self.reduces_constants = True  # the counts' all-reduce answered (exchange.py)
        self.router_logits: list[torch.Tensor] = []
        # the routers' logits, as transformers' own recorder reads them
        # (``_can_record_outputs``: the router's first output), kept by a hook so
        # that the step runs the whole model (FSDP's root) with its own loss only
        for module in model.modules():
            if type(module).__name__ == "MixtralTopKRouter":
                module.register_forward_hook(self._keep_logits)

    def _keep_logits(self, module, args, output) -> None:
        self.router_logits.append(output[0])

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.router_logits = []
        loss = super().forward(tokens, labels)  # transformers' own, output_router_logits off
        return loss + AUX_COEF * self.balance_loss(tuple(self.router_logits))

    def balance_loss(self, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``E * sum_e (C_e / T) * (S_e / T)`` over the layers' router
        logits: ``C`` the top-k assignment counts all-reduced over the
        group, ``S`` the rank's router probability sums, ``T`` the step's
        token rows (one per token, every layer's counted, as transformers
        counts them)."""
        experts, k = self.hf.num_experts, self.hf.num_experts_per_tok
        counts = torch.zeros(experts, dtype=torch.float64)
        sums = torch.zeros(experts, dtype=torch.float64)
        for layer in router_logits:
            probs = torch.softmax(layer, dim=-1)
            _, picked = torch.topk(probs, k, dim=-1)
            counts = counts + torch.nn.functional.one_hot(picked.reshape(-1), experts).sum(0)
            sums = sums + probs.sum(dim=0)
        if self.group is not None:
            torch.distributed.all_reduce(counts, group=self.group)
        rows = float(self.global_tokens * len(router_logits))
        return experts * torch.sum((counts / rows) * (sums / rows))


def mixtral(**sizes) -> GlobalBalanceLM:
    """transformers' Mixtral (``hf.build``'s configuration) with the
    data-parallel form of its load-balancing loss."""
    return GlobalBalanceLM(hf.build("mixtral", **sizes).hf)


def tp_fsdp(model: GlobalBalanceLM, mesh):
    """``hf:tp_fsdp``, the counts all-reduced over the data-parallel group."""
    result = hf.tp_fsdp(model, mesh)
    model.group = mesh["dp"].get_group()
    return result


def tp_fsdp_counts_not_reduced(model: GlobalBalanceLM, mesh):
    """A bug: ``hf:tp_fsdp`` with each rank's own counts (its fractions
    over its tokens, divided by the step's count)."""
    return hf.tp_fsdp(model, mesh)
