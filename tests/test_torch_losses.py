"""Loss conventions and masks as people write them, through the torch
backend: the cross-entropy with label smoothing (mean and sum, with and
without an ignored label), ``nn.Embedding(padding_idx=...)``, boolean SDPA
masks and -inf fills off the causal pattern (sliding windows), key-padding
masks computed from the ids, and the token-weighted mean whose count of
kept labels is all-reduced over dp.

Each probe's lowering is compared with PyTorch's loss and gradients
(backends/torch/tracer/check.py). The parallel cases are the models of
``backends/torch/zoo/loss_models.py`` under the recipes of
``backends/torch/zoo/loss_recipes.py``; every verdict here agrees with a real
gloo run (scripts/gloo_truth.py, docs/torch-backend.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.lowering import LoweringError, lower_trace
from tests.test_torch_layers import SIZES, Probe, _heads, _lower_and_check, _merge, _single
from tests.test_torch_user_layers import _verdict

H, S, V = SIZES["hidden"], SIZES["seqlen"], SIZES["vocab"]
PAD = 3  # an id the probes' batch holds (seed 0)


def _smoothed(reduction: str, ignore: bool):
    def loss(m, h, y):
        return F.cross_entropy(m.out(h).flatten(0, 1), y.flatten(), reduction=reduction,
                               label_smoothing=0.2, ignore_index=PAD if ignore else -100)
    return loss


class KeyPadded(Probe):
    """The probe's layer reads the ids (``m.ids``) to mask pads out as keys."""

    def forward(self, tokens, labels):
        self.parts.ids = tokens
        return super().forward(tokens, labels)


def _qkv(m, x):
    return [_heads(t) for t in m["qkv"](x).chunk(3, dim=-1)]


def _window() -> torch.Tensor:
    i = torch.arange(S)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 2)


def _sdpa_window(m, x):
    q, k, v = _qkv(m, x)
    return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=_window()))


def _fill_window(m, x):
    q, k, v = _qkv(m, x)
    att = (q @ k.transpose(-2, -1)).masked_fill(~_window(), float("-inf"))
    return _merge(att.softmax(-1) @ v)


def _additive_window(m, x):
    """An additive float mask: -inf outside the window, finite inside."""
    q, k, v = _qkv(m, x)
    mask = torch.zeros(S, S, dtype=x.dtype).masked_fill(~_window(), float("-inf")) + 0.25
    return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def _sdpa_key_padding(m, x):
    q, k, v = _qkv(m, x)
    keep = (m.ids != PAD)[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()
    keep = keep | torch.eye(S, dtype=torch.bool)
    return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def _fill_key_padding(m, x):
    """-inf at pad keys, then a finite fill on the future positions: some
    -inf entries become finite again."""
    q, k, v = _qkv(m, x)
    att = (q @ k.transpose(-2, -1)).masked_fill((m.ids == PAD)[:, None, None, :], float("-inf"))
    att = att.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -1e4)
    return _merge(att.softmax(-1) @ v)


def _where_key_padding(m, x):
    q, k, v = _qkv(m, x)
    keep = (m.ids != PAD).view(x.shape[0], 1, 1, S).expand(-1, 1, S, S) | torch.eye(S).bool()
    mask = torch.where(keep, 0.0, float("-inf")).to(x.dtype)
    return _merge(((q @ k.transpose(-2, -1)) + mask).softmax(-1) @ v)


QKV = {"qkv": lambda: nn.Linear(H, 3 * H)}
LOSSES = {
    "smoothing_mean": _smoothed("mean", False),
    "smoothing_sum": _smoothed("sum", False),
    "smoothing_mean_ignore_index": _smoothed("mean", True),
    "smoothing_sum_ignore_index": _smoothed("sum", True),
}
LAYERS = {
    "sdpa_sliding_window": _sdpa_window,
    "masked_fill_sliding_window": _fill_window,
    "additive_sliding_window": _additive_window,
    "sdpa_key_padding_from_ids": _sdpa_key_padding,
    "masked_fill_key_padding_refilled": _fill_key_padding,
    "where_additive_key_padding": _where_key_padding,
}


