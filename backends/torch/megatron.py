"""Megatron-Core's GPTModel, parallelized by Megatron itself.

    python -m backends.torch --model backends.torch.megatron:gpt \\
        --recipe backends.torch.megatron:tp --dp 1 --tp 2

builds Megatron-Core's ``GPTModel`` at the size flags with its local
(non-TransformerEngine) layer spec: learned positions, LayerNorm, fused QKV
``ColumnParallelLinear``, ``RowParallelLinear`` output projections, GELU MLP,
a ``VocabParallelEmbedding`` tied to the output layer, and the
vocabulary-parallel cross-entropy. The single-device step is that model at
tensor-parallel size 1 (Megatron's ``parallel_state`` on one rank: its
collectives are then skipped). In every rank's process the recipe ``tp``
(``tp_sp``: with sequence parallelism) initializes ``parallel_state`` on
the backend's process group at the mesh's tensor-parallel size, builds the
model again (Megatron shards its layers at construction), loads into each
parameter its rank's piece of the single-device weights (the pieces its
``partition_dim`` names, as a checkpoint loader does) and runs the step with
Megatron's own ``get_forward_backward_func()`` (no pipelining, one
microbatch). Megatron's CPU adaptations (``backends.torch.megatron_shim``)
are applied and printed on every run.

The loss is the sum of the per-token losses GPTModel returns, divided by
the step's token count (``global_tokens``). What is not traced yet is
refused in one line: data and pipeline parallelism (Megatron's
``DistributedDataParallel`` and its pipelined schedules).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from backends.torch import megatron_shim
from backends.torch.pipeline import OwnSchedule

#: the seed of Megatron's RNG tracker (its dropout streams; dropout is 0 here)
TRACKER_SEED = 1234


@contextlib.contextmanager
def _cpu_rng_kept() -> Iterator[None]:
    """The CPU generator's state restored after: Megatron's seeding does not
    change the weights the backend's seed draws."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


def init_parallel_state(tp: int = 1) -> None:
    """Megatron's ``parallel_state`` at tensor-parallel size ``tp`` on the
    default process group (one of a single rank when none is initialized,
    as on one device), and its RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # its gloo side groups (CPU copies of the data-parallel groups) are not built: under
    # the fake process group a gloo group cannot be created, and nothing traced uses them
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)
    with _cpu_rng_kept():
        model_parallel_cuda_manual_seed(TRACKER_SEED)


class MegatronGPT(nn.Module):
    """A Megatron ``GPTModel`` with the backend's ``forward(tokens, labels)``."""

    def __init__(self, sizes: dict[str, int]):
        super().__init__()
        self.sizes = sizes
        self.model = self.build(tp=1, sequence_parallel=False)
        self.global_tokens = 1  # set by the backend to the step's label count

    def build(self, tp: int, sequence_parallel: bool) -> nn.Module:
        """The GPTModel of ``sizes`` at tensor-parallel size ``tp`` (``parallel_state``
        must be initialized at that size)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
        s = self.sizes
        config = TransformerConfig(
            num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            ffn_hidden_size=s["ffn"], tensor_model_parallel_size=tp,
            sequence_parallel=sequence_parallel, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, params_dtype=torch.float32)
        return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=s["vocab"],
                        max_sequence_length=s["seqlen"],
                        share_embeddings_and_output_weights=True)

    def token_losses(self, model: nn.Module, tokens: torch.Tensor,
                     labels: torch.Tensor) -> torch.Tensor:
        """GPTModel's per-token losses ``[B, S]`` (causal attention, positions 0..S-1)."""
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        return model(tokens, positions, None, labels=labels)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.token_losses(self.model, tokens, labels).sum() / self.global_tokens


def gpt(**sizes: int) -> MegatronGPT:
    """Megatron's GPTModel at the size flags (``layers``, ``hidden``, ``heads``,
    ``ffn``, ``vocab``, ``seqlen``), tensor-parallel size 1."""
    megatron_shim.apply()
    init_parallel_state(1)
    return MegatronGPT(sizes)


def load_pieces(full: nn.Module, sharded: nn.Module, tp_rank: int, tp: int) -> None:
    """Each of ``sharded``'s parameters set to its piece of ``full``'s: the
    ``tp_rank``-th of ``tp`` equal blocks along its ``partition_dim`` for a
    tensor-parallel one, the whole otherwise."""
    weights = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in sharded.named_parameters():
            whole = weights[name]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                if getattr(p, "partition_stride", 1) != 1:
                    raise ValueError(f"Megatron parameter {name} is strided across tensor-parallel "
                                     f"ranks (partition_stride {p.partition_stride}): not supported")
                whole = whole.chunk(tp, dim=p.partition_dim)[tp_rank]
                axes: list[list[str]] = [[] for _ in range(p.dim())]
                axes[p.partition_dim].append("tp")
                p.mesh_axes = axes
            p.data = whole.detach().clone().to(whole.dtype)


def _refuse_unsupported(mesh) -> None:
    if mesh["pp"].size() > 1:
        raise ValueError("Megatron pipeline parallelism (its pipelined schedules) is not traced yet: "
                         "use --pp 1")
    if mesh["dp"].size() > 1:
        raise ValueError("Megatron data parallelism (its DistributedDataParallel) is not traced yet: "
                         "use --dp 1")


def _parallelize(model: MegatronGPT, mesh, sequence_parallel: bool) -> OwnSchedule:
    _refuse_unsupported(mesh)
    tp = mesh["tp"].size()
    if sequence_parallel and tp == 1:
        raise ValueError("Megatron sequence parallelism needs --tp 2 or more")
    init_parallel_state(tp)
    from megatron.core import parallel_state
    full = model.model
    model.model = model.build(tp, sequence_parallel)
    load_pieces(full, model.model, parallel_state.get_tensor_model_parallel_rank(), tp)
    return OwnSchedule(functools.partial(megatron_step, model))


def tp(model: MegatronGPT, mesh) -> OwnSchedule:
    """Megatron's tensor parallelism on the mesh's "tp" ranks."""
    return _parallelize(model, mesh, sequence_parallel=False)


def tp_sp(model: MegatronGPT, mesh) -> OwnSchedule:
    """Megatron's tensor and sequence parallelism on the mesh's "tp" ranks."""
    return _parallelize(model, mesh, sequence_parallel=True)


def megatron_step(model: MegatronGPT, tokens: torch.Tensor,
                  labels: torch.Tensor) -> list[torch.Tensor]:
    """The rank's step through Megatron's ``get_forward_backward_func()``
    (one microbatch of the rank's rows); the loss tensor it ran backward
    from."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    losses: list[torch.Tensor] = []

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = per_token.sum() / model.global_tokens
        losses.append(loss)
        return loss, {}

    def forward_step(data: Iterator, gpt: nn.Module):
        ids, lab = next(data)
        return model.token_losses(gpt, ids, lab), loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([(tokens, labels)]),
                                model=[model.model], num_microbatches=1,
                                seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
                                forward_only=False)
    return losses
