"""What a pipelining recipe hands to the backend, and how the backend runs it.

A recipe that pipelines (``torch.distributed.pipelining``) keeps its rank's
stage of the model and returns a ``PipelineStep`` instead of an
``after_backward`` function: the backend then runs the step as the schedule
does (``schedule.step``, once per gradient accumulation step), not as
``model(tokens).backward()``.

Under the fake process group two things of a real run are replaced, both
without changing what the schedule computes:

- The warm-up vote (every stage sends its "my shapes are static" vote down
  the pipeline and the product comes back) would read garbage. Its result
  with real communication is "static" exactly when every stage's metadata
  is complete; each rank sets that result for its own stage when its own
  metadata is complete and refuses the run otherwise, so a run with any
  dynamic stage stops on that stage's rank.
- The schedule's microbatch index is not carried by its sends and
  receives; the backend reads it from the chunk id the schedule passes to
  its stage (``forward_one_chunk``, ``backward_one_chunk``): every op
  that follows belongs to that microbatch until the next such call (the
  last stage's loss follows its forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: stage methods whose first argument is the chunk (microbatch) id and that
#: compute (sends and receives are batched across chunks: a received value
#: takes its microbatch from the value sent, docs/torch-backend.md)
CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


@dataclass
class PipelineStep:
    """``schedule(tokens)`` builds the rank's schedule (with its
    ``PipelineStage``) for one accumulation step's token ids;
    ``accumulation`` steps run on equal row slices of the rank's batch
    before ``after_backward(model, mesh)``."""

    schedule: Callable[[torch.Tensor], Any]
    accumulation: int = 1
    after_backward: Callable | None = None


@dataclass
class OwnSchedule:
    """A step a library's own schedule runs (Megatron's
    ``get_forward_backward_func()``): ``run(tokens, labels, set_mb)`` runs the
    rank's forward and backward on its rows in ``microbatches`` microbatches
    (numbered 0.. in the order of the rows), reporting to ``set_mb`` the
    microbatch each op it runs belongs to, and returns the loss tensors
    backward ran from; ``after_backward(model, mesh)`` runs after it."""

    run: Callable[..., list[torch.Tensor]]
    after_backward: Callable | None = None
    microbatches: int = 1


class StaticOnly(RuntimeError):
    """A stage whose metadata is not static: it cannot run under the fake group."""


def _static_warmup(stages: list, has_backward: bool, p2p_done: bool) -> None:
    from torch.distributed.pipelining._utils import InferenceMode
    for stage in stages:
        meta = getattr(stage, "_user_meta", None)
        if meta is None or InferenceMode.needs_dynamic(meta, has_backward):
            raise StaticOnly(f"pipeline stage {stage.stage_index} has no static shapes: pass "
                             f"input_args and output_args to PipelineStage")
        stage._inference_mode = InferenceMode.STATIC


class Pipelined:
    """A rank's pipelined step: the schedule built once (before recording),
    reporting its microbatch ids to ``set_mb``."""

    def __init__(self, step: PipelineStep, tokens: torch.Tensor, set_mb: Callable[[int], None]):
        self.step = step
        self.schedule = step.schedule(tokens[: tokens.shape[0] // step.accumulation])
        self.offset = 0
        self.set_mb = set_mb
        self.schedule._warmup_p2p = _static_warmup
        for stage in self.stages:
            for name in CHUNK_METHODS:
                method = getattr(stage, name)

                def wrapped(chunk_id, *args, _method=method, **kwargs):
                    self.set_mb(self.offset + chunk_id)
                    return _method(chunk_id, *args, **kwargs)

                setattr(stage, name, wrapped)

    @property
    def stages(self) -> list:
        """The rank's stages: one for GPipe and 1F1B, several for interleaved
        and zero-bubble schedules."""
        return getattr(self.schedule, "_stages", None) or [self.schedule._stage]

    @property
    def microbatches(self) -> int:
        """Microbatches of the whole step, over all accumulation steps."""
        return self.schedule._n_microbatches * self.step.accumulation

    def run(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """Run the rank's part of the step; the losses of its microbatches
        (empty unless it holds the last stage), in order."""
        losses: list[torch.Tensor] = []
        n = self.step.accumulation
        for k, (ids, lab) in enumerate(zip(tokens.chunk(n), labels.chunk(n))):
            self.offset = k * self.schedule._n_microbatches
            mine: list[torch.Tensor] = []
            if any(stage.is_first for stage in self.stages):
                self.schedule.step(ids, target=lab, losses=mine, return_outputs=False)
            else:
                self.schedule.step(target=lab, losses=mine, return_outputs=False)
            self.set_mb(-1)
            losses += mine
        return losses