def probe(name: str):
    def factory(**_sizes) -> Probe:
        if name in LOSSES:
            return Probe(lambda m, x: x, LOSSES[name])
        if name == "embedding_padding_idx":
            p = Probe(lambda m, x: x)
            p.embed = nn.Embedding(V, H, padding_idx=PAD)
            return p
        return KeyPadded(LAYERS[name], **{k: make() for k, make in QKV.items()})
    return factory


NAMES = [*LOSSES, *LAYERS, "embedding_padding_idx"]
for _name in NAMES:
    globals()[f"probe_{_name}"] = probe(_name)


@pytest.mark.parametrize("name", NAMES)
def test_lowering_matches_torch(name: str) -> None:
    _lower_and_check(_single(f"{__name__}:probe_{name}"))


def probe_empty_row(**_sizes) -> Probe:
    """Every key of some query masked: torch computes NaN there."""
    def body(m, x):
        q, k, v = _qkv(m, x)
        keep = torch.ones(S, S, dtype=torch.bool).tril() & (torch.arange(S) != 1)[:, None]
        return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    return Probe(body, **{k: make() for k, make in QKV.items()})


def test_a_row_with_every_key_masked_is_refused_in_one_line() -> None:
    with pytest.raises(LoweringError, match="every position masked") as e:
        lower_trace(_single(f"{__name__}:probe_empty_row"), V)
    assert "\n" not in str(e.value)


# -- in parallel ------------------------------------------------------------------

def _run(model: str, recipe: str, tp: int = 1):
    return _verdict(["--model", model, "--recipe", recipe, "--dp", "2", "--tp", str(tp),
                     "--hidden", "8", "--ffn", "8", "--heads", "2"])


@pytest.mark.parametrize("model,recipe", [
    ("gpt2_smooth_mean", "ddp_avg"),         # smoothing, per-rank mean, AVG
    ("gpt2_padded", "ddp"),                  # key padding from the ids, padding_idx
    ("gpt2_token_weighted", "ddp_token_weighted"),  # count all-reduced, SUM
])
def test_loss_conventions_verify(model: str, recipe: str) -> None:
    verdict, _ = _run(model, recipe)
    assert verdict.success, verdict.message


def test_a_count_not_all_reduced_fails() -> None:
    """Each rank divides its summed loss by its own count of kept labels:
    not its share of the step's mean (the real run differs, about 2x)."""
    verdict, _ = _run("gpt2_token_weighted", "ddp_local_count")
    assert not verdict.success and verdict.kind == "stage"


def test_a_counted_mean_averaged_again_fails_at_the_average() -> None:
    verdict, _ = _run("gpt2_token_weighted", "ddp_token_weighted_avg")
    assert not verdict.success
    assert "1/2 x the gradient" in verdict.message and "all_reduce_avg" in verdict.message


def test_smoothing_that_differs_on_one_rank_fails() -> None:
    verdict, _ = _run("gpt2_smooth", "ddp_smoothing_first_rank")
    assert not verdict.success and verdict.kind == "stage"


def test_an_all_reduced_count_needs_every_rank() -> None:
    """Lowered alone, a rank cannot know the step's count: refused."""
    from backends.torch.tracer.rank import run
    spec = {"model": "backends.torch.loss_models:token_weighted", "recipe":
            "backends.torch.loss_recipes:ddp_token_weighted", "dp": 2, "tp": 1, "pp": 1,
            "batch": 4, "seqlen": 4, "vocab": 16, "seed": 0, "parallel": True,
            "model_kwargs": {"layers": 1, "hidden": 8, "heads": 2, "ffn": 8, "vocab": 16,
                             "seqlen": 4}}
    with pytest.raises(LoweringError, match="every rank's counts"):
        lower_trace(run(spec, 0), 16)
