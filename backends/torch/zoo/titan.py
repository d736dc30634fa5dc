"""torchtitan's models, parallelized by torchtitan itself.

    python -m backends.torch --model backends.torch.titan:llama3_debugmodel \\
        --recipe backends.torch.titan:parallelize --dp 2 --tp 2 --vocab 2048

builds torchtitan's Llama3 ``debugmodel`` (its configuration, its
``init_weights``) and in every rank's process applies torchtitan's own
``parallelize_llama`` (tensor and sequence parallelism with its
vocabulary-parallel loss, FSDP2 over "dp") on torchtitan's own
``ParallelDims`` mesh, unpatched but for the CPU adaptations of
``backends.torch.titan_shim`` (applied here, printed on stderr). With
``--pp 2`` it runs torchtitan's ``pipeline_llm`` instead (its stage split,
``parallelize_llama`` on each stage, 1F1B over ``microbatches(pp)``
microbatches: two, or one a stage when there are more stages).

The loss is torchtitan's: ``cross_entropy_loss`` (a sum over the rank's
tokens) divided by the step's token count, as its trainer divides by
``global_valid_tokens``. ``--vocab`` must be the model's vocabulary (2048
for the debugmodel); ``--seqlen`` sets the sequence length; the other size
flags are not used (the flavor fixes them) but for ``--layers``, which cuts the
flavor's blocks or repeats its last one (without it, the flavor's). FSDP's mixed precision is
float64 (the shim's adaptation 4), the precision every traced model runs
in. Its other models are reached by family (``FAMILIES``: ``titan:qwen3``,
``titan:qwen3_moe``, ``titan:deepseek_v3``, ``titan:gpt_oss``, each with an
``_ep`` variant for expert parallelism), parallelized by the family's own
function (``parallelize``; ``parallelize_ep`` with ep = dp), their top-k
routing recorded and replayed.
"""

from __future__ import annotations

import copy
import importlib
from types import SimpleNamespace

import torch
from torch import nn

from backends.torch.tracer.pipeline import PipelineStep
from backends.torch.zoo import titan_shim


class TitanLM(nn.Module):
    """A torchtitan decoder with the backend's ``forward(tokens, labels)``."""

    def __init__(self, model: nn.Module, config=None, seqlen: int = 0):
        super().__init__()
        self.model = model
        self.config = config  # torchtitan's model configuration (pipelining reads it)
        self.seqlen = seqlen
        self.global_tokens = 1  # set by the backend to the step's label count
        #: the positions of the rank's tokens, when they are a chunk of the sequence
        self.positions: torch.Tensor | None = None
        #: the step passes each row's positions as torchtitan's data loader
        #: yields them (``titan:NAME_positions``: one document per row, 0 to
        #: s - 1), where the model's default reads the table's prefix
        self.loader_positions = False

    def loss(self, pred: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """torchtitan's loss function as its pipeline schedule calls it:
        the rank's summed cross-entropy over the step's token count, and
        no metrics."""
        from torchtitan.components.loss import cross_entropy_loss
        return cross_entropy_loss(pred, labels) / self.global_tokens, {}

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from torchtitan.components.loss import cross_entropy_loss
        positions = self.positions
        if positions is None and self.loader_positions:
            positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1).contiguous()
        if positions is not None:  # a context-parallel rank's chunk (parallelize_cp)
            return cross_entropy_loss(self.model(tokens, positions=positions),
                                      labels) / self.global_tokens
        return cross_entropy_loss(self.model(tokens), labels) / self.global_tokens


def microbatches(pp: int) -> int:
    """Microbatches of a pipelined step: two, and at least one per stage
    (torchtitan's 1F1B refuses fewer)."""
    return max(2, pp)


def _parallelism(dp: int = 1, tp: int = 1, pp: int = 1, microbatch: int = 1, ep: int = 1,
                 cp: int = 1):
    from torchtitan.config import ParallelismConfig
    return ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                             pipeline_parallel_degree=pp, spmd_backend=titan_shim.SPMD_BACKEND,
                             pipeline_parallel_microbatch_size=microbatch,
                             expert_parallel_degree=ep, context_parallel_degree=cp,
                             context_parallel_load_balancer=None)


