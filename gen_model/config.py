"""Model and parallelism settings, and the plan file names they give."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields

MODELS = ("mlp", "llama3", "moe")


class ConfigError(ValueError):
    """Settings that do not describe a model or a parallelization of it."""


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of one model. Zero means 'not used by this model'."""

    model: str
    layers: int = 2
    hidden: int = 128
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0
    vocab: int = 0
    seqlen: int = 0
    experts: int = 0
    topk: int = 0
    capacity_factor: float = 1.0
    first_dense: int = 0
    moe_ffn: int = 0
    #: "cross_entropy" against labels (the default), or "sum": the plain sum of
    #: the logits, kept for the smallest examples (docs/plan-format.md)
    loss: str = "cross_entropy"
    #: the optimizer step after the gradients: none, sgd (with weight decay),
    #: adam or adamw (gen_model/autodiff.py OPTIMIZER_KWARGS)
    optimizer: str = "none"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.heads else 0

    @property
    def capacity(self) -> int:
        """Expert slots per sample: ceil(seqlen * topk / experts * capacity_factor)."""
        if not self.experts:
            return 0
        return max(1, math.ceil(self.seqlen * self.topk * self.capacity_factor / self.experts))

    def check(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"unknown model '{self.model}' (choose from {', '.join(MODELS)})")
        if self.optimizer not in ("none", "sgd", "adam", "adamw"):
            raise ConfigError(f"unknown optimizer '{self.optimizer}' (none, sgd, adam, adamw)")
        if self.loss not in ("cross_entropy", "sum"):
            raise ConfigError(f"unknown loss '{self.loss}' (cross_entropy or sum)")
        if self.layers < 1 or self.hidden < 1:
            raise ConfigError("--layers and --hidden must be at least 1")
        if not (math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
            raise ConfigError(f"--capacity_factor must be a positive number, got {self.capacity_factor}")
        if self.model == "mlp":
            return
        for name in ("heads", "kv_heads", "ffn", "vocab", "seqlen"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1 for {self.model}")
        if self.hidden % self.heads:
            raise ConfigError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"--heads {self.heads} is not divisible by --kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} must be even for rotary embedding")
        if self.model == "moe":
            if self.experts < 1 or not 1 <= self.topk <= self.experts:
                raise ConfigError("--experts must be >= 1 and 1 <= --topk <= --experts")
            if self.moe_ffn < 1:
                raise ConfigError("--moe_ffn must be at least 1")
            if not 0 <= self.first_dense <= self.layers:
                raise ConfigError("--first_dense must be between 0 and --layers")


@dataclass(frozen=True)
class Parallelism:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    nm: int = 1
    cp: int = 1  # context parallel: the sequence split across ranks

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def experts_over_tp(self) -> bool:
        """Whether the expert-parallel group spans the tensor-parallel ranks too.

        When ep divides dp, experts are spread over ep data-parallel ranks and
        each expert's ffn dim is split across tp. Otherwise (ep = k * tp with k
        dividing dp) experts are spread over k data-parallel ranks times all tp
        ranks, whole: expert tensor parallelism 1, as in Megatron's MoE folding.
        """
        return self.dp % self.ep != 0

    @property
    def ep_dp(self) -> int:
        """How many data-parallel ranks of the expert-parallel group there are."""
        return self.ep // self.tp if self.experts_over_tp else self.ep

    def is_single(self) -> bool:
        return all(getattr(self, f.name) == 1 for f in fields(self))


VARIANT = re.compile(r"^(default|br\d+)$")


def check_run(gbs: int, variant: str) -> None:
    if gbs < 1:
        raise ConfigError(f"--gbs must be at least 1, got {gbs}")
    if not VARIANT.match(variant):
        raise ConfigError(f"--variant must be 'default' or br<N>, got '{variant}'")


def plan_stem(cfg: ModelConfig, par: Parallelism, gbs: int, variant: str = "default") -> str:
    """{model}_{variant}_dp{D}_pp{P}_tp{T}_nm{M}_gbs{G}_ly{L}_h{H}_hi{I}_sq{S}[_ep{E}_a{A}_r{R}][_cp{C}]."""
    stem = (
        f"{cfg.model}_{variant}_dp{par.dp}_pp{par.pp}_tp{par.tp}_nm{par.nm}_gbs{gbs}"
        f"_ly{cfg.layers}_h{cfg.heads}_hi{cfg.hidden}_sq{cfg.seqlen}"
    )
    if cfg.model == "moe":
        stem += f"_ep{par.ep}_a{cfg.topk}_r{cfg.experts}"
    if par.cp > 1:
        stem += f"_cp{par.cp}"
    return stem


def world_spec(cfg: ModelConfig, par: Parallelism, gbs: int, variant: str = "default") -> dict:
    """The JSON world spec written beside a plan file."""
    spec = {"model": cfg.model, "variant": variant, "gbs": gbs, **asdict(par)}
    if par.cp == 1:
        del spec["cp"]  # recorded only when the sequence is split
    spec.update({k: v for k, v in asdict(cfg).items() if k != "model"})
    spec["capacity"] = cfg.capacity
    return spec
