"""The CPU adaptations megatron-core 0.16.1 needs to run on a CPU, in one place.

Megatron-Core is written for CUDA devices. Ten things in its local
(non-TransformerEngine) layers, schedules, grad buffers and optimizer do not
run on a CPU; ``apply()`` changes exactly these at run time (no file of
Megatron's is edited) and prints one line for each, every time it is called
(a changed run is never silent):

1. its RNG tracker (``tensor_parallel/random.py``: ``model_parallel_cuda_manual_seed``,
   ``CudaRNGStatesTracker``) reads, seeds and sets the CUDA generator: it
   uses the CPU generator instead;
2. ``torch.cuda.current_device()`` used as a device (the TP/SP gathers and
   scatters, attention's global memory buffer, the grad buffers) is the CPU,
   and ``Tensor.cuda()`` (the tied embedding's setup across pipeline
   stages) leaves a tensor on the CPU;
3. the local spec's torch norm refuses ``sequence_parallel=True`` (without
   apex): it is built as without sequence parallelism and its parameters
   then carry ``sequence_parallel = True``, as apex's fused norms mark
   theirs (what ``finalize_model_grads`` reads to all-reduce their
   gradients over the tensor-parallel group);
4. CUDA streams, events, ``synchronize`` and ``empty_cache`` (the grad
   buffers' communication stream) do nothing: on the CPU every op runs in
   program order;
5. ``device="cuda"`` in a tensor factory call of Megatron's (its optimizer's
   scalars, clipping's norms) is the CPU;
6. ``Tensor.type()`` compared with a CUDA type name (``"torch.cuda.FloatTensor"``
   in ``clip_grads.py``, ``optimizer.py``, ``distrib_optimizer.py``) accepts
   the CPU type of the same name, and a float64 tensor as a float32 one (the
   backend runs in float64 what Megatron runs in float32; Megatron then takes
   its float32 path);
7. without TransformerEngine, ``moe/moe_utils.py`` leaves ``te_general_gemm``
   undefined (its import fails before the name is bound) and the MoE
   router's gating linear reads it: it is bound to None, which selects
   Megatron's own torch path (``torch.mm``) as the code means;
8. the all-to-all dispatcher moves its split sizes to the host as numpy
   arrays (``maybe_move_tensor_to_cpu(..., as_numpy=True)``) only from a
   CUDA tensor, and ``all_to_all_single`` refuses them as tensors: a CPU
   tensor is given as the numpy array of its values, as from a device;
9. without apex or TransformerEngine, clipping's 2-norm of the gradients
   (``clip_grads.l2_norm_impl``, Megatron's ``local_multi_tensor_l2_norm``)
   copies the per-tensor norms to the host (``torch.tensor(list)``,
   ``float(norm)``) and back: it is the same norm computed as apex's fused
   ``multi_tensor_l2norm`` computes it, on the device (the 2-norm of the
   stacked per-tensor norms, of the gradients' dtype, as a 0-dim tensor);
10. rotary positions (``RotaryEmbedding``) keep their inverse frequencies,
   computed at construction, as a plain tensor attribute, and cache the
   embedding each ``forward`` computes (``functools.lru_cache``) across
   steps: the tracer knows a model's constants by its buffers and records
   each step's ops afresh, so ``inv_freq`` is registered as a non-persistent
   buffer (as torch models hold theirs) and ``forward`` runs uncached (the
   same function of the sequence length and the frequencies, recomputed).

Patches 1, 2, 4 and 5 replace the name ``torch`` in the modules of
``megatron.core`` by a view of torch that differs in these names only.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import torch

#: one line per adaptation, printed by ``apply``
PATCHES = (
    "CUDA RNG tracker state -> the CPU generator",
    "torch.cuda.current_device() as a device, Tensor.cuda() -> cpu",
    "torch LayerNorm/RMSNorm with sequence_parallel=True: parameters marked sequence_parallel "
    "(as apex's)",
    "CUDA streams, events, synchronize, empty_cache -> no-ops",
    "device='cuda' in Megatron's tensor factory calls -> cpu",
    "Tensor.type() == 'torch.cuda.FloatTensor' accepts the CPU type (float64 as float32)",
    "moe_utils.te_general_gemm (unbound without TransformerEngine) -> None: the router's "
    "torch.mm path",
    "moe_utils.maybe_move_tensor_to_cpu(as_numpy=True) of a CPU tensor -> its numpy values (the "
    "all-to-all's split sizes, as from a device)",
    "clip_grads' local_multi_tensor_l2_norm (host copies of the norms) -> the 2-norm of the "
    "stacked norms on the device, as apex's multi_tensor_l2norm",
    "RotaryEmbedding's inv_freq (a plain attribute) -> a non-persistent buffer, its forward "
    "uncached (lru_cache): the embedding recomputed in each traced step",
)
#: torch's tensor factories whose ``device`` argument patch 5 rewrites
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like",
             "empty_like", "full_like", "randn", "rand")



def _cpu(device: Any) -> Any:
    """A CUDA device (a name, an index, a ``torch.device``) as the CPU."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _NoStream:
    """A CUDA stream or event that orders nothing: CPU ops run in program order."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __getattr__(self, name: str) -> Any:
        # a method's result (an event recorded, a stream waited on) orders nothing either
        return lambda *args, **kwargs: _NoStream()


class _CudaView(types.ModuleType):
    """``torch.cuda`` with patches 1, 2 and 4."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.random = types.SimpleNamespace(get_rng_state=lambda device=None: torch.get_rng_state(),
                                            set_rng_state=lambda state, device=None:
                                            torch.set_rng_state(state))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    Stream = Event = _NoStream

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def default_stream(device: Any = None) -> _NoStream:
        return _NoStream()

    current_stream = default_stream

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