def build(flavor: str = "debugmodel", seqlen: int = 4, family: str = "llama3", ep: int = 1,
          layers: int | None = None, **_sizes) -> TitanLM:
    """torchtitan's ``family`` model (a package of ``torchtitan.models``) of
    ``flavor`` with its weights initialized on the CPU (``seqlen``: the
    step's sequence length, for pipeline stage shapes; ``layers``: the
    flavor's first blocks, or its blocks and copies of its last one)."""
    titan_shim.apply()
    registry = importlib.import_module(f"torchtitan.models.{family}").model_registry
    config = titan_shim.sdpa_attention(registry(flavor).model)
    if layers is not None:
        config.layers = with_blocks(config.layers, layers)
    config.update_from_config(config=SimpleNamespace(parallelism=_parallelism(ep=ep)))
    model = config.build()
    titan_shim.expert_outputs(model)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    lm = TitanLM(model, config, seqlen)
    lm.expert_parallel = ep > 1  # its experts' sharding names "ep"
    lm.parallelize_fn = registry(flavor).parallelize_fn  # the family's own (parallelize_qwen3, ...)
    return lm


def with_blocks(blocks: list, n: int) -> list:
    """``n`` block configurations: the first ``n`` of ``blocks``, or all of
    them and copies of the last (its own initialization scale)."""
    if n < 1:
        raise ValueError(f"backends.torch.titan: --layers {n}: give at least one block")
    return [copy.deepcopy(blocks[min(i, len(blocks) - 1)]) for i in range(n)]


def llama3_debugmodel(**sizes) -> TitanLM:
    return build("debugmodel", **sizes)


#: the models ``--model titan:NAME`` builds by family: NAME -> (the package
#: of ``torchtitan.models``, its flavor); ``NAME_ep`` is the same model
#: configured for expert parallelism (``expert_parallel_degree`` > 1, as
#: torchtitan's trainer configures it: its experts' sharding names "ep"),
#: on one device the same step. Each is parallelized by its family's own
#: function (``titan:parallelize``, ``titan:parallelize_ep``).
FAMILIES: dict[str, tuple[str, str]] = {
    "llama3": ("llama3", "debugmodel"),
    "qwen3": ("qwen3", "debugmodel"),
    "qwen3_moe": ("qwen3", "debugmodel_moe"),
    "deepseek_v3": ("deepseek_v3", "debugmodel"),
    "gpt_oss": ("gpt_oss", "debugmodel"),
    "kimi_k2_7": ("kimi_k2_7", "debugmodel"),
}
EP_SUFFIX = "_ep"
#: ``NAME_positions``: the same model, its step passing torchtitan's data
#: loader positions (``TitanLM.loader_positions``)
POSITIONS_SUFFIX = "_positions"


def _family_name(name: str) -> tuple[str, bool, bool] | None:
    """(the ``FAMILIES`` key, expert parallel, loader positions) of a
    factory name, None when it names none."""
    positions = name.endswith(POSITIONS_SUFFIX)
    base = name.removesuffix(POSITIONS_SUFFIX) if positions else name
    if base in FAMILIES:
        return base, False, positions
    if base.endswith(EP_SUFFIX) and base.removesuffix(EP_SUFFIX) in FAMILIES:
        return base.removesuffix(EP_SUFFIX), True, positions
    return None


def family_factory(name: str):
    """The model factory of ``FAMILIES[name]`` (``name`` may end in
    ``_ep``, then ``_positions``), a top-level function of this module by
    that name."""
    key, ep, positions = _family_name(name)
    family, flavor = FAMILIES[key]

    def factory(**sizes) -> TitanLM:
        lm = build(flavor, family=family, ep=2 if ep else 1, **sizes)
        lm.loader_positions = positions
        return lm

    factory.__name__ = factory.__qualname__ = name
    factory.__module__ = __name__
    factory.__doc__ = (f"torchtitan's {family} ``{flavor}``"
                       + (", configured for expert parallelism" if ep else "")
                       + (", its step given the data loader's positions" if positions else ""))
    return factory


