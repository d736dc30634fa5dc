"""Hash routers' token-to-expert tables, filled for a small random model.

DeepSeek-V4's hash router (its first MoE layers) chooses each token's
experts by a frozen table ``tid2eid[token id]``, a buffer its initializer
sets to zeros ("real values come from the checkpoint"). Left so, every
token would choose expert 0 in each of its slots: one expert hit, each
token's row gathered twice, a routing no checkpoint has. ``fill`` gives
each token ``k`` distinct experts instead, ``(id + j) mod experts`` for
slot ``j``, so that the ids of a small batch reach every expert (a
deterministic table: the single-device step and every rank build the same).
"""

from __future__ import annotations

import torch
from torch import nn

#: the buffer a hash router keeps its table in
TABLE = "tid2eid"


def fill(model: nn.Module) -> int:
    """Fill every hash router's zero table of ``model`` in place; the number
    of tables filled."""
    filled = 0
    for module in model.modules():
        table = getattr(module, TABLE, None)
        experts = getattr(module, "num_experts", None)
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or not isinstance(experts, int) \
                or table.shape[1] > experts or bool(table.any()):
            continue
        rows, k = table.shape
        with torch.no_grad():
            ids = torch.arange(rows, dtype=table.dtype)[:, None]
            table.copy_((ids + torch.arange(k, dtype=table.dtype)[None, :]) % experts)
        filled += 1
    return filled
