"""torchtitan's models, parallelized by torchtitan itself.

    python -m backends.torch --model backends.torch.titan:llama3_debugmodel \\
        --recipe backends.torch.titan:parallelize --dp 2 --tp 2 --vocab 2048

builds torchtitan's Llama3 ``debugmodel`` (its configuration, its
``init_weights``) and in every rank's process applies torchtitan's own
``parallelize_llama`` (tensor and sequence parallelism with its
vocabulary-parallel loss, FSDP2 over "dp") on torchtitan's own
``ParallelDims`` mesh, unpatched but for the CPU adaptations of
``backends.torch.titan_shim`` (applied here, printed on stderr).

The loss is torchtitan's: ``cross_entropy_loss`` (a sum over the rank's
tokens) divided by the step's token count, as its trainer divides by
``global_valid_tokens``. ``--vocab`` must be the model's vocabulary (2048
for the debugmodel); the other size flags are not used (the flavor fixes
them). FSDP's mixed precision is float64 (the shim's adaptation 4), the
precision every traced model runs in.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from backends.torch import titan_shim


class TitanLM(nn.Module):
    """A torchtitan decoder with the backend's ``forward(tokens, labels)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.global_tokens = 1  # set by the backend to the step's label count

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from torchtitan.components.loss import cross_entropy_loss
        return cross_entropy_loss(self.model(tokens), labels) / self.global_tokens


def _parallelism(dp: int = 1, tp: int = 1, pp: int = 1):
    from torchtitan.config import ParallelismConfig
    return ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                             pipeline_parallel_degree=pp, spmd_backend=titan_shim.SPMD_BACKEND)


def build(flavor: str = "debugmodel", **_sizes) -> TitanLM:
    """torchtitan's Llama3 ``flavor`` with its weights initialized on the CPU."""
    titan_shim.apply()
    from torchtitan.models.llama3 import model_registry
    config = titan_shim.sdpa_attention(model_registry(flavor).model)
    config.update_from_config(config=SimpleNamespace(parallelism=_parallelism()))
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return TitanLM(model)


def llama3_debugmodel(**sizes) -> TitanLM:
    return build("debugmodel", **sizes)


def parallelize(model: TitanLM, mesh):
    """torchtitan's ``parallelize_llama`` on its own ``ParallelDims`` mesh of
    the backend's sizes (``dp_shard`` = dp, ``tp`` = tp)."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama
    dp, tp, pp = mesh["dp"].size(), mesh["tp"].size(), mesh["pp"].size()
    if pp != 1:
        raise ValueError("backends.torch.titan:parallelize does not pipeline (--pp 1)")
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=pp, ep=1,
                        world_size=dp * tp * pp, spmd_backend=titan_shim.SPMD_BACKEND)
    dims.build_mesh()
    from torchtitan.distributed import utils as dist_utils
    dist_utils.set_spmd_backend(titan_shim.SPMD_BACKEND)  # as its trainer does from the config
    parallelize_llama(model.model, parallel_dims=dims,
                      training=TrainingConfig(mixed_precision_param=titan_shim.PRECISION,
                                              mixed_precision_reduce=titan_shim.PRECISION),
                      parallelism=_parallelism(dp, tp, pp), compile_config=CompileConfig(),
                      ac_config=None, dump_folder="/tmp")
    return None
