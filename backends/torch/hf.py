"""Hugging Face transformers models, parallelized by transformers itself.

    python -m backends.torch --hf llama --dp 2 --tp 2

builds a causal language model of the family from a small configuration
with random weights (nothing is downloaded), and in every rank's process
applies the family's own ``base_model_tp_plan`` and FSDP2 plan through
transformers' distributed API (``DistributedConfig``,
``initialize_distributed_mesh``, ``maybe_distribute_model``), unpatched.

The model factory (``--model backends.torch.hf:llama``, ...) wraps the
transformers model in ``CausalLM``, whose ``forward(tokens, labels)``
calls it with ``shift_labels=labels`` (the labels are already the next
tokens: nothing is shifted or padded) and ``num_items_in_batch`` the token
count of the whole step, so the loss is the cross-entropy summed over the
rank's tokens divided by the step's count: each rank's share of the
step's mean, as transformers' ``ForCausalLMLoss`` computes it.

The recipes (``--recipe backends.torch.hf:tp_fsdp``, ...) map the backend's
("pp", "dp", "tp") mesh onto a ``DistributedConfig``: ``tp_size`` = tp,
``fsdp_size`` = dp (``hsdp``: ``dp_replicate_size`` 2, ``fsdp_size`` dp / 2,
FSDP2's hybrid sharding, lowered: docs/soundness.md, "Plans traced from
PyTorch", 11).
transformers builds its own mesh ("pp", "dp_replicate", "fsdp", "tp"),
whose rank order is the backend's (a data-parallel rank d is replica
d // fsdp, shard d % fsdp).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

#: family -> (configuration class, causal LM class) in ``transformers``
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}

#: transformers' attention kernel the models are built with: the eager one
#: (matmul, softmax) is plain aten on every device
ATTENTION = "eager"


class CausalLM(nn.Module):
    """A transformers causal LM with the backend's ``forward(tokens, labels)``."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        self.global_tokens = 1  # set by the backend to the step's label count

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.hf(input_ids=tokens, labels=labels, shift_labels=labels,
                      num_items_in_batch=self.global_tokens, use_cache=False)
        return out.loss


def config(family: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
    """A small configuration of ``family`` (grouped-query attention with
    half as many key-value heads when the head count is even)."""
    import transformers
    if family not in FAMILIES:
        raise ValueError(f"unknown Hugging Face family '{family}' (known: {', '.join(FAMILIES)})")
    cls = getattr(transformers, FAMILIES[family][0])
    kv = heads // 2 if heads % 2 == 0 else heads
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
              max_position_embeddings=max(seqlen, 8), tie_word_embeddings=False)
    if family in ("qwen3_moe", "mixtral"):
        experts = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=ffn,
                                     norm_topk_prob=True, decoder_sparse_step=1),
                   "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}[family]
        kw.update(experts)
    cfg = cls(**kw)
    cfg._attn_implementation = ATTENTION
    if family in ("qwen3_moe", "mixtral"):
        cfg._experts_implementation = "eager"  # grouped_mm takes no float64 on the CPU
    return cfg


def build(family: str, **sizes) -> CausalLM:
    """The family's causal LM from ``config``, randomly initialized."""
    import transformers
    model = getattr(transformers, FAMILIES[family][1])(config(family, **sizes))
    return CausalLM(model)


def llama(**sizes) -> CausalLM:
    return build("llama", **sizes)


def qwen2(**sizes) -> CausalLM:
    return build("qwen2", **sizes)


def qwen3(**sizes) -> CausalLM:
    return build("qwen3", **sizes)


def qwen3_moe(**sizes) -> CausalLM:
    return build("qwen3_moe", **sizes)


def mixtral(**sizes) -> CausalLM:
    return build("mixtral", **sizes)


def distribute(model: CausalLM, mesh, dp_replicate: int = 1,
               divide_factor: float | None = 1.0, tp_plan: dict[str, str] | None = None):
    """Apply transformers' own parallelism to ``model.hf`` for the backend's
    mesh: TP over "tp", FSDP2 over "dp" (``dp_replicate`` replicas of
    ``dp // dp_replicate`` shards). The loss is shared out over
    the step's tokens, so FSDP's gradient divide factor is 1 (the replicas'
    gradients summed) unless ``divide_factor`` says otherwise (None: FSDP's
    default, the mean over the data-parallel ranks). ``tp_plan`` overrides
    rules of the family's plan (``DistributedConfig.tp_plan``)."""
    from transformers.distributed import DistributedConfig, initialize_distributed_mesh
    if mesh["pp"].size() != 1:
        raise ValueError("the Hugging Face recipes do not pipeline (--pp 1)")
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    if dp % dp_replicate:
        raise ValueError(f"dp {dp} is not a multiple of {dp_replicate} replicas")
    cfg = DistributedConfig(tp_size=tp, fsdp_size=dp // dp_replicate, dp_replicate_size=dp_replicate,
                            tp_plan=tp_plan)
    _, mesh_manager = initialize_distributed_mesh(cfg)
    hf = type(model.hf).maybe_distribute_model(model.hf, cfg, mesh_manager)
    model.hf = hf
    if cfg.dp_size > 1 and divide_factor is not None:
        for module in hf.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide_factor)
    return reduce_partials


def reduce_partials(model, mesh) -> None:
    """Bring DTensor gradients to their parameter's placements (what the
    optimizer step or gradient clipping does first): partial sums reduced,
    and a replicated gradient of a sharded parameter (DTensor's backward of
    the vocabulary-parallel embedding) cut to the parameter's shard."""
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)


def tp_fsdp(model, mesh):
    """transformers' TP plan over "tp" and its FSDP2 plan over "dp"."""
    return distribute(model, mesh)


def hsdp(model, mesh):
    """tp_fsdp with two FSDP replicas (HSDP: ``dp_replicate_size`` 2)."""
    return distribute(model, mesh, dp_replicate=2)


def tp_fsdp_avg(model, mesh):
    """tp_fsdp keeping FSDP's default divide factor (the mean over the
    data-parallel ranks) with the loss shared out over the step: every
    gradient 1/dp of the single-device one (the class of pytorch PR 167178)."""
    return distribute(model, mesh, divide_factor=None)


def ep_fsdp(model, mesh):
    """Expert parallelism (transformers' token-dispatch plan): refused. Under
    the fake process group the all-to-all that exchanges the routed token
    counts returns this rank's own counts, so every expert shape traced
    after it would be invented; and with real collectives the shapes are
    those of one routing only (docs/soundness.md, "Plans traced from
    PyTorch", 12)."""
    raise ValueError("expert parallelism is not traced: each expert's input has as many rows "
                     "as tokens the router sent it, so its shapes depend on the values (and "
                     "under the fake process group the token-count all-to-all echoes this "
                     "rank's own counts)")



def tp_norm_grads_not_reduced(model, mesh):
    """A wrong plan: Qwen3's per-head ``q_norm``/``k_norm`` planned
    "replicate" instead of "replicated_with_grad_allreduce", so each
    tensor-parallel rank keeps the gradient of its own heads' share."""
    return distribute(model, mesh, tp_plan={"model.layers.*.self_attn.q_norm": "replicate",
                                            "model.layers.*.self_attn.k_norm": "replicate"})
