"""Hugging Face transformers models, parallelized by transformers itself.

    python -m backends.torch --hf llama --dp 2 --tp 2

builds a causal language model of the family (any causal-LM model type of
the installed transformers, resolved through its auto mappings) from a
small configuration with random weights (nothing is downloaded), and in
every rank's process applies the family's own ``base_model_tp_plan`` and
FSDP2 plan through transformers' distributed API (``DistributedConfig``,
``initialize_distributed_mesh``, ``maybe_distribute_model``), unpatched.

The model factory (``--model backends.torch.hf:FAMILY``, the module's
``__getattr__``) wraps the transformers model in ``CausalLM``, whose
``forward(tokens, labels)``
calls it with ``shift_labels=labels`` (the labels are already the next
tokens: nothing is shifted or padded) and ``num_items_in_batch`` the token
count of the whole step, so the loss is the cross-entropy summed over the
rank's tokens divided by the step's count: each rank's share of the
step's mean, as transformers' ``ForCausalLMLoss`` computes it (a family
whose forward computes its own mean and takes no ``num_items_in_batch``
has that mean scaled by the rank's share of the step's tokens: the same
share).

The recipes (``--recipe backends.torch.hf:tp_fsdp``, ...) map the backend's
("pp", "dp", "tp") mesh onto a ``DistributedConfig``: ``tp_size`` = tp,
``fsdp_size`` = dp (``hsdp``: ``dp_replicate_size`` 2, ``fsdp_size`` dp / 2,
FSDP2's hybrid sharding, lowered: docs/soundness.md, "Plans traced from
PyTorch", 11).
transformers builds its own mesh ("pp", "dp_replicate", "fsdp", "tp"),
whose rank order is the backend's (a data-parallel rank d is replica
d // fsdp, shard d % fsdp).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from backends.torch.zoo import hf_hash_tables
from backends.torch.zoo.hf_float32 import Float32Read, reads_float32_wide
from backends.torch.zoo.hf_sub_fields import declared_names, needed_fields, rotary_fields, source_of
from backends.torch.zoo.hf_wide_fill import WideFill

#: transformers' attention kernel the models are built with: the eager one
#: (matmul, softmax) is plain aten on every device
ATTENTION = "eager"

#: names a configuration gives each size the backend's flags set (the first
#: it has; transformers' ``attribute_map`` resolves the standard names of
#: families that call them otherwise, such as GPT-2's ``n_embd``)
SIZE_FIELDS = {
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "feed_forward_size"),
    "seqlen": ("max_position_embeddings", "n_positions", "max_seq_len"),
    "kv": ("num_key_value_heads", "num_kv_heads"),
}
#: configuration fields that choose top-k routing of tokens to experts
ROUTING_FIELDS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k_experts")
#: configuration fields that count the experts a router chooses among
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                 "num_experts_routed", "n_experts", "num_moe_experts")
#: the routed experts and the experts per token of a family's small mixture
EXPERTS, TOP_K = 4, 2


class CausalLM(nn.Module):
    """A transformers causal LM with the backend's ``forward(tokens, labels)``."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        self.global_tokens = 1  # set by the backend to the step's label count
        #: transformers' eager experts loop runs no code for an expert no
        #: token chose (backends/torch/routing.py, check_every_expert_reached)
        self.skips_unrouted_experts = _first(hf.config, ROUTING_FIELDS) is not None
        #: a family whose loss is its own mean over the tokens it is given (its
        #: forward computes the cross-entropy itself and takes no
        #: ``num_items_in_batch``: BART's, CPM-Ant's, XLM's decoders)
        self.mean_loss = not _shares_its_loss(type(hf))
        #: the family's casts to float32 read as casts to float64
        #: (``hf_float32``; ``build`` sets it)
        self.float32_read_wide = False

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with contextlib.ExitStack() as modes:
            modes.enter_context(WideFill(_floating_dtype(self.hf)))  # XGLM's float64 bound
            if self.float32_read_wide:
                modes.enter_context(Float32Read())
            out = self.hf(input_ids=tokens, labels=labels, shift_labels=labels,
                          num_items_in_batch=self.global_tokens, use_cache=False)
        if self.mean_loss:  # the mean over the rank's tokens as its share of the step's
            return out.loss * (labels.numel() / self.global_tokens)
        return out.loss


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating parameter (float64 without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float64)


