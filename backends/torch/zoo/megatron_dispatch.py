"""Megatron-Core's MoE with its other token dispatcher: ``allgather``
(``MoEAllGatherTokenDispatcher``: every tensor-parallel-and-expert rank's
tokens gathered, each rank's experts run on the rows routed to them, the
result reduce-scattered back), in place of ``moe_gpt``'s all-to-all one.
Same model, same recipes (``backends.torch.megatron:moe_*``)."""

from __future__ import annotations

from typing import Any

from backends.torch.zoo.megatron import MegatronModel, MoEGPTStep, user_model


class AllGatherMoEGPTStep(MoEGPTStep):
    """``MoEGPTStep`` with ``moe_token_dispatcher_type="allgather"``."""

    def config(self, **parallel: Any):
        config = super().config(**parallel)
        config.moe_token_dispatcher_type = "allgather"
        return config


def moe_gpt_allgather(**sizes: int) -> MegatronModel:
    """``moe_gpt`` with the all-gather token dispatcher."""
    return user_model(AllGatherMoEGPTStep(sizes))