class _TorchView(types.ModuleType):
    """``torch`` with ``cuda`` replaced by ``_CudaView`` and its tensor
    factories placing ``device='cuda'`` on the CPU (patch 5)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaView()
        for name in FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    @staticmethod
    def _on_cpu(factory: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return factory(*args, **kwargs)
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _TypeName(str):
    """A tensor's type name that also equals its CUDA name (patch 6); a
    float64 one equals the float32 names too."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, str):
            return NotImplemented
        if str.__eq__(self, other):
            return True
        cpu = other.replace("torch.cuda.", "torch.", 1)
        return str.__eq__(self, cpu) or (str(self) == "torch.DoubleTensor"
                                         and cpu == "torch.FloatTensor")

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__


class _TypeMethod:
    """``Tensor.type`` returning ``_TypeName`` when called without arguments
    (patch 6); its presence on ``torch.Tensor`` marks the shim as applied."""

    def __init__(self, original: Any):
        self.original = original
        # named as the method it wraps: code that lists Tensor's methods by
        # name (torch.overrides) keeps working in the same process
        self.__name__ = self.__qualname__ = getattr(original, "__name__", "type")

    def __get__(self, tensor: torch.Tensor | None, owner: type) -> Any:
        if tensor is None:
            return self  # ``torch.Tensor.type(x)``: called through ``__call__``
        return lambda *args, **kwargs: self(tensor, *args, **kwargs)

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = self.original(tensor, *args, **kwargs)
        return _TypeName(result) if not args and not kwargs and isinstance(result, str) \
            else result


def _norm_new(original: Any) -> Any:
    """``WrappedTorchNorm.__new__`` accepting ``sequence_parallel`` (patch 3)."""
    def new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, **kwargs)
        import dataclasses
        norm = original(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size,
                        eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm
    return new


def _l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool,
             *args: Any) -> tuple[torch.Tensor, None]:
    """``local_multi_tensor_l2_norm`` without its host copies (patch 9): the
    2-norm of every tensor of ``tensor_lists`` as one 2-norm of their
    norms, the one number apex's ``multi_tensor_l2norm`` returns (as a 0-dim
    tensor: Megatron only squares it, all-reduces it and reads it with
    ``.item()``, which a 0-dim tensor and apex's one-element one give alike)."""
    if per_tensor:
        raise ValueError("Megatron's per-tensor l2 norms are not supported on the CPU")
    norms = [torch.linalg.vector_norm(t) for tensors in tensor_lists for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms)), None


def _to_host(original: Any) -> Any:
    """``maybe_move_tensor_to_cpu`` giving a CPU tensor asked ``as_numpy`` as
    the numpy array of its values (patch 8)."""
    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            import numpy as np
            return np.array(tensor.tolist(), dtype=np.int64)
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
    return move


#: the modules loaded before the patches, so that each gets the view of torch
MODULES = ("megatron.core.tensor_parallel.random", "megatron.core.tensor_parallel.mappings",
           "megatron.core.tensor_parallel.layers", "megatron.core.transformer.attention",
           "megatron.core.utils", "megatron.core.models.gpt.gpt_model",
           "megatron.core.pipeline_parallel.schedules",
           "megatron.core.distributed.param_and_grad_buffer",
           "megatron.core.distributed.distributed_data_parallel",
           "megatron.core.distributed.finalize_model_grads", "megatron.core.optimizer",
           "megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
           "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.grad_scaler",
           "megatron.core.transformer.moe.router", "megatron.core.transformer.moe.moe_utils",
           "megatron.core.transformer.moe.token_dispatcher",
           "megatron.core.transformer.moe.experts", "megatron.core.transformer.moe.moe_layer")


def _rotary_traceable() -> None:
    """Patch 10: ``RotaryEmbedding.inv_freq`` a buffer, its ``forward`` uncached."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    init = RotaryEmbedding.__init__

    def buffered_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        inv_freq = self.__dict__.pop("inv_freq")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
    RotaryEmbedding.__init__ = buffered_init
    RotaryEmbedding.forward = RotaryEmbedding.forward.__wrapped__


def apply() -> None:
    """Apply the ten patches (once per process) and print them, one line each."""
    if not isinstance(torch.Tensor.type, _TypeMethod):  # applied once per process
        import importlib
        for name in MODULES:
            importlib.import_module(name)
        view = _TorchView()
        for name, module in list(sys.modules.items()):
            if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
                module.torch = view
        from megatron.core.tensor_parallel import random
        random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: \
            torch.get_rng_state()
        random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: \
            torch.set_rng_state(state)
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        WrappedTorchNorm.__new__ = staticmethod(_norm_new(WrappedTorchNorm.__new__))
        from megatron.core.transformer.moe import moe_utils
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        from megatron.core.transformer.moe import token_dispatcher
        token_dispatcher.maybe_move_tensor_to_cpu = _to_host(moe_utils.maybe_move_tensor_to_cpu)
        from megatron.core.optimizer import clip_grads
        from megatron.core.utils import local_multi_tensor_l2_norm
        if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:  # neither apex nor TE
            clip_grads.l2_norm_impl = _l2_norm
        _rotary_traceable()
        torch.Tensor.type = _TypeMethod(torch.Tensor.type)
        if not torch.cuda.is_available():  # a CPU build: .cuda() can only fail
            torch.Tensor.cuda = lambda self, *args, **kwargs: self
    for number, line in enumerate(PATCHES, 1):
        print(f"Megatron-Core CPU shim (backends/torch/megatron_shim.py) {number}: {line}",
              file=sys.stderr)