def __getattr__(name: str):
    """``titan:NAME`` of ``FAMILIES`` (and ``NAME_ep``, ``NAME_positions``)
    as its factory."""
    if _family_name(name) is not None:
        return family_factory(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def retie(model: nn.Module) -> None:
    """What torchtitan's trainer does after parallelizing a model that ties
    its token table to its output projection: its ``init_weights`` starts by
    pointing ``tok_embeddings.weight`` at ``lm_head.weight`` again
    (``Decoder.init_states``), since parallelizing gave each module a
    parameter of its own. The values are kept: they are the build's, the
    weights a checkpoint gives every rank alike (torchtitan's random draws
    on DTensor shards are not the single-device draws on the CPU)."""
    if getattr(model, "enable_weight_tying", False):
        model.tok_embeddings.weight = model.lm_head.weight


def deepseek_v3_debugmodel(**sizes) -> TitanLM:
    """torchtitan's DeepSeek-V3 ``debugmodel`` (MLA attention, top-k routed
    MoE feed-forwards, a shared expert)."""
    return build("debugmodel", family="deepseek_v3", **sizes)


def deepseek_v3_debugmodel_ep(**sizes) -> TitanLM:
    """``deepseek_v3_debugmodel`` configured as torchtitan's trainer
    configures it for expert parallelism (``expert_parallel_degree`` > 1:
    its experts' sharding declares the "ep" dim); on one device the same
    model and step."""
    return build("debugmodel", family="deepseek_v3", ep=2, **sizes)


def parallelize_deepseekv3(model: TitanLM, mesh):
    """torchtitan's ``parallelize_deepseekv3`` on its own ``ParallelDims``
    mesh (FSDP2 over "dp", ``ep`` 1: its local token dispatch), the top-k
    routing recorded and replayed (docs/soundness.md, "Plans traced from
    PyTorch", 36); with tp > 1, its tensor-parallel plan (the attention's
    and the experts' own). Pipelining is refused (``parallelize_deepseekv3_ep``
    for expert parallelism)."""
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3 as apply
    if mesh["pp"].size() != 1:
        raise ValueError("backends.torch.titan:parallelize_deepseekv3 is not pipelined (--pp 1)")
    return parallelize(model, mesh, apply)


def parallelize_deepseekv3_ep(model: TitanLM, mesh):
    """torchtitan's ``parallelize_deepseekv3`` with expert parallelism over
    the data-parallel ranks (``ep`` = dp, torchtitan's dp2ep): each rank
    holds its share of the routed experts (``deepseek_v3_debugmodel_ep``), tokens
    dispatched to them by its all-to-all of uneven split sizes
    (docs/soundness.md, "Plans traced from PyTorch", 37)."""
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3 as apply
    if mesh["pp"].size() != 1:
        raise ValueError("backends.torch.titan:parallelize_deepseekv3_ep is not pipelined (--pp 1)")
    return parallelize(model, mesh, apply, ep=mesh["dp"].size())


def parallelize_ep(model: TitanLM, mesh):
    """The family's own parallelize function (``parallelize_qwen3``,
    ``parallelize_gptoss``, ...) with expert parallelism over the
    data-parallel ranks (``ep`` = dp, torchtitan's dp2ep), on a model built
    for it (``titan:NAME_ep``); as ``parallelize_deepseekv3_ep`` for any
    family (docs/soundness.md, "Plans traced from PyTorch", 37)."""
    if mesh["pp"].size() != 1:
        raise ValueError("backends.torch.titan:parallelize_ep is not pipelined (--pp 1)")
    if not getattr(model, "expert_parallel", False):
        raise ValueError("backends.torch.titan:parallelize_ep needs a model built for expert "
                         "parallelism: --model titan:NAME_ep")
    return parallelize(model, mesh, ep=mesh["dp"].size())


def _size(mesh, name: str) -> int:
    """The size of the backend mesh's dim ``name`` (1 when it has none)."""
    return mesh[name].size() if name in (mesh.mesh_dim_names or ()) else 1


def parallelize_cp(model: TitanLM, mesh):
    """torchtitan's ``parallelize_llama`` with context parallelism over "cp"
    (``--mesh cp=2``, with dp or tp beside it), as its trainer applies it:
    its ``ParallelDims`` with ``cp``, whose parallelize wraps every attention
    for CP's SDPA dispatcher (``apply_cp_to_forward``: q, k, v as DTensors
    cut along the sequence) and shards FSDP2 over dp x cp; the rank's
    positions are torchtitan's own ``cp_shard`` of the sequence's (no load
    balancer, so the rank's tokens are chunk c of the sequence, as the
    backend cuts them); CP's ring attention runs on the CPU through
    ``cp_shim``. The rotary table gathered at the rank's positions is one
    row per batch row (docs/soundness.md, "Plans traced from PyTorch",
    55)."""
    return _parallelize_cp(model, mesh, shift=0)


def parallelize_cp_other_chunk(model: TitanLM, mesh):
    """``parallelize_cp`` with a bug: the positions given to ``cp_shard``
    are the sequence's rolled by one chunk, so rank c rotates its tokens
    (chunk c) by the angles of chunk c + 1 (gloo differs)."""
    return _parallelize_cp(model, mesh, shift=model.seqlen // _size(mesh, "cp"))


def parallelize_cp_unshifted(model: TitanLM, mesh):
    """``parallelize_cp`` with a bug: every rank's positions start at 0
    (its chunk's own ``cp_shard`` positions less their first), so a rank
    past the first rotates its tokens by the first chunk's angles."""
    return _parallelize_cp(model, mesh, shift=0, from_zero=True)


def _parallelize_cp(model: TitanLM, mesh, shift: int, from_zero: bool = False, dims=None):
    from torchtitan.distributed.context_parallel import cp_shard

    from backends.torch.zoo import cp_shim
    cp_shim.apply()
    rows = model.global_tokens // (model.seqlen * _size(mesh, "dp"))
    positions = torch.arange(model.seqlen).roll(-shift).expand(rows, model.seqlen).contiguous()
    dims = dims or _dims(mesh)
    (model.positions,), _ = cp_shard(dims.get_mesh("cp"), (positions,), None, None)
    if from_zero:
        model.positions = model.positions - model.positions[:, :1]
    return parallelize(model, mesh, dims=dims)


def _dims(mesh, ep: int = 1):
    """torchtitan's ``ParallelDims`` of the backend mesh's sizes, its mesh built."""
    from torchtitan.distributed.parallel_dims import ParallelDims
    dp, cp, tp, pp = (_size(mesh, n) for n in ("dp", "cp", "tp", "pp"))
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=cp, tp=tp, pp=pp, ep=ep,
                        world_size=dp * cp * tp * pp, spmd_backend=titan_shim.SPMD_BACKEND)
    dims.build_mesh()
    return dims


def parallelize(model: TitanLM, mesh, apply=None, tie_again: bool = True, ep: int = 1,
                dims=None):
    """The model family's own parallelize function (``apply``, else the
    family's: torchtitan's ``parallelize_llama``, ``parallelize_qwen3``) on
    its own ``ParallelDims`` mesh of the backend's sizes, then the tie
    torchtitan's trainer makes again (``retie``) (``dp_shard`` = dp, ``tp``
    = tp); with ``pp`` > 1,
    torchtitan's ``pipeline_llm`` (its stage split, ``parallelize_llama`` on
    each stage, its 1F1B schedule, ``microbatches(pp)`` microbatches of the
    rank's rows), the rank keeping its stage."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.llama3.parallelize import parallelize_llama
    dp, cp, tp, pp = (_size(mesh, n) for n in ("dp", "cp", "tp", "pp"))
    dims = dims or _dims(mesh, ep)
    from torchtitan.distributed import utils as dist_utils
    dist_utils.set_spmd_backend(titan_shim.SPMD_BACKEND)  # as its trainer does from the config
    rows = model.global_tokens // (model.seqlen * dp)  # the rank's batch rows
    training = TrainingConfig(mixed_precision_param=titan_shim.PRECISION,
                              mixed_precision_reduce=titan_shim.PRECISION, local_batch_size=rows,
                              seq_len=model.seqlen)
    n_micro = microbatches(pp)
    if pp > 1 and rows % n_micro:
        raise ValueError(f"backends.torch.titan:parallelize pipelines {n_micro} microbatches: "
                         f"give each data-parallel rank a multiple of {n_micro} rows (--batch)")
    microbatch = max(1, rows // n_micro)
    common = {"parallel_dims": dims, "training": training,
              "parallelism": _parallelism(dp, tp, pp, microbatch, ep, cp),
              "compile_config": CompileConfig(), "ac_config": None, "dump_folder": "/tmp"}
    if pp == 1:
        (apply or getattr(model, "parallelize_fn", parallelize_llama))(model.model, **common)
        if tie_again:
            retie(model.model)
        return None
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    with titan_shim.static_stages(model.config, microbatch, model.seqlen,
                                  dims.get_mesh("tp") if tp > 1 else None):
        schedule, parts, _, _ = pipeline_llm(model.model, device=torch.device("cpu"),
                                             model_config=model.config,
                                             parallelize_fn=parallelize_llama,
                                             loss_fn=model.loss, **common)
    if len(parts) != 1:
        raise ValueError("backends.torch.titan:parallelize runs one stage per pipeline rank")
    model.model = parts[0]
    return PipelineStep(lambda tokens: schedule)