def _shares_its_loss(model_cls: type) -> bool:
    """Whether a causal-LM class's loss divides by ``num_items_in_batch``
    (transformers' ``loss_function``), read off its ``forward``'s source."""
    try:
        source = inspect.getsource(model_cls.forward)
    except (OSError, TypeError):
        return True
    return "loss_function" in source or "num_items_in_batch" in source


def families() -> tuple[str, ...]:
    """Every model type transformers maps to a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def classes(family: str) -> tuple[type, type]:
    """The configuration class and the causal-LM class of ``family``, from
    transformers' auto mappings."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"'{family}' is not a causal-LM model type of transformers "
                         f"{transformers.__version__} (e.g. {', '.join(families()[:6])}, ...)")
    from transformers import CONFIG_MAPPING
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family], None)
    if model_cls is None:
        raise ValueError(f"transformers has no class {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]} "
                         f"for '{family}'")
    return CONFIG_MAPPING[family], model_cls


def refusal(family: str, tp: int) -> str | None:
    """Why the backend cannot trace ``family`` at tensor-parallel degree
    ``tp`` (None when it can): a composite model (a vision or audio tower
    beside the text model), or TP for a family without a tensor-parallel
    plan, or patches decided by computed values (BLT's entropy patcher), or
    a causal-LM class that takes no labels (Gemma 4's assistant, a drafter
    fed the target model's embeddings and key-values).
    A family that routes tokens to its top-k experts is traced with
    its routing recorded (docs/soundness.md, "Plans traced from PyTorch",
    35)."""
    cfg_cls, model_cls = classes(family)
    if "labels" not in inspect.signature(model_cls.forward).parameters:
        needs = [n for n in inspect.signature(model_cls.forward).parameters
                 if n not in ("self", "input_ids", "kwargs", "use_cache")]
        return (f"'{family}''s {model_cls.__name__} takes no labels and computes no loss (its "
                f"forward reads {', '.join(needs)}: another model's outputs, a drafter's): "
                f"there is no training step to verify")
    default = _default(cfg_cls)
    subs = tuple(getattr(default, "sub_configs", None) or ())
    if any(n == "text_config" or "vision" in n or "audio" in n for n in subs):
        towers = ", ".join(subs)
        return (f"'{family}' is a composite model ({towers}): give its text model's type "
                f"(the backend builds text-only causal LMs)")
    if getattr(default, "patching_mode", None) == "entropy" and getattr(
            default, "patch_in_forward", False):
        return (f"'{family}' patches by entropy (patching_mode 'entropy'): its patcher's own "
                f"model computes each byte's entropy from the ids, and the patches' count and "
                f"lengths are read back with .item() from where it exceeds patching_threshold "
                f"(shapes decided by computed values, aten._local_scalar_dense); static "
                f"one-byte patches (tests/blt_models.py blt_static) reach aten.unfold of the "
                f"ids (the hashed byte n-grams), not lowered yet")
    if tp > 1 and not default.base_model_tp_plan:
        return (f"'{family}' has no tensor-parallel plan (base_model_tp_plan): run it with --tp 1 "
                f"(FSDP2 or DDP over dp)")
    return None


def default_build_error(family: str) -> str | None:
    """Why transformers cannot build ``family``'s causal LM from the
    family's own default configuration (on the meta device: no memory), or
    None when it can."""
    cfg_cls, model_cls = classes(family)
    try:
        with torch.device("meta"):
            model_cls(cfg_cls())
    except Exception as e:  # noqa: BLE001 - any failure of the family's own default is the answer
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    return None


def _default(cfg_cls) -> object:
    """The family's default configuration, whose fields read as the family's
    global values even where a family configures them per layer (Dots3's
    ``kv_lora_rank``: transformers refuses a global read unless
    ``allow_global_per_layer_attribute_access``); read only to fit sizes."""
    default = cfg_cls()
    if hasattr(type(default), "allow_global_per_layer_attribute_access"):
        default.allow_global_per_layer_attribute_access = True
    return default


def _first(default, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if _has(default, n)), None)


def _has(default, name: str) -> bool:
    """Whether the configuration has ``name`` (a field read per layer, such
    as Gemma 4's ``head_dim``, refuses a global read but is a field)."""
    try:
        return hasattr(default, name)
    except Exception:  # noqa: BLE001 - transformers' per-layer refusal of a global read
        return name in default.to_dict()


