"""Buffers a step updates, compared by value (docs/soundness.md, "Plans
traced from PyTorch", 105).

torchtitan's auxiliary-loss-free load balancing updates two buffers of every
MoE layer outside the model's computation, in an optimizer step pre-hook:
``expert_bias_E`` (added to the router's scores before its top-k, read by
the next step's routing) and ``tokens_per_expert_E`` (the step's token
counts, zeroed). A model names them (``final_buffers``). Both are functions
of the recorded routing only: the counts are sums of its one-hot rows, the
ranks' counts all-reduced with the members' sends (``exchange.py``,
``ALL_REDUCE``), the bias moved by ``coeff * sign(mean - counts)``. They are
constants of the step, and each rank's value is compared with the
single-device step's exactly: a difference is a finding (``WrongStep``,
exit 1) naming the rank, the buffer and the entries; a buffer some
parameter reaches (no constant) is refused (exit 2).
"""

from __future__ import annotations

import numpy as np

from backends.torch.errors import LoweringError, WrongStep


def _first_difference(mine: np.ndarray, want: np.ndarray) -> str:
    """The first entry where two arrays of one shape differ, with both values."""
    at = tuple(int(i) for i in np.argwhere(mine != want)[0])
    return (f"entry {list(at)}: {float(mine[at]):.9g} where the single-device step ends with "
            f"{float(want[at]):.9g}")


def check_final_buffers(single: dict, traces: list[dict]) -> str | None:
    """Every rank ends with the single-device step's value of every buffer
    the model names as updated (``final_buffers``); what a SUCCESS then
    covers (for the world spec), or None when the model names none."""
    want = single.get("final_buffers") or {}
    if not want:
        return None
    for name, (constant, _) in want.items():
        if not constant:
            raise LoweringError(f"the single-device step's {name} after its step is no constant "
                                f"of the step (a parameter reaches it): not compared by value")
    for trace in traces:
        rank, mine = trace["rank"], trace.get("final_buffers") or {}
        for name, (_, value) in want.items():
            if name not in mine:
                raise WrongStep(f"rank {rank} holds no buffer {name}, which the single-device "
                                f"step updates")
            constant, got = mine[name]
            if not constant:
                raise LoweringError(f"rank {rank}'s {name} after its step is no constant of the "
                                    f"step (a parameter or an unanswered collective reaches it): "
                                    f"not compared by value")
            if got.shape != value.shape:
                raise WrongStep(f"rank {rank} ends with {name} of shape {list(got.shape)}, the "
                                f"single-device step with {list(value.shape)}")
            if not np.array_equal(got, value):
                raise WrongStep(f"rank {rank} ends its step with another {name} than the "
                                f"single-device step: {_first_difference(got, value)} (the "
                                f"load-balancing update read other token counts)")
    return ("buffers updated by the step, equal by value on every rank: "
            + ", ".join(sorted(want)))
