"""The CPU adaptations torchtitan 0.3.0 needs to run on one CPU, in one place.

torchtitan is written for accelerators. Five things do not run, or do not
run as the single-device step does, on a CPU under the fake process group;
``apply()`` (1-4) and ``static_stages`` (5) change exactly these, and
``apply()`` says so on stderr every time (a changed run is never silent):

1. ``torchtitan.tools.utils.device_type`` is "cuda" when no accelerator is
   found; the modules that imported the name keep their own copy. All are
   set to "cpu" (meshes and the process-group backend are then CPU ones).
2. Flex attention (the debugmodel's default ``attn_backend``) has no CPU
   backward, and torchtitan no longer offers "sdpa" as a language-model
   backend (it wants per-document positions): each layer's
   ``inner_attention`` config is replaced by torchtitan's own
   ``ScaledDotProductAttention.Config()`` (causal), the same function of the
   inputs as flex's block-causal mask when the batch is one document per row
   (the backend passes no positions).
3. The default ``spmd_backend`` "spmd_types" fails inside ``fully_shard`` on
   the fake group: the ``ParallelDims`` and ``ParallelismConfig`` are built
   with "partial_dtensor" (DTensor parameters, torchtitan's previous
   default).
4. FSDP's mixed precision (``mixed_precision_param``, always installed by
   ``parallelize_llama``) names only 16- and 32-bit types: "float64" is
   added to ``torchtitan.config.TORCH_DTYPE_MAP`` so that the parallel run
   computes in float64 like the single-device one (in float32, a kernel's
   scalar such as RMSNorm's eps is rounded to float32, a different
   constant from the single-device run's).
5. Under the fake process group a pipeline stage cannot learn its
   neighbours' tensor shapes by exchanging them (the backend refuses stages
   without static shapes, backends/torch/pipeline.py): while
   ``pipeline_llm`` builds its stages (``static_stages``), each
   ``PipelineStage`` is given the shapes a real run exchanges, as example
   ``input_args`` and ``output_args`` (the token ids of one microbatch,
   the hidden states between stages, cut along the sequence under tensor
   parallelism, and the last stage's logits, a vocabulary-sharded DTensor
   under loss parallelism). A wrong shape stops the run; no value is read
   from them.

Nothing else of torchtitan is changed; the backend alone calls ``apply``
and ``static_stages`` (``backends.torch.titan``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator

import torch

#: the modules holding their own copy of ``device_type``
DEVICE_TYPE_HOLDERS = ("torchtitan.tools.utils", "torchtitan.distributed.utils",
                       "torchtitan.distributed.parallel_dims")
ATTENTION = "sdpa"
#: FSDP's parameter and reduction precision (adaptation 4)
PRECISION = "float64"


def sdpa_attention(config):
    """The model ``config`` with torchtitan's causal SDPA inner attention in
    every layer (adaptation 2)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config
SPMD_BACKEND = "partial_dtensor"


def apply() -> None:
    """Set ``device_type`` to "cpu" in torchtitan's modules and say what the
    shim changes."""
    for name in DEVICE_TYPE_HOLDERS:
        module = importlib.import_module(name)
        if getattr(module, "device_type", "cpu") != "cpu":
            module.device_type = "cpu"
    from torchtitan.config import TORCH_DTYPE_MAP
    TORCH_DTYPE_MAP.setdefault(PRECISION, torch.float64)
    print(f"torchtitan CPU shim (backends/torch/titan_shim.py): device_type 'cpu', "
          f"attn_backend '{ATTENTION}', spmd_backend '{SPMD_BACKEND}', "
          f"FSDP precision '{PRECISION}', static pipeline stage shapes", file=sys.stderr)


@contextlib.contextmanager
def static_stages(config, rows: int, seqlen: int, tp_mesh) -> Iterator[None]:
    """While ``pipeline_llm`` runs: its ``PipelineStage``s built with static
    shapes (adaptation 5) for microbatches of ``rows`` rows of ``seqlen``
    tokens of the model ``config``; ``tp_mesh`` is torchtitan's tensor-parallel mesh
    (None without tensor parallelism), on which the activations between
    stages are ``Shard(1)`` DTensors and the logits ``Shard(2)`` ones."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.distributed import pipeline_parallel

    tp = 1 if tp_mesh is None else tp_mesh.size()

    def example(shape: tuple[int, ...], dim: int, grad: bool) -> torch.Tensor:
        if tp == 1:
            return torch.empty(shape, dtype=torch.float64, requires_grad=grad)
        local = list(shape)
        local[dim] //= tp
        return DTensor.from_local(torch.empty(local, dtype=torch.float64, requires_grad=grad),
                                  tp_mesh, [Shard(dim)], run_check=False)

    def stage(module, index: int, count: int, device, **kwargs):
        first, last = index == 0, index == count - 1
        hidden = example((rows, seqlen, config.dim), 1, True)
        inputs = torch.zeros(rows, seqlen, dtype=torch.int64) if first else hidden
        outputs = example((rows, seqlen, config.vocab_size), 2, True) if last else hidden
        grads = {}
        if tp > 1:
            grads = {"input_grads": (None,) if first else hidden, "output_grads": outputs}
        return PipelineStage(module, index, count, device, input_args=inputs,
                             output_args=outputs, **grads, **kwargs)

    saved = pipeline_parallel.PipelineStage
    pipeline_parallel.PipelineStage = stage
    try:
        yield
    finally:
        pipeline_parallel.PipelineStage = saved
