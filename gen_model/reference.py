"""Run a model's training step in torch (float64, CPU) on the inputs a plan's
numeric executor draws, so that plans can be checked against autograd."""

from __future__ import annotations

import numpy as np
import torch

from gen_model.config import ModelConfig
from gen_model.models import ZOO, build
from verdict.numeric import input_value
from verdict.plan import Plan


def torch_step(cfg: ModelConfig, plan: Plan, seed: int = 0) -> dict[str, np.ndarray]:
    """Loss and parameter gradients by torch autograd, keyed by logical name.

    Keys: 'loss' and each parameter's qualified name.
    """
    model = build(cfg, device="cpu", dtype=torch.float64)
    by_name = {t.name: t for t in plan.logical}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(input_value(by_name[name], seed)))
        for name, b in model.named_buffers():
            b.copy_(torch.from_numpy(input_value(by_name[name], seed)))
    args = []
    for name, (_, kind) in ZOO[cfg.model].inputs(cfg, plan.world["gbs"]).items():
        value = input_value(by_name[name], seed)
        args.append(torch.from_numpy(value.argmax(-1) if kind == "tokens" else value))
    loss = model(*args)
    loss.backward()
    out = {"loss": loss.detach().numpy()}
    for name, p in model.named_parameters():
        out[name] = p.grad.numpy() if p.grad is not None else np.zeros(tuple(p.shape))
    return out
