"""The CPU adaptations torchtitan 0.3.0 needs to run on one CPU, in one place.

torchtitan is written for accelerators. Four of its defaults do not run on
a CPU under the fake process group; ``apply()`` changes exactly these, and
says so on stderr every time (a changed run is never silent):

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

Nothing else of torchtitan is changed; the backend alone calls ``apply``
(``backends.torch.titan``).
"""

from __future__ import annotations

import importlib
import sys

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
          f"FSDP precision '{PRECISION}'", file=sys.stderr)
