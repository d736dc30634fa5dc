"""The CPU adaptations torchtitan 0.3.0 needs to run on one CPU, in one place.

torchtitan is written for accelerators. Six things do not run, or do not
run as the single-device step does, on a CPU under the fake process group;
``apply()`` (1-4), ``static_stages`` (5) and ``expert_outputs`` (6) change
exactly these, and
``apply()`` says so on stderr every time (a changed run is never silent):

1. ``torchtitan.tools.utils.device_type`` is "cuda" when no accelerator is
   found; the modules that imported the name keep their own copy. All are
   set to "cpu" (meshes and the process-group backend are then CPU ones).
2. Flex attention (the debugmodel's default ``attn_backend``) has no CPU
   backward, and torchtitan no longer offers "sdpa" as a language-model
   backend (it wants per-document positions): each layer's
   ``inner_attention`` config is replaced by torchtitan's own
   ``ScaledDotProductAttention`` (causal), the same function of the
   inputs as flex's block-causal mask when the batch is one document per row
   (the backend passes no positions). A layer that asks its inner attention
   for the log-sum-exp of its scores (an ``out_transform``: gpt_oss's
   sinks) or has a sliding window (varlen's ``window_size``) gets both from
   attention's definition instead (``causal_attention``), which SDPA does
   not offer; a layer that asks for neither runs SDPA as before.
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

6. torchtitan's grouped experts compute their GEMMs in bfloat16 and cast
   the result back to their input's type (``GroupedExperts.forward``'s
   ``type_as``), but for gpt_oss's (``GptOssGroupedExperts``), which return
   bfloat16: under bfloat16 mixed precision the same type, but in float64
   the combine's ``scatter_add`` into float64 zeros stops. ``expert_outputs``
   casts every grouped-experts module's output to its input's type (a
   forward hook; nothing for the families that already do).

Nothing else of torchtitan is changed; the backend alone calls ``apply``,
``expert_outputs`` and ``static_stages`` (``backends.torch.titan``).
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
    every layer (adaptation 2), as ``eager_attention_class()``: the same
    SDPA call, but for a layer that asks for its attention's log-sum-exp
    (an ``out_transform``, gpt_oss's sinks) or has a sliding window, which
    SDPA cannot give."""
    eager = eager_attention_class()
    for layer in config.layers:
        inner = layer.attention.inner_attention
        left = getattr(inner, "window_size", (-1, 0))[0]
        layer.attention.inner_attention = eager.Config(window=left)
    return config


_EAGER: type | None = None


def eager_attention_class() -> type:
    """torchtitan's ``ScaledDotProductAttention`` (one class, made once)
    with what its flash and flex backends also do: a causal window of
    ``window`` earlier tokens (``VarlenAttention``'s left ``window_size``,
    -1 for none) and the ``out_transform(out, lse)`` epilogue, computed by
    the definition of attention (scores, mask, log-sum-exp, softmax)."""
    global _EAGER
    if _EAGER is not None:
        return _EAGER
    from dataclasses import dataclass

    from torchtitan.models.common.attention import ScaledDotProductAttention

    class EagerAttention(ScaledDotProductAttention):
        @dataclass(kw_only=True, slots=True)
        class Config(ScaledDotProductAttention.Config):
            window: int = -1

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.window = config.window

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None,
                    enable_gqa: bool = False, is_causal: bool = True, out_transform=None,
                    **kwargs):
            if out_transform is None and self.window < 0:
                return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks,
                                       scale=scale, enable_gqa=enable_gqa, is_causal=is_causal)
            if attention_masks is not None or not is_causal:
                raise ValueError("the CPU shim's eager attention is causal, without masks")
            out, lse = causal_attention(q_BLNH, k_BLNH, v_BLNH, scale, self.window)
            return out if out_transform is None else out_transform(out, lse)

    _EAGER = EagerAttention
    return _EAGER


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                     window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of (batch, length, heads, head) ``q``, ``k``, ``v``
    (k and v with fewer heads are repeated, grouped-query attention) over
    at most ``window`` earlier tokens (-1: all): the output in the same
    layout and the log-sum-exp of each query's scores, (batch, length,
    heads)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    step = torch.arange(q.shape[2])
    behind = step[:, None] - step[None, :]
    keep = (behind >= 0) & ((behind <= window) if window >= 0 else True)
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2), lse.transpose(1, 2)
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
          f"FSDP precision '{PRECISION}', static pipeline stage shapes, grouped experts' "
          f"outputs in their input's type", file=sys.stderr)


def expert_outputs(model: torch.nn.Module) -> None:
    """Adaptation 6: each of ``model``'s grouped-experts modules returns its
    result in its input's type."""
    from torchtitan.models.common.moe import GroupedExperts

    def cast(module, args, output):
        return output.type_as(args[0])

    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.register_forward_hook(cast)


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
