"""transformers' BLT configured as a tiny test of it is: patches of one byte
each (``patch_in_forward=False``, ``patching_mode="static"``: no entropy
model runs, every patch length is 1), loaded as
``--model tests.blt_models:blt_static``. The default configuration's
entropy patcher decides the patch boundaries from the values its small
model computes (``.tolist()`` of lengths that depend on them), which the
backend refuses (docs/torch-backend.md, "hf blt")."""

from __future__ import annotations

from transformers import BltForCausalLM

from backends.torch.zoo import hf


def blt_static(**sizes) -> hf.CausalLM:
    """BLT at the backend's sizes with static one-byte patches."""
    cfg = hf.config("blt", **sizes)
    cfg.patch_in_forward = False
    cfg.patching_mode = "static"
    model = BltForCausalLM(cfg)
    hf.tie_shared(model)
    return hf.CausalLM(model)
