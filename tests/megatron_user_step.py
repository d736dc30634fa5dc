"""A Megatron training step written as a Megatron user writes one, run
through the backend's contract (docs/torch-backend.md, "Megatron-Core"):
their own TransformerConfig, model provider and forward step function.
This one: untied input and output embeddings, RMSNorm, a ReLU MLP, no
biases in the linear layers, and a loss function returning the
microbatch's mean (as a float32 ``.mean()``).

    python -m backends.torch --model tests.megatron_user_step:model \\
        --recipe tests.megatron_user_step:tp_sp --dp 2 --tp 2 --batch 8
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.zoo import megatron


class ReluStep:
    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes

    def config(self, **parallel):
        from megatron.core.transformer import TransformerConfig
        s = self.sizes
        return TransformerConfig(
            num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            ffn_hidden_size=s["ffn"], normalization="RMSNorm", activation_func=F.relu,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, **parallel)

    def model_provider(self, config, pre_process: bool = True, post_process: bool = True,
                       vp_stage: int | None = None) -> nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=self.sizes["vocab"],
                        max_sequence_length=self.sizes["seqlen"], pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=False,
                        vp_stage=vp_stage)

    def forward_step(self, data_iterator: Iterator, model: nn.Module):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(losses: torch.Tensor):
            loss = losses.float().mean()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func


def model(**sizes: int) -> megatron.MegatronModel:
    return megatron.user_model(ReluStep(sizes))


tp_sp = megatron.recipe(sequence_parallel=True, microbatches=2)
pipeline = megatron.recipe(microbatches=2)


class GatedStep(ReluStep):
    """The same with a SwiGLU MLP: Megatron fuses its two input projections
    into one ``linear_fc1`` strided across tensor-parallel ranks
    (``partition_stride`` 2: each rank holds its block of the gate's rows and
    its block of the up projection's, side by side)."""

    def config(self, **parallel):
        import dataclasses
        return dataclasses.replace(super().config(**parallel), gated_linear_unit=True,
                                   activation_func=F.silu)


def gated_model(**sizes: int) -> megatron.MegatronModel:
    return megatron.user_model(GatedStep(sizes))


class GatedUnstridedStep(GatedStep):
    """A wrong step: the fused ``linear_fc1`` marked unstrided, so each rank is
    loaded a plain block of its rows (rank 0 the whole gate, rank 1 the whole
    up projection) and its SwiGLU multiplies one half of its block by the
    other."""

    def model_provider(self, config, pre_process: bool = True, post_process: bool = True,
                       vp_stage: int | None = None) -> nn.Module:
        chunk = super().model_provider(config, pre_process, post_process, vp_stage)
        for p in chunk.parameters():
            if getattr(p, "partition_stride", 1) > 1:
                p.partition_stride = 1
        return chunk


def gated_unstrided_model(**sizes: int) -> megatron.MegatronModel:
    return megatron.user_model(GatedUnstridedStep(sizes))