def _layer_shapes(default, layers: int, hidden: int, heads: int, seqlen: int) -> dict:
    """The per-layer and per-head fields a family's configuration checks
    against the sizes, fitted to them: a rotary dimension no wider than a
    head, the encoder's and decoder's head counts, a list of attention kinds
    cut to the layer count (the family's own pattern, from its first layer),
    no layers sharing another's key-value cache, and a
    Mamba mixer's heads dividing its expanded width. Each applies only where
    the family has the field, whatever the family."""
    kw: dict = {}
    if isinstance(getattr(default, "rotary_dim", None), int):
        kw["rotary_dim"] = min(default.rotary_dim, hidden // heads)
    for name in ("encoder_attention_heads", "decoder_attention_heads"):
        if isinstance(getattr(default, name, None), int):
            kw[name] = heads
    for name in ("d_head", "attention_head_size"):  # XLNet's, Reformer's head width
        if isinstance(getattr(default, name, None), int):
            kw[name] = hidden // heads
    if isinstance(getattr(default, "num_kv_shared_layers", None), int):
        kw["num_kv_shared_layers"] = 0
    if isinstance(getattr(default, "attention_layers", None), list) and \
            isinstance(getattr(default, "attention_types", None), list):
        kinds = [default.attention_layers[i % len(default.attention_layers)]
                 for i in range(layers)]
        kw["attention_types"] = [[[kind], 1] for kind in kinds]
    if isinstance(getattr(default, "qk_rope_head_dim", None), int):
        # latent attention: its rotary, plain and value head widths fitted to
        # a head (the rotary one is the configuration's head_dim), its
        # low-rank projections to the hidden size
        for name in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if isinstance(getattr(default, name, None), int):
                kw[name] = hidden // heads
        for name in ("kv_lora_rank", "q_lora_rank"):
            if isinstance(getattr(default, name, None), int):
                kw[name] = hidden
    # a mixture's routed layers from the first one on, so that a one-layer
    # model routes (a family that keeps its first layers dense would trace
    # no router at the backend's sizes), and its experts in one group
    for name in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index",
                 "expert_layer_offset"):
        if isinstance(getattr(default, name, None), int):
            kw[name] = 0
    if isinstance(getattr(default, "mlp_only_layers", None), list):
        kw["mlp_only_layers"] = []
    types = getattr(default, "mlp_layer_types", None)
    if isinstance(types, list) and "sparse" in types:
        kw["mlp_layer_types"] = ["sparse"] * layers
    for name in ("n_group", "topk_group"):
        if isinstance(getattr(default, name, None), int):
            kw[name] = 1
    expand = getattr(default, "mamba_expand", None)
    if isinstance(getattr(default, "mamba_n_heads", None), int) and isinstance(expand, int) \
            and getattr(default, "mamba_d_ssm", None) is None:  # a width of its own: kept
        kw["mamba_n_heads"] = heads
        if isinstance(getattr(default, "mamba_d_head", None), int):
            kw["mamba_d_head"] = expand * hidden // heads
    kw.update(_ssm_heads(default, hidden, heads))
    kw.update(_axial(default.to_dict(), hidden, seqlen))
    return kw


