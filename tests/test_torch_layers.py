"""Stock torch.nn layers through the torch backend: each layer's lowering
computes, in float64 on the traced run's own values, the loss and the
gradients PyTorch computed (backends/torch/tracer/check.py), and a GPT-2 style
model verifies under a data-parallel recipe while a wrong one fails.

Each probe is a tiny model (``factory(**sizes)`` with ``forward(tokens,
labels)``) that embeds the ids, applies one layer and takes a loss, so a
wrong lowering of that layer shows as a difference. Traces are recorded in
this process (single device); the parallel cases share one module fixture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.__main__ import model_kwargs, parser, trace_and_build
from backends.torch.lowering import LoweringError, lower_trace
from backends.torch.tracer.check import check_lowering
from backends.torch.tracer.rank import run

SIZES = {"layers": 1, "hidden": 8, "heads": 2, "ffn": 12, "vocab": 10, "seqlen": 4}
STOCK = "backends.torch.stock_models:"


class Probe(nn.Module):
    """Embedding, one layer ``body(module, x)``, a projection to the vocabulary
    and the cross-entropy summed over tokens (or ``loss(module, h, labels)``)."""

    def __init__(self, body, loss=None, **parts):
        super().__init__()
        self.embed = nn.Embedding(SIZES["vocab"], SIZES["hidden"])
        self.parts = nn.ModuleDict(parts)
        self.out = nn.Linear(SIZES["hidden"], SIZES["vocab"], bias=False)
        self.body, self.loss_fn = body, loss

    def forward(self, tokens, labels):
        h = self.body(self.parts, self.embed(tokens))
        if self.loss_fn is not None:
            return self.loss_fn(self, h, labels)
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten(), reduction="sum")


def _heads(x):
    b, s, d = x.shape
    return x.view(b, s, 2, d // 2).transpose(1, 2)


def _merge(x):
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def _attention_explicit(m, x, fill="masked_fill"):
    q, k, v = (_heads(t) for t in m["qkv"](x).chunk(3, dim=-1))
    s = x.shape[1]
    scores = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    if fill == "masked_fill":
        scores = scores.masked_fill(causal, float("-inf"))
    elif fill == "where":
        scores = torch.where(torch.ones(s, s).tril() == 1, scores, float("-inf"))
    else:
        scores = scores + torch.zeros(s, s, dtype=x.dtype).masked_fill(causal, float("-inf"))
    return _merge(torch.softmax(scores, dim=-1) @ v)


def _sdpa(m, x, masked=False):
    q, k, v = (_heads(t) for t in m["qkv"](x).chunk(3, dim=-1))
    if masked:
        keep = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    return _merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def _rotary_cos_sin(m, x):
    b, s, d = x.shape
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    ang = torch.outer(torch.arange(s, dtype=x.dtype), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return m["lin"](x * cos + rotated * sin)


class RotaryComplex(nn.Module):
    """torchtitan's rotary embedding: pairs as complex numbers times a
    buffer of unit complex numbers (``torch.polar``)."""

    def __init__(self):
        super().__init__()
        d, s = H // 2, SIZES["seqlen"]
        freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(s, dtype=torch.float64), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def forward(self, x):
        q = x.view(*x.shape[:2], 2, H // 2)
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        freqs = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, qc.shape[-1])
        return torch.view_as_real(qc * freqs).flatten(3).type_as(x).view(x.shape)


def _mse(m, h, labels, reduction="sum"):
    target = torch.tanh(h[..., :2]).detach()
    return F.mse_loss(m.parts["head"](h), target, reduction=reduction)


H = SIZES["hidden"]
PROBES = {
    "linear_bias": (lambda m, x: m["lin"](x), lambda: {"lin": nn.Linear(H, H)}),
    "layer_norm": (lambda m, x: m["ln"](x), lambda: {"ln": nn.LayerNorm(H)}),
    "layer_norm_no_affine": (lambda m, x: m["ln"](x) * 2.0,
                             lambda: {"ln": nn.LayerNorm(H, elementwise_affine=False)}),
    "rms_norm": (lambda m, x: m["rms"](x), lambda: {"rms": nn.RMSNorm(H)}),
    "gelu_erf": (lambda m, x: F.gelu(m["lin"](x)), lambda: {"lin": nn.Linear(H, H)}),
    "gelu_tanh": (lambda m, x: F.gelu(m["lin"](x), approximate="tanh"), lambda: {"lin": nn.Linear(H, H)}),
    "relu": (lambda m, x: m["lin"](torch.relu(x)), lambda: {"lin": nn.Linear(H, H)}),
    "tanh": (lambda m, x: m["lin"](torch.tanh(x)), lambda: {"lin": nn.Linear(H, H)}),
    "sigmoid": (lambda m, x: m["lin"](torch.sigmoid(x)), lambda: {"lin": nn.Linear(H, H)}),
    "silu": (lambda m, x: m["lin"](F.silu(x)), lambda: {"lin": nn.Linear(H, H)}),
    "sub_neg_rsub": (lambda m, x: (1.0 - m["lin"](x)) - (-x), lambda: {"lin": nn.Linear(H, H)}),
    "positions": (lambda m, x: x + m["pos"](torch.arange(x.shape[1])),
                  lambda: {"pos": nn.Embedding(SIZES["seqlen"], H)}),
    "split_uneven_cat": (lambda m, x: torch.cat([p * (i + 1.0) for i, p in
                                                 enumerate(m["lin"](x).split([3, 5], -1))], -1),
                         lambda: {"lin": nn.Linear(H, H)}),
    "attention_masked_fill": (_attention_explicit, lambda: {"qkv": nn.Linear(H, 3 * H)}),
    "attention_where": (lambda m, x: _attention_explicit(m, x, "where"),
                        lambda: {"qkv": nn.Linear(H, 3 * H)}),
    "attention_additive_mask": (lambda m, x: _attention_explicit(m, x, "add"),
                                lambda: {"qkv": nn.Linear(H, 3 * H)}),
    "sdpa_causal": (_sdpa, lambda: {"qkv": nn.Linear(H, 3 * H)}),
    "sdpa_bool_mask": (lambda m, x: _sdpa(m, x, masked=True), lambda: {"qkv": nn.Linear(H, 3 * H)}),
    "rotary_complex": (lambda m, x: m["lin"](m["rope"](m["lin"](x))),
                       lambda: {"lin": nn.Linear(H, H), "rope": RotaryComplex()}),
    "rotary_cos_sin": (_rotary_cos_sin, lambda: {"lin": nn.Linear(H, H)}),
    "dropout_p0": (lambda m, x: m["drop"](m["lin"](x)), lambda: {"lin": nn.Linear(H, H),
                                                          "drop": nn.Dropout(0.0)}),
}
LOSSES = {
    "cross_entropy_mean": lambda m, h, y: F.cross_entropy(m.out(h).flatten(0, 1), y.flatten()),
    "cross_entropy_ignore_index": lambda m, h, y: F.cross_entropy(
        m.out(h).flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum"),
    "mse_sum": _mse,
    "mse_mean": lambda m, h, y: _mse(m, h, y, "mean"),
}


def probe(name: str):
    def factory(**_sizes) -> Probe:
        if name in LOSSES:
            return Probe(lambda m, x: x, LOSSES[name], head=nn.Linear(H, 2))
        body, parts = PROBES[name]
        return Probe(body, **parts())
    return factory


def tied(**_sizes) -> Probe:
    model = Probe(lambda m, x: x)
    model.out.weight = model.embed.weight
    return model


def _single(model: str) -> dict:
    spec = {"model": model, "model_kwargs": SIZES, "recipe": "", "dp": 1, "tp": 1, "pp": 1,
            "batch": 2, "seqlen": SIZES["seqlen"], "vocab": SIZES["vocab"], "seed": 0,
            "parallel": False, "keep_values": True}
    return run(spec, 0)


#: probes whose torch run rounds to float32 on the way (``x.float()``, as
#: torchtitan's rotary embedding does): compared to that precision
FLOAT32 = {"rotary_complex", "llama_titan"}


def _lower_and_check(trace: dict, rtol: float = 1e-9) -> None:
    low = lower_trace(trace, SIZES["vocab"])
    check = check_lowering(trace, low, SIZES["vocab"])
    assert check.grads, "no gradient was compared"
    differences = check.differences(rtol=rtol, atol=rtol / 100)
    assert not differences, differences


for _name in [*PROBES, *LOSSES]:
    globals()[f"probe_{_name}"] = probe(_name)


@pytest.mark.parametrize("name", [*PROBES, *LOSSES])
def test_layer_lowering_matches_torch(name: str) -> None:
    _lower_and_check(_single(f"{__name__}:probe_{name}"), 1e-5 if name in FLOAT32 else 1e-9)


def test_tied_embeddings_match_torch() -> None:
    trace = _single(f"{__name__}:tied")
    assert list(trace["grads"]) == ["embed.weight"]
    _lower_and_check(trace)


@pytest.mark.parametrize("model", ["gpt2", "gpt2_masked", "gpt2_mean", "mlp", "mlp_mean",
                                   "llama_titan", "encoder", "encoder_prenorm"])
def test_stock_models_match_torch(model: str) -> None:
    _lower_and_check(_single(STOCK + model), 1e-5 if model in FLOAT32 else 1e-9)


def probe_dropout(**_sizes) -> Probe:
    return Probe(lambda m, x: m["drop"](x), drop=nn.Dropout(0.1))


def probe_cumprod(**_sizes) -> Probe:
    return Probe(lambda m, x: m["lin"](x).cumprod(1), lin=nn.Linear(H, H))


def test_dropout_with_p_is_refused_in_one_line() -> None:
    with pytest.raises(LoweringError, match="dropout") as e:
        lower_trace(_single(f"{__name__}:probe_dropout"), SIZES["vocab"])
    assert "\n" not in str(e.value)


def test_an_op_not_lowered_is_named_with_its_module() -> None:
    with pytest.raises(LoweringError, match=r"aten\.cumprod.*Probe") as e:
        lower_trace(_single(f"{__name__}:probe_cumprod"), SIZES["vocab"])
    assert "\n" not in str(e.value)


def test_constant_inputs_are_named_by_value() -> None:
    """Two runs with the same positions read one input; its value is kept."""
    low = lower_trace(_single(f"{__name__}:probe_positions"), SIZES["vocab"])
    names = [name for kind, name in low.inputs.values() if name.startswith("const.")]
    assert len(names) == 1
    (x,) = low.constants
    np.testing.assert_array_equal(low.constants[x], np.eye(SIZES["seqlen"]))


# -- a GPT-2 style model verifies under data parallelism; a wrong recipe fails


@pytest.fixture(scope="module")
def gpt2_single():
    args = parser().parse_args(["--model", "gpt2"])
    spec = {"model": STOCK + "gpt2", "model_kwargs": model_kwargs(args),
        "recipe": "", "dp": 1, "tp": 1, "pp": 1, "batch": args.batch, "seqlen": args.seqlen,
        "vocab": args.vocab, "seed": args.seed, "parallel": False}
    return run(spec, 0)


def _verdict(recipe: str, single: dict):
    from main import verify
    args = parser().parse_args(["--model", "gpt2", "--recipe",
                                f"backends.torch.stock_recipes:{recipe}", "--dp", "2", "--tp", "1"])
    (plan_s, plan_p), _ = trace_and_build(args, single)
    return verify(plan_s, plan_p)


def test_gpt2_ddp_verifies(gpt2_single) -> None:
    verdict = _verdict("ddp", gpt2_single)
    assert verdict.success, verdict.message


def test_gpt2_ddp_skipping_biases_fails(gpt2_single) -> None:
    """Gradients synchronized by name ('weight' only): every bias keeps its
    replica's gradient. The oracle of the real runs would differ there."""
    verdict = _verdict("ddp_weights_only", gpt2_single)
    assert not verdict.success
    assert "bias" in verdict.message


def test_soft_moe_matches_torch() -> None:
    """The soft-routed MoE Llama of backends/torch/zoo/moe.py, lowered on one
    device, computes torch's loss and gradients."""
    _lower_and_check(_single("backends.torch.moe:moe"))
