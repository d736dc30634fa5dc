"""Megatron training steps written as users write them, through the backend's
contract only (docs/torch-backend.md, "Megatron-Core", "Your own Megatron
step"): each its own ``TransformerConfig``, model provider, forward step
function and loss function. ``tests/megatron_user_step.py`` is the worked
example; these vary what a user varies.

    python -m backends.torch --model tests.megatron_user_steps:llama_like \\
        --recipe tests.megatron_user_steps:tp_sp --dp 2 --tp 2 --batch 8
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.zoo import megatron


class LlamaLikeStep:
    """A Llama-shaped model: rotary positions, grouped-query attention (4
    heads, 2 query groups), a SwiGLU MLP, RMSNorm, no linear biases, untied
    input and output embeddings; the loss the microbatch's mean."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes

    def fields(self) -> dict[str, Any]:
        """The configuration fields this step sets beyond the sizes."""
        return dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                    add_bias_linear=False, num_query_groups=2)

    def config(self, **parallel: Any):
        from megatron.core.transformer import TransformerConfig
        s = self.sizes
        return TransformerConfig(
            num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            ffn_hidden_size=s["ffn"], hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, **self.fields(), **parallel)

    #: ``GPTModel``'s positions: "rope" or "learned_absolute"
    positions = "rope"
    #: whether the output layer shares the input embedding's weight
    tied = False
    #: the local spec's ``qk_layernorm``
    qk_layernorm = False

    def model_provider(self, config, pre_process: bool = True, post_process: bool = True,
                       vp_stage: int | None = None) -> nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec = get_gpt_layer_local_spec(qk_layernorm=self.qk_layernorm,
                                        normalization=config.normalization)
        return GPTModel(config, spec, vocab_size=self.sizes["vocab"],
                        max_sequence_length=self.sizes["seqlen"], pre_process=pre_process,
                        post_process=post_process, position_embedding_type=self.positions,
                        share_embeddings_and_output_weights=self.tied, vp_stage=vp_stage)

    def forward_step(self, data_iterator: Iterator, model: nn.Module):
        batch = next(data_iterator)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(per_token: torch.Tensor):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}
        return losses, loss_func


class MaskedTokensStep(LlamaLikeStep):
    """Learned positions, LayerNorm with ``qk_layernorm``, a GELU MLP with
    biases, tied embeddings, and a loss mask (the labels below half the
    vocabulary count) under ``calculate_per_token_loss``: the loss function
    returns the masked sum and the count of kept tokens, and Megatron divides
    every gradient by the step's count over microbatches and data-parallel
    ranks."""

    positions = "learned_absolute"
    tied = True
    qk_layernorm = True

    def fields(self) -> dict[str, Any]:
        return dict(calculate_per_token_loss=True)

    def mask(self, labels: torch.Tensor) -> torch.Tensor:
        return (labels < self.sizes["vocab"] // 2).to(torch.float32)

    def forward_step(self, data_iterator: Iterator, model: nn.Module):
        batch = next(data_iterator)
        mask = self.mask(batch["labels"])
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(per_token: torch.Tensor):
            kept = mask.view(-1).to(per_token.dtype)
            total = (per_token.view(-1) * kept).sum()
            return total, kept.sum().to(torch.int), {"lm loss": total.detach()}
        return losses, loss_func


class MaskedMeanStep(MaskedTokensStep):
    """A wrong step: the masked loss divided by the microbatch's own count of
    kept tokens (without ``calculate_per_token_loss``), so the schedule's and
    DDP's averages weigh microbatches and ranks with unequal counts alike:
    not the mean over the batch's kept tokens."""

    def fields(self) -> dict[str, Any]:
        return {}

    def forward_step(self, data_iterator: Iterator, model: nn.Module):
        batch = next(data_iterator)
        mask = self.mask(batch["labels"])
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(per_token: torch.Tensor):
            kept = mask.view(-1).to(per_token.dtype)
            loss = (per_token.view(-1) * kept).sum() / kept.sum()
            return loss, {"lm loss": loss.detach()}
        return losses, loss_func


class TokenSumStep(LlamaLikeStep):
    """A wrong step: the loss summed over the microbatch's tokens (not their
    mean) without ``calculate_per_token_loss``: the schedule still divides by
    the microbatch count and DDP averages over the ranks, so the gradients
    are the single-device sum's divided by microbatches x dp."""

    def forward_step(self, data_iterator: Iterator, model: nn.Module):
        batch = next(data_iterator)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return losses, lambda per_token: (per_token.sum(), {})


class DeepStep(LlamaLikeStep):
    """Several layers for the pipeline schedules: rotary positions, full
    multi-head attention, a plain GELU MLP with biases, LayerNorm, untied
    embeddings."""

    def fields(self) -> dict[str, Any]:
        return {}


def llama_like(**sizes: int) -> megatron.MegatronModel:
    return megatron.user_model(LlamaLikeStep(sizes))


def masked_tokens(**sizes: int) -> megatron.MegatronModel:
    return megatron.user_model(MaskedTokensStep(sizes))


def masked_mean(**sizes: int) -> megatron.MegatronModel:
    return megatron.user_model(MaskedMeanStep(sizes))


def token_sum(**sizes: int) -> megatron.MegatronModel:
    return megatron.user_model(TokenSumStep(sizes))


def deep(**sizes: int) -> megatron.MegatronModel:
    return megatron.user_model(DeepStep(sizes))


tp_sp = megatron.recipe(sequence_parallel=True, microbatches=2)
ddp = megatron.recipe(microbatches=2)
ddp_average_overlap = megatron.recipe(microbatches=2, average_in_collective=True,
                                      overlap_grad_reduce=True)
ddp_small_buckets = megatron.recipe(microbatches=2, overlap_grad_reduce=True, bucket_size=200)
dist_opt_small_buckets = megatron.recipe(microbatches=2, use_distributed_optimizer=True,
                                         bucket_size=200)
pp_1f1b = megatron.recipe(microbatches=4)
pp_interleaved = megatron.recipe(microbatches=4, virtual_pp=2, batch_p2p_comm=False)
# a wrong optimizer step (--optimizer): Megatron's learning rate multiplied by the dp size
ddp_lr_times_dp = megatron.recipe(microbatches=2, bug="lr_times_dp")