def _axial(fields: dict, hidden: int, seqlen: int) -> dict:
    """Axial position embeddings (Reformer's) fitted to the sizes: a list
    of factors whose product is the family's default position count
    (``axial_pos_shape``, which training requires to multiply to the
    sequence length) as two factors of ``seqlen``, a list of widths that sum
    to its default hidden size (``axial_pos_embds_dim``) as widths in the
    same proportions summing to ``hidden``, and a chunk length of chunked
    attention (``*_chunk_length``) the whole sequence (a sequence no longer
    than a chunk is attended whole, without hashing)."""
    kw: dict = {}
    positions, width = fields.get("max_position_embeddings"), fields.get("hidden_size")
    for name, value in fields.items():
        if name.endswith("_chunk_length") and isinstance(value, int):
            kw[name] = seqlen
        if not (isinstance(value, list) and len(value) == 2
                and all(isinstance(v, int) and v > 0 for v in value)):
            continue
        if math.prod(value) == positions:
            first = max(d for d in range(1, math.isqrt(seqlen) + 1) if seqlen % d == 0)
            kw[name] = [first, seqlen // first]
        elif sum(value) == width:
            first = max(1, hidden * value[0] // width)
            kw[name] = [first, hidden - first]
    return kw


def _ssm_heads(default, hidden: int, heads: int) -> dict:
    """A state-space mixer whose heads tile its expanded width
    (``num_heads * head_dim == expand * hidden_size`` in the family's own
    default, Mamba-2's check): ``heads`` heads as wide as that width needs,
    and its groups of heads (``n_groups``) as many as still divide them."""
    fields = default.to_dict()
    expand, n, width = (fields.get(k) for k in ("expand", "num_heads", "head_dim"))
    if not all(isinstance(v, int) and v > 0 for v in (expand, n, width)) \
            or n * width != expand * fields.get("hidden_size", 0) or expand * hidden % heads:
        return {}
    kw = {"num_heads": heads, "head_dim": expand * hidden // heads}
    if isinstance(fields.get("n_groups"), int):
        kw["n_groups"] = math.gcd(fields["n_groups"], heads)
    return kw


#: configuration fields that list each layer's kind (attention, linear
#: attention, a hybrid block)
KIND_FIELDS = ("layer_types", "layers_block_type")


def _kinds_field(default) -> str | None:
    """The field of ``default`` listing each layer's kind, when it has one."""
    fields = default.to_dict()
    return next((n for n in KIND_FIELDS if isinstance(fields.get(n), list) and fields[n]
                 and all(isinstance(k, str) for k in fields[n])), None)


def _kinds(default, layers: int) -> list[str] | None:
    """Each of ``layers`` layers' kind, the family's own pattern from its
    first layer with every kind it has at least once (a missing kind in
    place of the last layers, as OLMo-Hybrid's configuration forces its
    full attention): None when the family has no such list or more kinds
    than layers."""
    name = _kinds_field(default)
    if name is None:
        return None
    pattern = list(default.to_dict()[name])
    kinds = list(dict.fromkeys(pattern))
    if len(kinds) > layers:
        return None
    fitted = [pattern[i % len(pattern)] for i in range(layers)]
    missing = [k for k in kinds if k not in fitted]
    if missing:
        fitted[len(fitted) - len(missing):] = missing
    return fitted


def fewest_layers(family: str) -> int:
    """The fewest layers a model of ``family`` builds with: 1, or, when its
    configuration or model refuses one (a hybrid that needs each of its
    kinds of layer; RWKV's initialization divides by the layer count less
    one), as many as it has kinds, at least 2 (1 when neither builds: its
    row says why)."""
    cfg_cls, model_cls = classes(family)
    name = _kinds_field(_default(cfg_cls))
    kinds = len(set(_default(cfg_cls).to_dict()[name])) if name else 1
    for layers in dict.fromkeys((1, max(2, kinds))):
        try:
            model_cls(config(family, layers=layers, hidden=16, heads=4, ffn=32, vocab=16,
                             seqlen=4))  # tiny: built and initialized as the step will be
            return layers
        except Exception:  # noqa: BLE001 - any refusal of this count: the next one
            continue
    return 1


def _fitted(cfg_cls, default, layers: int, hidden: int, heads: int, ffn: int, vocab: int,
            seqlen: int) -> dict:
    """The fields ``config`` sets on ``default`` (of class ``cfg_cls``), and
    on each part it configures apart."""
    kw: dict = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, tie_word_embeddings=False)
    fields = default.to_dict()
    # an encoder-decoder family's causal LM is its decoder: both stacks get
    # the layer count (bart's decoder kept 12 layers where
    # ``num_hidden_layers`` names its encoder's)
    for name in ("encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers"):
        if isinstance(fields.get(name), int):
            kw[name] = layers
    # a causal LM is a decoder (a BERT-like family's LM head attends causally
    # only so; Reformer's refuses to build otherwise)
    if fields.get("is_decoder") is False:
        kw["is_decoder"] = True
    # adapters by language (X-MOD): the first one the family names
    if fields.get("default_language", 0) is None and fields.get("languages"):
        kw["default_language"] = fields["languages"][0]
    # latent attention (a key-value low-rank projection) makes one key and
    # value per query head: grouped-query heads would be repeated again
    grouped = heads % 2 == 0 and getattr(default, "kv_lora_rank", None) is None
    sizes = {"ffn": ffn, "seqlen": max(seqlen, 8), "kv": heads // 2 if grouped else heads}
    for size, names in SIZE_FIELDS.items():
        name = _first(default, names)
        if name is not None:
            kw[name] = sizes[size]
    # a size the family derives and refuses to be given (ProphetNet's layer
    # count, XLNet's unlimited positions): a property of the class
    for name in [n for n in kw if isinstance(getattr(cfg_cls, n, None), property)]:
        if name not in fields:
            del kw[name]
    if _has(default, "head_dim") and not isinstance(getattr(cfg_cls, "head_dim", None), property):
        kw["head_dim"] = hidden // heads  # also where the default leaves it None
    kw.update(_layer_shapes(default, layers, hidden, heads, seqlen))
    # linear attention's own heads (Gated DeltaNet: Qwen3.5, Qwen3-Next; Kimi Delta
    # Attention: Kimi Linear), as small as the others
    linear = {"linear_key_head_dim": hidden // heads, "linear_value_head_dim": hidden // heads,
              "linear_num_key_heads": sizes["kv"], "linear_num_value_heads": heads,
              "linear_head_dim": hidden // heads, "linear_num_heads": heads}
    kw.update({k: v for k, v in linear.items() if isinstance(getattr(default, k, None), int)})
    if getattr(default, "moe_intermediate_size", None) is not None:
        kw["moe_intermediate_size"] = ffn
    if getattr(default, "sliding_window", None) is not None:
        kw["sliding_window"] = max(seqlen // 2, 1)
    experts = _first(default, EXPERT_FIELDS)
    routed = _first(default, ROUTING_FIELDS)
    if experts is not None and routed is not None and _mixture(default, experts):
        # a small mixture, so that a small batch gives every expert tokens on
        # every rank (an expert with no token on a rank: docs/torch-backend.md)
        kw[experts] = min(getattr(default, experts) or EXPERTS, EXPERTS)
        # a shared expert's count the default leaves unset while the model
        # multiplies by it (Dots1's ``n_shared_experts``): one
        if "n_shared_experts" in fields and fields["n_shared_experts"] is None:
            kw["n_shared_experts"] = 1
        # a family may leave the count unset (deepseek_v2's num_experts_per_tok)
        kw[routed] = min(getattr(default, routed) or TOP_K, TOP_K)
    for name, value in default.to_dict().items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            kw[name] = 0.0
        if (name.startswith("vocab_size_") or name.endswith("_vocab")) \
                and isinstance(value, int) and value > vocab:
            kw[name] = vocab  # a second table's rows (gemma3n's per-layer inputs, BLT's hashes)
        if name.startswith("hidden_size_") and isinstance(value, int):
            kw[name] = hidden  # another part's width (BLT's global transformer)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(default, name, None)
        if isinstance(ids, int) and ids >= vocab:
            kw[name] = vocab - 1
        elif isinstance(ids, list) and any(i >= vocab for i in ids):
            kw[name] = [vocab - 1]
    # a list of layer kinds the default leaves unset where the model reads
    # one per layer (LFM2-MoE's ``layer_types``): transformers' standard
    # kind, full attention, as LFM2's own default makes every layer
    if "layer_types" in fields and fields["layer_types"] is None:
        kw["layer_types"] = ["full_attention"] * layers
    # rotary parameters keyed by kind of layer that the family's default
    # leaves empty (Cohere Compass reads ``rope_parameters[kind]``): the
    # default rotary for each kind
    kinds_name = _kinds_field(default)
    if fields.get("rope_parameters") == {} and kinds_name is not None:
        kw["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                 for kind in dict.fromkeys(fields[kinds_name])}
    # the parts a family configures apart (BLT's encoder, decoder, global
    # transformer and patcher), each as small
    for name in getattr(default, "sub_configs", None) or {}:
        part = getattr(default, name, None)
        if hasattr(part, "to_dict") and part is not default:
            kw[name] = type(part)(**_fitted(type(part), part, layers, hidden, heads, ffn, vocab,
                                            seqlen),
                                  **rotary_fields(source_of(cfg_cls), name, part,
                                                  kw.get("rope_parameters",
                                                         getattr(default, "rope_parameters", None))),
                                  **needed_fields(source_of(cfg_cls), part))
    return kw


def _mixture(default, experts: str) -> bool:
    """Whether the family's default has a mixture of experts: a count of
    them, or, where it leaves the count unset (Dots1's ``n_routed_experts``
    None), the width of each expert (``moe_intermediate_size``): a family
    whose count None means no mixture (Gemma 4's) leaves that width unset
    too."""
    count = getattr(default, experts)
    return isinstance(count, int) or (
        count is None and isinstance(getattr(default, "moe_intermediate_size", None), int))


def routes(default) -> bool:
    """Whether a family's default configuration routes tokens to top-k
    experts as the backend builds it: a count of experts per token, or a
    mixture whose counts the default leaves unset (``_mixture``)."""
    if any(getattr(default, f, None) for f in ROUTING_FIELDS):
        return True
    experts, routed = _first(default, EXPERT_FIELDS), _first(default, ROUTING_FIELDS)
    return experts is not None and routed is not None and _mixture(default, experts)


def config(family: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int, seqlen: int):
    """A small configuration of ``family``: the backend's sizes in whichever
    fields the family's configuration has (grouped-query attention with half
    as many key-value heads when the head count is even, except under
    latent attention, ``head_dim`` hidden
    / heads), every dropout probability 0 (dropout draws random numbers),
    a sliding window, where the family has one, of half the sequence (so
    it masks), special token ids outside the small vocabulary moved to its
    last id, linear attention's heads as many and as wide as the
    others, the rows of other tables looked up by the ids
    (``vocab_size_*``, ``*_vocab``) cut to the vocabulary, the parts a
    family configures apart (``sub_configs``) as small, untied input and
    output embeddings (transformers 5.23's ``apply_tensor_parallelism`` fails on a tied ``lm_head``: KeyError
    'lm_head.weight'), and everything else the family's default."""
    cfg_cls, _ = classes(family)
    default = _default(cfg_cls)
    kw = declared_names(cfg_cls, _fitted(cfg_cls, default, layers, hidden, heads, ffn, vocab,
                                         seqlen))
    try:
        cfg = cfg_cls(**kw)
    except Exception:
        # a hybrid whose own list of layer kinds refuses the layer count
        # (Zamba's three first kinds, OLMo-Hybrid's two): the family's
        # pattern with each kind at least once, when the count allows it
        name, kinds = _kinds_field(default), _kinds(default, layers)
        if name is None:
            raise
        if kinds is None:
            every = sorted(set(default.to_dict()[name]))
            raise ValueError(f"'{family}' is built with each of its kinds of layer "
                             f"({', '.join(every)}): --layers {len(every)} or more") from None
        cfg = cfg_cls(**{**kw, name: kinds})
    cfg._attn_implementation = ATTENTION
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"  # grouped_mm takes no float64 on the CPU
    return cfg


def build(family: str, **sizes) -> CausalLM:
    """The family's causal LM from ``config``, randomly initialized, with
    the family's ties other than its word embeddings' (``tie_shared``)."""
    _, model_cls = classes(family)
    model = model_cls(config(family, **sizes))
    tie_shared(model)
    hf_hash_tables.fill(model)  # a hash router's table, zeros until a checkpoint fills it
    out = CausalLM(model)
    out.float32_read_wide = reads_float32_wide(model, sizes["seqlen"])
    return out


def tie_shared(model: nn.Module) -> list[tuple[str, str]]:
    """Tie the weights the family ties (its ``_tied_weights_keys``) that are
    no word embedding's or head's, as ``tie_weights`` would: Zamba's one attention
    block shared by its hybrid layers. transformers 5.23 ties none of a
    model's weights when ``tie_word_embeddings`` is off, which ``config``
    turns off for the head's sake: left so, a family whose layers share a
    block would be built with a block per layer, another model. The pairs
    (target, source) tied."""
    mapping = _tied_pairs(model)
    # the word embeddings and the head (its weight, and its bias that BERT's
    # head ties to the prediction bias) stay as ``config`` left them
    words = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings()
    if head is not None:
        words |= {id(p) for p in head.parameters()}
    tied = []
    for target, source in mapping.items():
        t, s = model.get_parameter(target), model.get_parameter(source)
        if id(t) in words or id(s) in words or t is s:
            continue
        parent, _, attr = target.rpartition(".")
        setattr(model.get_submodule(parent), attr, s)
        tied.append((target, source))
    return tied


def __getattr__(name: str):
    """``backends.torch.hf:FAMILY`` is the model factory of any causal-LM
    model type of transformers (``build`` with the family bound)."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in families():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return functools.partial(build, name)


def distribute(model: CausalLM, mesh, dp_replicate: int = 1,
               divide_factor: float | None = 1.0, tp_plan: dict[str, str] | None = None,
               ep: int = 1):
    """Apply transformers' own parallelism to ``model.hf`` for the backend's
    mesh: TP over "tp", FSDP2 over "dp" (``dp_replicate`` replicas of
    ``dp // dp_replicate`` shards). The loss is shared out over
    the step's tokens, so FSDP's gradient divide factor is 1 (the replicas'
    gradients summed) unless ``divide_factor`` says otherwise (None: FSDP's
    default, the mean over the data-parallel ranks). ``tp_plan`` overrides
    rules of the family's plan (``DistributedConfig.tp_plan``)."""
    from transformers.distributed import DistributedConfig, initialize_distributed_mesh
    if mesh["pp"].size() != 1:
        raise ValueError("the Hugging Face recipes do not pipeline (--pp 1)")
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    if dp % dp_replicate:
        raise ValueError(f"dp {dp} is not a multiple of {dp_replicate} replicas")
    extra = {"ep_size": ep, "ep_implementation": "all_to_all"} if ep > 1 else {}
    cfg = DistributedConfig(tp_size=tp, fsdp_size=dp // dp_replicate, dp_replicate_size=dp_replicate,
                            tp_plan=tp_plan, **extra)
    _, mesh_manager = initialize_distributed_mesh(cfg)
    hf = type(model.hf).maybe_distribute_model(model.hf, cfg, mesh_manager)
    model.hf = hf
    if cfg.dp_size > 1 and divide_factor is not None:
        for module in hf.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide_factor)
    return reduce_partials


def reduce_partials(model, mesh) -> None:
    """Bring DTensor gradients to their parameter's placements (what the
    optimizer step or gradient clipping does first): partial sums reduced,
    and a replicated gradient of a sharded parameter (DTensor's backward of
    the vocabulary-parallel embedding) cut to the parameter's shard."""
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)


def tp_fsdp(model, mesh):
    """transformers' TP plan over "tp" and its FSDP2 plan over "dp"."""
    return distribute(model, mesh)


def hsdp(model, mesh):
    """tp_fsdp with two FSDP replicas (HSDP: ``dp_replicate_size`` 2)."""
    return distribute(model, mesh, dp_replicate=2)


def tp_fsdp_avg(model, mesh):
    """tp_fsdp keeping FSDP's default divide factor (the mean over the
    data-parallel ranks) with the loss shared out over the step: every
    gradient 1/dp of the single-device one (the class of pytorch PR 167178)."""
    return distribute(model, mesh, divide_factor=None)


def ep_fsdp(model, mesh):
    """transformers' expert-parallel plan (``base_model_ep_plan``) over the
    data-parallel ranks (ep = dp: ``DistributedConfig(ep_size=dp)``, its
    all-to-all token dispatch) with its FSDP2 plan over "dp" and TP over
    "tp"."""
    return distribute(model, mesh, ep=mesh["dp"].size() * mesh["tp"].size())


def ddp(model, mesh):
    """PyTorch's DDP over "dp" with a comm hook that sums the bucket (the
    loss is already each rank's share of the step's mean): the recipe for a
    family without a tensor-parallel plan, as for any other."""
    from torch.nn.parallel import DistributedDataParallel
    if mesh["tp"].size() != 1:
        raise ValueError("the Hugging Face ddp recipe is data parallel only (--tp 1)")
    group = mesh["dp"].get_group()
    wrapped = DistributedDataParallel(model, process_group=group)
    wrapped.register_comm_hook(group, _summed)
    return wrapped


def _summed(group, bucket):
    import torch.distributed as dist
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def fsdp_grouped(model, mesh):
    """FSDP2 over "dp" written by hand, as PyTorch asks of shared
    parameters: the decoder layers that share parameters (Zamba's one
    attention block in each hybrid layer) sharded as one group,
    ``fully_shard([layer_a, layer_b])``, every other layer as its own, then
    the root; the gradients summed (divide factor 1). transformers' own
    FSDP2 plan shards each layer apart, which PyTorch refuses for a
    parameter two layers share ("already managed by another FSDP group")."""
    from torch.distributed.fsdp import fully_shard
    if mesh["tp"].size() != 1:
        raise ValueError("fsdp_grouped is data parallel only (--tp 1)")
    for group in _sharing(list(model.hf.model.layers)):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    return None


def _sharing(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """The layers in groups that share no parameter with one another (in
    order of their first layer)."""
    groups: list[tuple[set[int], list[nn.Module]]] = []
    for layer in layers:
        ids = {id(p) for p in layer.parameters()}
        joined = [g for g in groups if g[0] & ids]
        merged = (ids.union(*(g[0] for g in joined)),
                  [m for g in joined for m in g[1]] + [layer])
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    order = {id(layer): k for k, layer in enumerate(layers)}
    return sorted((g[1] for g in groups), key=lambda ms: order[id(ms[0])])


def ddp_per_layer(model, mesh):
    """A wrong plan: gradients summed over "dp" by hand, layer by layer
    (each layer's ``parameters()``, then the rest of the model's): a
    parameter two layers share (Zamba's attention block) is summed once per
    layer that holds it, dp times the single-device gradient at the
    second sum."""
    if mesh["tp"].size() != 1:
        raise ValueError("ddp_per_layer is data parallel only (--tp 1)")
    return _sum_per_layer


def _sum_per_layer(model, mesh) -> None:
    import torch.distributed._functional_collectives as funcol
    layers = list(model.hf.model.layers)
    inside = {id(p) for layer in layers for p in layer.parameters()}
    rest = [p for p in model.parameters() if id(p) not in inside]
    for params in [*(list(layer.parameters()) for layer in layers), rest]:
        for p in params:
            if p.grad is not None:
                p.grad.copy_(funcol.all_reduce(p.grad, "sum", mesh["dp"]))


def _tied_pairs(model: nn.Module) -> dict[str, str]:
    """Every module's ``_tied_weights_keys`` expanded to parameter names
    (target -> source), as transformers expands them (patterns searched
    from the start of the module's names, the sources cycled over the
    targets), a pattern that matches nothing tying nothing (Zamba's shared
    block with one hybrid layer; transformers raises there)."""
    pairs: dict[str, str] = {}
    for prefix, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None)
        if not isinstance(keys, dict):
            continue
        names = sorted(n for n, _ in module.named_parameters(remove_duplicate=False))
        lead = f"{prefix}." if prefix else ""
        for target, source in keys.items():
            sources = [n for n in names if re.search("^" + source, n)]
            targets = [n for n in names if re.search("^" + target, n)]
            if not sources or not targets or len(targets) % len(sources):
                continue
            for t, src in zip(targets, itertools.cycle(sources)):
                pairs[lead + t] = pairs.get(lead + src, lead + src)
    return pairs


def ddp_avg(model, mesh):
    """A wrong plan: plain DDP, which averages the gradients over "dp", with
    the loss already shared out over the step's tokens (the divide applied
    twice: every gradient 1/dp of the single-device one)."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, process_group=mesh["dp"].get_group())


def _plan_with(model: CausalLM, change: str, to: str, first_only: bool = True) -> dict[str, str]:
    """Rules of the family's own tensor-parallel plan of style ``change``
    planned ``to`` instead (the first, or every one; ValueError if none)."""
    plan = dict(model.hf.config.base_model_tp_plan or {})
    rules = [k for k, v in plan.items() if v == change][:1 if first_only else None]
    if not rules:
        raise ValueError(f"the family's tensor-parallel plan has no '{change}' rule")
    prefix = f"{model.hf.base_model_prefix}." if model.hf.base_model_prefix else ""
    return {prefix + rule: to for rule in rules}


#: the style of ``tp_rowwise_not_reduced``: transformers' rowwise linear whose
#: output is left as each rank's partial sum (registered by that recipe only)
UNREDUCED_ROWWISE = "rowwise_output_partial"


def tp_rowwise_not_reduced(model, mesh):
    """A wrong plan: the family's plan with its first ``rowwise`` rule (an
    attention output projection, typically) keeping its output partial: a
    rowwise linear with no all-reduce after it, each rank going on with its
    own heads' share of the projection."""
    from torch.distributed.tensor import Partial, Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, RowwiseParallel
    ALL_PARALLEL_STYLES.register(UNREDUCED_ROWWISE, RowwiseParallel(
        input_layouts=Shard(-1), output_layouts=Partial()))
    return distribute(model, mesh, tp_plan=_plan_with(model, "rowwise", UNREDUCED_ROWWISE))


def tp_mla_rope_not_reduced(model, mesh):
    """A wrong plan: the family's ``mla_kv_a_proj`` rules (latent attention's
    shared projection, whose rotary part skips the column-parallel ``kv_b_proj``)
    planned "replicate", so the rotary part's gradient, a sum over every
    rank's heads, stays each rank's own share."""
    return distribute(model, mesh, tp_plan=_plan_with(
        model, "mla_kv_a_proj", "replicate", first_only=False))


def tp_norm_grads_not_reduced(model, mesh):
    """A wrong plan: every ``replicated_with_grad_allreduce`` rule of the
    family's plan (Qwen3's and Gemma3's per-head ``q_norm``/``k_norm``)
    planned "replicate", so each tensor-parallel rank keeps the gradient of
    its own heads' share."""
    return distribute(model, mesh, tp_plan=_plan_with(
        model, "replicated_with_grad_allreduce", "replicate", first_only=False))
