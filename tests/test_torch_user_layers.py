"""Layers and losses written the way outside users write them, through the
torch backend: masks of any constant pattern with a finite fill, additive
float masks, grouped-query SDPA, ``nn.MultiheadAttention`` with its
weights, norms along a dim and division by a tensor, the cross-entropy on
``[B, C, S]`` logits and with an ``ignore_index`` that occurs in the labels,
labels shifted (and padded) by the model, L1, smooth L1 and Huber losses.

Each probe's lowering is run in float64 on the traced run's values and
compared with PyTorch's loss and gradients (backends/torch/tracer/check.py), as in
tests/test_torch_layers.py; what is still refused is refused in one line.
Two parallel cases: the grouped-query decoder verifies under tensor
parallelism, and a mean over the rank's kept labels (whose count differs
between the ranks) averaged over dp fails at the average, as the real run
differs (scripts/gloo_truth.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.lowering import LoweringError, check_shards
from tests.test_torch_layers import SIZES, Probe, _heads, _lower_and_check, _merge, _single

H, S = SIZES["hidden"], SIZES["seqlen"]


def _qkv(m, x):
    return [_heads(t) for t in m["qkv"](x).chunk(3, dim=-1)]


def _sdpa_float_mask(m, x):
    """An additive mask with -inf on the causal pattern and finite entries
    elsewhere, the finite column written in place through a view after the
    mask was built (the recorder must read the value it has then)."""
    q, k, v = _qkv(m, x)
    mask = torch.zeros(S, S, dtype=x.dtype).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1),
                                                         float("-inf"))
    mask[:, 0] = 0.5
    return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def _sdpa_gqa(m, x):
    b, s, _ = x.shape
    q = m["q"](x).view(b, s, 4, 2).transpose(1, 2)
    k, v = (m[n](x).view(b, s, 2, 2).transpose(1, 2) for n in ("k", "v"))
    return _merge(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def _finfo_min(m, x):
    q, k, v = _qkv(m, x)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.tril(torch.ones(S, S)) == 0, torch.finfo(scores.dtype).min)
    return _merge(scores.softmax(-1) @ v)


def _window_finite(m, x):
    """A sliding window (not the causal pattern) filled with a finite value by ``where``."""
    q, k, v = _qkv(m, x)
    i = torch.arange(S)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 2)
    scores = torch.where(keep, q @ k.transpose(-2, -1), -1e4)
    return _merge(scores.softmax(-1) @ v)


def _mha_weights(m, x):
    y, _ = m["mha"](x, x, x, attn_mask=torch.ones(S, S, dtype=torch.bool).triu(1))
    return y


QKV = {"qkv": lambda: nn.Linear(H, 3 * H)}
LIN = {"lin": lambda: nn.Linear(H, H)}
PROBES = {
    "sdpa_float_mask_written_in_place": (_sdpa_float_mask, QKV),
    "sdpa_enable_gqa": (_sdpa_gqa, {"q": lambda: nn.Linear(H, H), "k": lambda: nn.Linear(H, H // 2),
                                    "v": lambda: nn.Linear(H, H // 2)}),
    "masked_fill_finfo_min": (_finfo_min, QKV),
    "where_window_finite_fill": (_window_finite, QKV),
    "multihead_attention_with_weights": (
        _mha_weights, {"mha": lambda: nn.MultiheadAttention(H, 2, batch_first=True)}),
    "divide_by_norm": (lambda m, x: m["lin"](x / x.norm(dim=-1, keepdim=True)), LIN),
    "f_normalize": (lambda m, x: m["lin"](F.normalize(x, dim=-1)), LIN),
    "sqrt_and_tensor_division": (
        lambda m, x: m["lin"](x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)), LIN),
}


def _regression(loss):
    def body(m, h, labels):
        return loss(m.parts["head"](h), torch.tanh(h[..., :2]).detach())
    return body


LOSSES = {
    "cross_entropy_classes_second_mean": lambda m, h, y: F.cross_entropy(m.out(h).transpose(1, 2), y),
    "cross_entropy_classes_second_sum": lambda m, h, y: F.cross_entropy(
        m.out(h).transpose(1, 2), y, reduction="sum"),
    # the first label is ignored wherever it occurs: the mean counts the others
    "cross_entropy_ignore_index_in_labels": lambda m, h, y: F.cross_entropy(
        m.out(h).flatten(0, 1), y.flatten(), ignore_index=int(y[0, 0])),
    # labels shifted by the model: sliced, or sliced and padded with the ignore index
    "cross_entropy_shifted_labels": lambda m, h, y: F.cross_entropy(
        m.out(h)[:, :-1].reshape(-1, SIZES["vocab"]), y[:, 1:].reshape(-1), reduction="sum"),
    "cross_entropy_shifted_padded_labels": lambda m, h, y: F.cross_entropy(
        m.out(h).flatten(0, 1), F.pad(y[:, 1:], (0, 1), value=-100).flatten()),
    "mean_of_squares_by_hand": _regression(lambda p, t: ((p - t) ** 2).mean()),
    "l1_mean": _regression(F.l1_loss),
    "smooth_l1_both_branches": _regression(lambda p, t: F.smooth_l1_loss(p, t, beta=0.1)),
    "huber_sum": _regression(lambda p, t: F.huber_loss(p, t, reduction="sum", delta=0.1)),
}


def probe(name: str):
    def factory(**_sizes) -> Probe:
        if name in LOSSES:
            return Probe(lambda m, x: x, LOSSES[name], head=nn.Linear(H, 2))
        body, parts = PROBES[name]
        return Probe(body, **{k: make() for k, make in parts.items()})
    return factory


for _name in [*PROBES, *LOSSES]:
    globals()[f"probe_{_name}"] = probe(_name)


@pytest.mark.parametrize("name", [*PROBES, *LOSSES])
def test_user_layer_lowering_matches_torch(name: str) -> None:
    _lower_and_check(_single(f"{__name__}:probe_{name}"))


def probe_bool_window(**_sizes) -> Probe:
    """A boolean SDPA mask that is not the causal pattern: -inf elsewhere."""
    def body(m, x):
        q, k, v = _qkv(m, x)
        keep = torch.ones(S, S, dtype=torch.bool).tril() & ~torch.ones(S, S, dtype=torch.bool).tril(-2)
        return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    return Probe(body, qkv=nn.Linear(H, 3 * H))


def test_a_boolean_sdpa_mask_off_the_causal_pattern_matches_torch() -> None:
    """SDPA turns it into -inf off the causal pattern: the masked softmax
    (backends/torch/lowering/masks.py; tests/test_torch_losses.py has more)."""
    _lower_and_check(_single(f"{__name__}:probe_bool_window"))


def test_empty_shards_off_dim_0_are_refused_naming_the_parameter() -> None:
    """A 3-column parameter cut 2 and 1 along dim 1 is lowered
    (tests/test_torch_pools_extrema_padding.py); one column over two ranks leaves one
    empty, refused before lowering. Along dim 0 (FSDP2's padded shards) an
    empty shard is lowered (tests/test_torch_padded.py)."""
    check_shards([{"params": {"out.weight": (0, (2, 3), [[], ["tp"]])}, "shapes": [(2, 2)]}])
    trace = {"params": {"out.weight": (0, (2, 1), [[], ["tp"]])}, "shapes": [(2, 0)]}
    with pytest.raises(LoweringError, match=r"out\.weight.*holds none"):
        check_shards([trace])
    check_shards([{"params": {"w": (0, (3, 2), [["dp"], []])}, "shapes": [(2, 2)]}])
    check_shards([{"params": {"out.bias": (0, (1,), [["dp"]])}, "shapes": [(0,)]}])


# -- in parallel ------------------------------------------------------------------


def _verdict(argv: list[str]):
    from backends.torch.__main__ import parser, resolve, trace_and_build
    from main import verify
    args = resolve(parser().parse_args(argv))
    (plan_s, plan_p), _ = trace_and_build(args)
    return verify(plan_s, plan_p), plan_p


def test_grouped_query_decoder_verifies_under_tensor_parallelism() -> None:
    verdict, _ = _verdict(["--model", "gqa_finfo", "--recipe", "tp_attention", "--dp", "1",
                           "--tp", "2", "--hidden", "8", "--ffn", "8"])
    assert verdict.success, verdict.message


def test_mean_over_unequal_kept_labels_averaged_over_dp_fails_at_the_average() -> None:
    """Pad id 8 occurs once in rank 0's labels and twice in rank 1's (seed 0):
    each rank divides by its own count, so AVG over dp is not the step's mean
    (the real run differs too). The counterexample is at the average of a
    gradient, whose inputs carry the two ranks' different factors (13/7 and
    13/6: 13 kept labels in the step, 7 and 6 on the ranks)."""
    verdict, plan_p = _verdict(["--model", "gqa_pad_mean", "--recipe", "ddp_avg", "--dp", "2",
                                "--tp", "1", "--hidden", "8", "--ffn", "8"])
    assert not verdict.success and verdict.kind == "stage"
    nodes = [plan_p.nodes[i] for r in verdict.failed for i in r.stage.gp_nodes]
    assert any(n.op == "all_reduce_avg" for n in nodes)
    scales = {tuple(plan_p.tensors[t].scale) for n in nodes for t in n.inputs}
    assert {(13, 7), (13, 6)} <= scales
