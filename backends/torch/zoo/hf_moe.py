"""transformers mixtures of experts with their auxiliary load-balancing
loss on (``output_router_logits``): ``--model backends.torch.hf_moe:FAMILY``
with a ``backends.torch.hf`` recipe; ``tied_FAMILY``: the family's model
with every router weight zero, so every token's scores tie
(docs/torch-backend.md, "Top-k mixtures of experts")."""

from __future__ import annotations

import functools

import torch

from backends.torch.zoo import hf

#: the auxiliary loss's weight in the step's loss (transformers' default for
#: Mixtral is 0.001; larger here so that its gradient is not lost in rounding)
AUX_COEF = 0.02


def build(family: str, **sizes) -> hf.CausalLM:
    """The family's causal LM (``hf.build``) with its router's auxiliary
    load-balancing loss added to the loss."""
    cfg = hf.config(family, **sizes)
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = AUX_COEF
    _, model_cls = hf.classes(family)
    return hf.CausalLM(model_cls(cfg))


def tied(family: str, **sizes) -> hf.CausalLM:
    """The family's causal LM (``hf.build``) with every router weight zero:
    each token's expert scores are equal, the router's top-k picks among
    ties (the recorded routing is that pick)."""
    model = hf.build(family, **sizes)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()
    return model


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    family, make = (name[len("tied_"):], tied) if name.startswith("tied_") else (name, build)
    if family not in hf.families():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return functools.partial(make, family)
