"""Stock code the torch backend used to refuse: a whole tensor's maximum or
minimum (``x.max()``, ``x.min()``, ``torch.amax(x)``), pooling with padding
and ``ceil_mode`` (max and average, ``count_include_pad`` both ways,
``divisor_override``; adaptive average and max pooling), circular padding
(``F.pad``, ``padding_mode`` of a convolution), ``torch.roll``,
``torch.flip``, ``nn.GroupNorm`` and DTensor's uneven ``Shard(1)``.

Each lowering is run in float64 on the traced values and compared with
PyTorch's loss and gradients (ties included: hardtanh and relu outputs tie
at their bounds), and circular padding's concatenation is compared with
torch's own kernel directly. In parallel: a correct model and recipe
verify, and a wrong one fails naming the module and the rank. Every
parallel verdict agrees with a real gloo run (``scripts/gloo_truth.py``,
docs/torch-backend.md, "Limits").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.lowering import LoweringError, lower_trace
from backends.torch.tracer.circular_pad import circular_pad
from tests.test_torch_layers import SIZES, Probe, _lower_and_check, _single

H = SIZES["hidden"]


def _lin(x: torch.Tensor, m) -> torch.Tensor:
    return m["lin"](x)


BODIES = {
    "max_all": lambda m, x: _lin(x, m) * _lin(x, m).max(),
    "min_all": lambda m, x: _lin(x, m) - torch.min(_lin(x, m)),
    "amax_all": lambda m, x: _lin(x, m) * torch.amax(x),
    "amax_two_dims": lambda m, x: _lin(x, m) * x.amax(dim=(0, 2), keepdim=True),
    # hardtanh saturates: the maximum and the minimum are reached several times
    "max_min_all_with_ties": lambda m, x: x * F.hardtanh(4 * _lin(x, m)).max()
    + x * F.hardtanh(4 * _lin(x, m)).min(),
    "max_pool1d_padded": lambda m, x: F.max_pool1d(_lin(x, m), 3, stride=1, padding=1),
    "max_pool1d_ceil_mode": lambda m, x: F.max_pool1d(
        _lin(x, m), 3, stride=2, padding=1, ceil_mode=True).repeat(1, 1, 2)[..., :H],
    "max_pool1d_dilated_padded_ties": lambda m, x: F.max_pool1d(
        F.relu(_lin(x, m)), 3, stride=1, padding=1, dilation=2).repeat(1, 1, 2)[..., :H],
    "max_pool2d_padded_ceil_ties": lambda m, x: x + nn.MaxPool2d(
        (3, 2), stride=(2, 1), padding=(1, 1), ceil_mode=True)(F.relu(_lin(x, m)).unsqueeze(1))
    .squeeze(1).repeat(1, 2, 1)[:, :x.shape[1], :x.shape[2]] * _lin(x, m),
    "avg_pool1d_padded": lambda m, x: F.avg_pool1d(_lin(x, m), 3, stride=1, padding=1),
    "avg_pool1d_padded_excluded": lambda m, x: F.avg_pool1d(
        _lin(x, m), 3, stride=1, padding=1, count_include_pad=False),
    "avg_pool1d_ceil_mode": lambda m, x: F.avg_pool1d(
        _lin(x, m), 3, stride=2, padding=1, ceil_mode=True).repeat(1, 1, 2)[..., :H],
    "avg_pool2d_padded_excluded": lambda m, x: nn.AvgPool2d(
        3, stride=1, padding=1, count_include_pad=False)(_lin(x, m).unsqueeze(1)).squeeze(1),
    "avg_pool2d_divisor_override": lambda m, x: F.avg_pool2d(
        _lin(x, m).unsqueeze(1), (2, 3), stride=(1, 2), padding=(1, 1), ceil_mode=True,
        divisor_override=4).squeeze(1).repeat(1, 1, 2)[:, :x.shape[1], :H],
    "adaptive_avg_pool1d": lambda m, x: nn.AdaptiveAvgPool1d(3)(_lin(x, m)).repeat(1, 1, 3)[..., :H],
    "adaptive_avg_pool2d": lambda m, x: nn.AdaptiveAvgPool2d((3, 5))(_lin(x, m).unsqueeze(1))
    .squeeze(1).repeat(1, 2, 2)[:, :x.shape[1], :H],
    "adaptive_max_pool1d_global": lambda m, x: _lin(x, m) * nn.AdaptiveMaxPool1d(1)(
        x.transpose(1, 2)).transpose(1, 2),
    "adaptive_max_pool1d_ties": lambda m, x: nn.AdaptiveMaxPool1d(3)(F.relu(_lin(x, m)))
    .repeat(1, 1, 3)[..., :H],
    "roll": lambda m, x: _lin(x, m) + torch.roll(_lin(x, m), (-3, 1), dims=(2, 1)),
    "flip": lambda m, x: _lin(x, m) + _lin(x, m).flip(1, 2),
    "group_norm": lambda m, x: m["gn"](_lin(x, m).transpose(1, 2)).transpose(1, 2),
    "group_norm_3d_no_affine": lambda m, x: m["gn"](
        _lin(x, m).unsqueeze(-1).transpose(1, 2)).squeeze(-1).transpose(1, 2) * x,
    "circular_pad": lambda m, x: F.pad(_lin(x, m), (1, 1), mode="circular")[..., 1:-1]
    + F.pad(x, (2, 1), mode="circular")[..., :H],
    "circular_pad_2d": lambda m, x: F.pad(_lin(x, m).unsqueeze(1), (1, 2, 2, 1), mode="circular")
    .squeeze(1)[:, 1:-2, 2:-1] * x,
    "conv1d_circular": lambda m, x: m["conv"](_lin(x, m).transpose(1, 2)).transpose(1, 2),
    "conv2d_circular": lambda m, x: m["conv2d"](_lin(x, m).unsqueeze(1)).mean(1),
}

PARTS = {
    "group_norm": lambda: {"gn": nn.GroupNorm(2, H)},
    "group_norm_3d_no_affine": lambda: {"gn": nn.GroupNorm(4, H, affine=False)},
    "conv1d_circular": lambda: {"conv": nn.Conv1d(H, H, 3, padding=1, padding_mode="circular")},
    "conv2d_circular": lambda: {"conv2d": nn.Conv2d(1, 2, 3, padding=(1, 1),
                                                    padding_mode="circular")},
}


def _probe(name: str):
    return lambda **_kw: Probe(BODIES[name], lin=nn.Linear(H, H), **PARTS.get(name, dict)())


for _name in BODIES:
    globals()[f"probe_{_name}"] = _probe(_name)


@pytest.mark.parametrize("name", BODIES)
def test_lowering_matches_torch(name: str) -> None:
    _lower_and_check(_single(f"{__name__}:probe_{name}"))


@pytest.mark.parametrize("pad", [(1, 1), (0, 3), (2, 0, 1, 1), (1, 2, 3, 0, 0, 1)])
def test_circular_pad_is_torchs(pad: tuple[int, ...]) -> None:
    """The concatenation the recorder runs has torch's values and gradients."""
    x = torch.randn(*(2, 3, 4, 5, 3)[:len(pad) // 2 + 2], dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(F.pad(x, pad, mode="circular"))
    ours = circular_pad(x, pad)
    (ours_grad,) = torch.autograd.grad(ours, x, g)
    theirs = F.pad(x, pad, mode="circular")
    (theirs_grad,) = torch.autograd.grad(theirs, x, g)
    assert torch.equal(ours, theirs) and torch.allclose(ours_grad, theirs_grad, rtol=0, atol=1e-12)
    assert circular_pad(x, (-1,) * len(pad)) is None and circular_pad(x, (9,) * len(pad)) is None
    assert circular_pad(x, (1, 1) * (len(pad) // 2 + 2)) is None


def probe_argmax_flat(**_kw) -> Probe:
    return Probe(lambda m, x: _lin(x, m) * x.argmax().to(x.dtype), lin=nn.Linear(H, H))


def test_a_flat_argmax_read_as_a_value_stays_refused() -> None:
    with pytest.raises(LoweringError) as e:
        lower_trace(_single(f"{__name__}:probe_argmax_flat"), SIZES["vocab"])
    assert "argmax" in str(e.value) and "\n" not in str(e.value)


# -- in parallel ----------------------------------------------------------------------

MODELS = "tests.pooling_padding_models:"
RECIPES = "tests.uneven_shard_recipes:"
STOCK = "backends.torch.stock_recipes:"


def _verdict(argv: str):
    from backends.torch.__main__ import parser, resolve, trace_and_build
    from main import verify
    args = resolve(parser().parse_args(["--hidden", "8", "--ffn", "8", *argv.split()]))
    (plan_s, plan_p), _ = trace_and_build(args)
    return verify(plan_s, plan_p), plan_p


def _failed_at(verdict, plan_p) -> set[tuple[int, str, str]]:
    return {(plan_p.nodes[i].rank, plan_p.nodes[i].op, plan_p.nodes[i].name)
            for r in verdict.failed for i in r.stage.gp_nodes}


@pytest.mark.parametrize("argv", [
    # padded max and average pooling, a circular conv and F.pad over the sequence
    f"--model {MODELS}pooled_tagger --recipe {STOCK}tp_mlp --dp 2 --tp 2",
    # w / w.abs().max(), offset.min()
    f"--model {MODELS}max_scaled_tagger --recipe {STOCK}ddp --dp 2 --tp 1",
    # each down projection's weight Shard(1), 8 and 7 columns
    f"--model mlp --recipe {RECIPES}rowwise_replicated_input --dp 2 --tp 2 --ffn 15",
])
def test_correct_recipes_verify(argv: str) -> None:
    verdict, _ = _verdict(argv)
    assert verdict.success, verdict.message


def test_a_columns_cut_at_even_offsets_fails_at_the_projection_on_rank_1() -> None:
    """Rank 1 reads columns 7 to 13 of the 15 against its weight's 8 to 14."""
    verdict, plan_p = _verdict(f"--model mlp --recipe {RECIPES}rowwise_even_offsets "
                               f"--dp 1 --tp 2 --ffn 15")
    assert not verdict.success
    assert (1, "narrow", "RegressionTower.blocks.0.down") in _failed_at(verdict, plan_p)


def test_a_minimum_over_the_batch_fails_under_data_parallelism() -> None:
    """``h - h.min()`` over the whole batch: each replica shifts by the
    minimum of its own rows (the real run differs)."""
    verdict, plan_p = _verdict(f"--model {MODELS}batch_min_tagger --recipe {STOCK}ddp "
                               f"--dp 2 --tp 1")
    assert not verdict.success
    assert _failed_at(verdict, plan_p) == {(0, "max", "MaxScaledTagger"),
                                           (1, "max", "MaxScaledTagger")}
