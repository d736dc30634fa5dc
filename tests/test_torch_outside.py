"""Models written outside the backend (``tests/outside_models.py``) and their
recipes (``tests/outside_mistakes.py``), loaded as a user loads theirs.

Every model's single-device lowering is run in float64 on the traced run's
values and compared with PyTorch's loss and gradients
(backends/torch/tracer/check.py), and so is every activation kernel of
``backends/torch/lowering/activations.py`` with non-default parameters, in place and
not (both sides of each branch are hit: the inputs are N(0, 1)). What must
be refused is refused in one line naming the module. A few parallel cases
exercise the new paths (ids transposed, selected and taken modulo, a
classifier over fewer classes than the vocabulary, BCE on ids converted to
numbers under FSDP2); two mistakes fail at the fault. The other (model,
recipe) pairs are cases of scripts/torch_suite.py, each checked against a
real gloo run (docs/torch-backend.md, "Models written by users").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.torch.lowering import LoweringError, lower_trace
from tests.test_torch_layers import SIZES, Probe, _lower_and_check, _single

OUTSIDE = "tests.outside_models"

#: models that cast to float32 on the way (``x.float()``): compared to that precision
FLOAT32 = {"einsum_lm"}

MODELS = ["mha_seq_first", "mha_causal", "sentence_classifier", "decoder_regressor", "einsum_lm",
          "baddbmm_lm", "activation_tower", "glu_tagger", "distiller", "sigmoid_tower",
          "rotary_lm", "mixer", "lstm_tagger", "batchnorm_regressor", "conv_tagger", "conv_pool_classifier",
          "max_pool_classifier", "ids_read_as_list", "unet_tagger", "partial_write", "strided_write",
          "segment_length_lm"]


@pytest.mark.parametrize("name", MODELS)
def test_outside_model_lowering_matches_torch(name: str) -> None:
    _lower_and_check(_single(f"{OUTSIDE}:{name}"), 1e-5 if name in FLOAT32 else 1e-9)


H = SIZES["hidden"]

ACTIVATIONS = {
    "leaky_relu": lambda: nn.LeakyReLU(0.2),
    "leaky_relu_inplace": lambda: nn.LeakyReLU(0.2, inplace=True),
    "hardtanh": lambda: nn.Hardtanh(-0.5, 0.5),
    "relu6_inplace": lambda: nn.ReLU6(inplace=True),
    "elu": lambda: nn.ELU(alpha=0.5),
    "elu_inplace": lambda: nn.ELU(inplace=True),
    "selu": lambda: nn.SELU(),
    "celu": lambda: nn.CELU(alpha=2.0),
    "softplus_threshold": lambda: nn.Softplus(beta=2.0, threshold=1.0),
    "mish": lambda: nn.Mish(),
}


def _activation_probe(make):
    def body(m, x):
        return m["out"](m["act"](m["lin"](x) * 2.0))
    return Probe(body, lin=nn.Linear(H, 2 * H), act=make(), out=nn.Linear(2 * H, H))


for _name, _make in ACTIVATIONS.items():
    globals()[f"probe_{_name}"] = (lambda make: lambda **_kw: _activation_probe(make))(_make)


def probe_glu(**_kw) -> Probe:
    return Probe(lambda m, x: F.glu(m["lin"](x), dim=-1), lin=nn.Linear(H, 2 * H))


LAYERS = {
    "hardswish": lambda m, x: nn.Hardswish()(m["lin"](x) * 3.0),
    "hardsigmoid": lambda m, x: nn.Hardsigmoid()(m["lin"](x) * 3.0),  # 1/6 as float32
    "log_sigmoid": lambda m, x: F.logsigmoid(m["lin"](x)),
    "clamp_both_sides": lambda m, x: m["lin"](x).clamp(-0.5, 0.5),
    "layer_norm_by_var": lambda m, x: (x - x.mean(-1, keepdim=True))
    / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5),
    "stack_then_mean": lambda m, x: torch.stack([m["lin"](x), x], 0).mean(0),
    "repeat": lambda m, x: m["lin"](x[..., : H // 2].repeat(1, 1, 2)),
    "batch_norm_over_tokens": lambda m, x: m["bn"](m["lin"](x).transpose(1, 2)).transpose(1, 2),
    "tril_of_scores": lambda m, x: torch.tril(m["lin"](x) @ x.transpose(1, 2)) @ x,
    # channels first: (batch, hidden, seqlen); same length out where padding allows
    "conv1d_same": lambda m, x: m["conv"](x.transpose(1, 2)).transpose(1, 2),
    "conv1d_strided_dilated_grouped": lambda m, x: m["lin"](
        m["conv_sdg"](x.transpose(1, 2)).repeat(1, 1, 2).transpose(1, 2)),
    "std_normalized": lambda m, x: (m["lin"](x) - x.mean(-1, keepdim=True))
    / (x.std(-1, keepdim=True) + 1e-5),
    "std_population_over_tokens": lambda m, x: m["lin"](x) * torch.std(x, dim=1, correction=0,
                                                                       keepdim=True),
    "std_of_everything": lambda m, x: m["lin"](x) * m["lin"](x).std(),
    "cosine_similarity_gate": lambda m, x: m["lin"](x) * F.cosine_similarity(
        m["lin"](x), x, dim=-1).unsqueeze(-1),
    "normalize": lambda m, x: F.normalize(m["lin"](x), dim=-1),
    # max pooling over the tokens (kept) and over the features; ties share the gradient
    "amax_pool_tokens": lambda m, x: m["lin"](x) + m["lin"](x).amax(1, keepdim=True),
    "amax_of_features": lambda m, x: x * m["lin"](x).amax(-1).unsqueeze(-1),
    "amax_with_ties": lambda m, x: m["lin"](x).clamp(max=0.0).amax(-1, keepdim=True) * x,
    "maximum": lambda m, x: torch.maximum(m["lin"](x), x),
    "minimum_with_ties": lambda m, x: torch.minimum(m["lin"](x).clamp(min=0.0), x.clamp(min=0.0)),
    "conv2d_over_tokens_and_features": lambda m, x: m["conv2d"](x.unsqueeze(1)).mean(1),
    # transposed convolutions (upsampling back along the tokens), reflect and replicate padding
    "conv_transpose1d_upsampled": lambda m, x: m["lin"](
        m["convt"](x.transpose(1, 2)).transpose(1, 2)[:, :x.shape[1]]),
    "conv_transpose1d_grouped_dilated": lambda m, x: m["convt"](x.transpose(1, 2))[
        ..., :x.shape[1]].transpose(1, 2),
    "conv_transpose2d": lambda m, x: m["convt"](x.unsqueeze(1)).mean(1)[:, :x.shape[1], :x.shape[2]],
    "conv1d_reflect": lambda m, x: m["conv"](m["lin"](x).transpose(1, 2)).transpose(1, 2),
    "conv2d_replicate": lambda m, x: m["conv2d"](m["lin"](x).unsqueeze(1)).mean(1)[:, 1:-1],
    # broadcast operands: a row, a per-token scale, a 0-d constant, the smaller one first
    "maximum_broadcast_row": lambda m, x: torch.maximum(m["lin"](x), x[:, :1]),
    "maximum_broadcast_feature": lambda m, x: torch.maximum(m["lin"](x), x.mean(-1, keepdim=True)),
    "maximum_with_zero_tensor": lambda m, x: torch.maximum(m["lin"](x), torch.tensor(0.0,
                                                                                    dtype=x.dtype)),
    "minimum_smaller_first_with_ties": lambda m, x: torch.minimum(
        x.clamp(min=0.0).amax(1, keepdim=True), m["lin"](x).clamp(min=0.0)),
    # a maximum with its index: the gradient goes to the first maximum (ties included)
    "max_dim_values": lambda m, x: m["lin"](x) + m["lin"](x).max(1, keepdim=True).values,
    "max_dim_of_features": lambda m, x: x * torch.max(m["lin"](x), -1)[0].unsqueeze(-1),
    "max_dim_with_ties": lambda m, x: m["lin"](x).clamp(max=0.0).max(-1, keepdim=True)[0] * x,
    "min_dim_with_ties": lambda m, x: x * m["lin"](x).clamp(min=0.0).min(1).values.unsqueeze(1),
    "max_pool1d_over_tokens": lambda m, x: m["lin"](F.max_pool1d(
        m["lin"](x).transpose(1, 2), 2, stride=1).transpose(1, 2)).repeat(1, 2, 1)[:, :x.shape[1]],
    "max_pool1d_features_strided": lambda m, x: m["lin"](x) * F.max_pool1d(
        x, 3, stride=2, dilation=2).sum(-1, keepdim=True),
    "max_pool2d_with_ties": lambda m, x: x + nn.MaxPool2d((2, 3), stride=(1, 2))(
        m["lin"](x).clamp(max=0.0).unsqueeze(1)).mean((1, 2, 3)).view(-1, 1, 1),
    # xIELU's kernel: a where between two computed tensors, expm1, a 0-d value reshaped
    "where_between_tensors": lambda m, x: torch.where(
        m["lin"](x) > 0, m["lin"](x) * x, torch.expm1(torch.minimum(m["lin"](x), x)) - x),
    "one_value_reshaped": lambda m, x: x * (m["lin"](x).mean() + 1.0).reshape(1, 1, 1)
    + torch.log1p(m["lin"](x).sum((0, 1)).reshape(1, 1, -1).abs()) - 2.0,
    # bounds at infinity (Mamba's time-step limits): no bound, in the forward and the backward
    "clamp_to_infinity": lambda m, x: m["lin"](x).clamp(0.0, float("inf")) * x
    + m["lin"](x).clamp(float("-inf"), 0.5),
    # features taken at constant indices, some twice, some never (Falcon's fused heads)
    "index_at_constant_indices": lambda m, x: m["lin"](x)[
        :, :, (torch.arange(H) // 2 + 1) % H] * x,
    # index_select at constant indices along any dim (XLNet's relative shift), some
    # twice, some never; its backward index_add along that dim
    "index_select_at_constant_indices": lambda m, x: torch.index_select(
        m["lin"](x), 2, (torch.arange(H) * 3 + 1) % H) * x + torch.index_select(
        m["lin"](x), 1, torch.arange(x.shape[1]).flip(0) // 2),
    # gathered along the tokens at constant indices that repeat (ProphetNet's relative
    # position buckets); its backward scatter_add at them
    "gather_at_repeating_constant_indices": lambda m, x: _gathered_at_buckets(m["lin"](x), x),
    # rows picked by constant boolean masks over one dim and over two, and written back
    # into zeros at them (X-MOD's language adapters)
    "rows_at_boolean_masks": lambda m, x: _rows_at_masks(m["lin"](x), x),
    # a constant table broadcast over the batch, then laid out with the batch's rows
    # between its own (XLNet's positional table read by an einsum)
    "constant_broadcast_then_flattened": lambda m, x: _times_broadcast_table(m["lin"](x)),
    # writes into blocks of a tensor read after: rows shifted and added, a column set
    "written_blocks": lambda m, x: _written_blocks(m["lin"](x), x),
    # unit triangular solves, lower from the left and upper from the right (Gated
    # DeltaNet's UT transform)
    "unit_triangular_solve": lambda m, x: _unit_solves(m["lin"](x), x),
    # writes into zeros laid out as a transposed tensor (zeros_like keeps its strides:
    # Gated DeltaNet's output buffer)
    "written_into_permuted": lambda m, x: _written_permuted(m["lin"](x), x),
    # an empty tensor filled by two copies into its halves (MiniCPM3's keys)
    "empty_filled_by_blocks": lambda m, x: _empty_filled(m["lin"](x), x),
    # a split into unequal pieces, one through an identity, joined again (an MLA
    # projection's plan); a cat's parts sliced back at their bounds
    "split_rejoined": lambda m, x: _split_rejoined(m["lin"](x), x),
}


def _gathered_at_buckets(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    b, t, f = h.shape
    buckets = (torch.arange(t)[:, None] - torch.arange(f)[None, :]).abs() % t
    return x * torch.gather(h, 1, buckets[None].expand(b, -1, -1))


def _rows_at_masks(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    b, t, _ = h.shape
    rows = torch.arange(b) % 2 == 0
    out = torch.zeros_like(h)
    out[rows] = h[rows] * 2.0 + x[rows]
    out[~rows] = h[~rows].tanh()
    cells = (torch.arange(b)[:, None] + torch.arange(t)[None, :]) % 3 == 0
    return out + torch.zeros_like(h).index_put((cells,), h[cells] * x[cells])


def _times_broadcast_table(x: torch.Tensor) -> torch.Tensor:
    b, t, h = x.shape
    table = torch.sin(torch.arange(t * h, dtype=x.dtype).reshape(t, h) / 7.0)
    laid = table[:, None, :].expand(-1, b, -1).reshape(t * b, h)
    return (x.transpose(0, 1).reshape(t * b, h) * laid).reshape(t, b, h).transpose(0, 1)


def _unit_solves(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a = h @ x.transpose(1, 2)  # [B, S, S]: its diagonal is not read
    low = torch.linalg.solve_triangular(a, h, upper=False, unitriangular=True)
    up = torch.linalg.solve_triangular(a.tanh(), x.transpose(1, 2), upper=True, left=False,
                                       unitriangular=True)
    return low * x + up.transpose(1, 2)


def _written_permuted(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like((h * x).transpose(1, 2))  # [B, H, S], not contiguous
    y[:, 2:5] = h.transpose(1, 2)[:, :3]
    y[:, :, 1] += x[:, 1]
    return (y * x.transpose(1, 2)).transpose(1, 2)


def _empty_filled(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = h.new_empty(*h.shape[:-1], 2 * H)
    y[..., :H].copy_(h * x)
    y[..., H:].copy_(h.tanh())
    return y[..., :H] * y[..., H:] + y[..., 1:H + 1]


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _split_rejoined(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b = h.split([H - 3, 3], dim=-1)
    joined = torch.cat([a, _Identity.apply(b)], dim=-1)
    both = torch.cat([joined * x, x.tanh()], dim=-1)
    return both[..., H:] * both[..., :H] + joined


def _written_blocks(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = h * 2.0
    y[:, 1:] += x[:, :-1]
    y[:, 0] = 0.5
    y[..., 2:4] *= h[..., :2]
    y.transpose(1, 2).mul_(x.transpose(1, 2))  # a write through a permuted view of all of y
    return y * h
LOSSES = {
    "one_hot_by_hand": lambda m, h, y: -(F.one_hot(y, SIZES["vocab"]).to(h.dtype)
                                         * F.log_softmax(m.out(h), -1)).sum(-1).mean(),
    # a constant table indexed by labels the model cut (their one-hot rows narrowed)
    "table_at_shifted_labels": lambda m, h, y: F.mse_loss(
        m.out(h)[:, 1:], torch.linspace(-1.0, 1.0, SIZES["vocab"] ** 2).view(
            SIZES["vocab"], SIZES["vocab"])[y[:, 1:]]),
    "prelu_then_ce": lambda m, h, y: F.cross_entropy(
        m.out(m.parts["prelu"](h)).flatten(0, 1), y.flatten()),
    # ids kept where two comparisons of them both hold, 0 elsewhere, then looked up
    # (gemma3n's per-layer inputs); a bound between two ids
    "ids_in_range_looked_up": lambda m, h, y: F.cross_entropy(m.out(h + F.embedding(
        torch.where(torch.logical_and(y >= 2, y < 6.5), y, 0), m.out.weight)).flatten(0, 1),
        torch.where(torch.logical_or(y > 9, y <= 1.5), 1, y).flatten()),
    # positions counted from the ids that are not a pad id, token types picked at
    # them, each looked up in a table (RoBERTa's embeddings)
    "positions_from_ids": lambda m, h, y: F.cross_entropy(
        m.out(_positions_looked_up(m, h, y)).flatten(0, 1), y.flatten()),
    # lengths counted from the ids compared with ranges of positions (forward and
    # reversed), segments compared with each other as an attention mask (cpmant's)
    "lengths_and_segments": lambda m, h, y: F.cross_entropy(
        m.out(_length_masked(h, y)).flatten(0, 1), y.flatten()),
    # a table's rows at a constant index of two dims with repeats (Whisper's positions,
    # ``weight[position_ids]``) and its index_put backward
    "table_rows_at_positions": lambda m, h, y: F.cross_entropy(m.out(
        h + m.out.weight[:, :SIZES["hidden"]][(torch.arange(y.shape[1]) % 3).repeat(y.shape[0], 1)])
        .flatten(0, 1), y.flatten()),
    # a mask of the ids between two numbers (cpmant's position bias)
    "ids_mask_between_numbers": lambda m, h, y: F.cross_entropy(
        m.out(h * torch.where(y > 3, 2.0, 0.5).unsqueeze(-1) + (y != 3).int().unsqueeze(-1))
        .flatten(0, 1), y.flatten()),
}


def _length_masked(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Scores masked where two tokens' segments differ (a segment is 2 for
    an id other than 0, else 0), rows weighted by whether their position is
    below the row's count of ids other than 0, counted from either end."""
    batch, seqlen = y.shape
    length = (y != 0).sum(-1).to(torch.int32)
    ahead = torch.arange(seqlen)[None, :] < length[:, None]
    behind = torch.tensor(list(range(seqlen))[::-1])[None, :].repeat(batch, 1) <= length[:, None]
    segment = torch.where(y != 0, 2, 0).to(torch.int32)
    segment = segment * 3 + 1
    same = segment[:, :, None] == segment[:, None, :]
    scores = (h @ h.transpose(1, 2)).masked_fill(same == torch.tensor(False), float("-inf"))
    weight = ahead.to(h.dtype) + 0.5 * behind.to(h.dtype)
    return (scores.softmax(-1) @ h) * weight[..., None] + h


def _positions_looked_up(m, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    mask = y.ne(1).int()
    pos = ((torch.cumsum(mask, dim=1).type_as(mask) + 0) * mask).long() + 1
    types = torch.gather(torch.zeros(1, SIZES["vocab"], dtype=torch.long).expand(y.shape[0], -1),
                         1, pos)
    return h + F.embedding(pos, m.out.weight, padding_idx=1) + F.embedding(types, m.out.weight)


CONVS = {
    "conv1d_same": lambda: {"conv": nn.Conv1d(H, H, 3, padding=1)},
    "conv1d_strided_dilated_grouped": lambda: {
        "conv_sdg": nn.Conv1d(H, H, 3, stride=2, padding=2, dilation=2, groups=2, bias=False)},
    "conv2d_over_tokens_and_features": lambda: {"conv2d": nn.Conv2d(1, 3, 3, padding=1)},
    "conv_transpose1d_upsampled": lambda: {
        "convt": nn.ConvTranspose1d(H, H, 3, stride=2, padding=1, output_padding=1)},
    "conv_transpose1d_grouped_dilated": lambda: {
        "convt": nn.ConvTranspose1d(H, H, 2, dilation=2, groups=2, bias=False)},
    "conv_transpose2d": lambda: {"convt": nn.ConvTranspose2d(1, 2, (2, 3), stride=(1, 2),
                                                             padding=(0, 1))},
    "conv1d_reflect": lambda: {"conv": nn.Conv1d(H, H, 3, padding=1, padding_mode="reflect")},
    "conv2d_replicate": lambda: {"conv2d": nn.Conv2d(1, 3, 3, padding=(2, 1),
                                                     padding_mode="replicate")},
}

RECURRENT = {
    "lstm": lambda: nn.LSTM(H, H, batch_first=True),
    "gru": lambda: nn.GRU(H, H, batch_first=True),
}


def probe_layer(name: str):
    if name in LOSSES:
        return lambda **_kw: Probe(lambda m, x: x, LOSSES[name], prelu=nn.PReLU())
    if name in RECURRENT:
        return lambda **_kw: Probe(lambda m, x: m["rnn"](x)[0], rnn=RECURRENT[name]())
    return lambda **_kw: Probe(LAYERS[name], lin=nn.Linear(H, H), bn=nn.BatchNorm1d(H),
                               **CONVS.get(name, dict)())


for _name in [*LAYERS, *LOSSES, *RECURRENT]:
    globals()[f"probe_{_name}"] = probe_layer(_name)


@pytest.mark.parametrize("name", [*ACTIVATIONS, "glu", *LAYERS, *LOSSES, *RECURRENT])
def test_activation_kernels_match_torch(name: str) -> None:
    _lower_and_check(_single(f"{__name__}:probe_{name}"))


@pytest.mark.parametrize("name, says", [
    ("dropout_mlp", "DropoutMLP.ff.2: a random draw"),
    ("branch_on_value", "BranchOnValue: Python reads the value of a computed tensor"),
    ("branch_on_list", "BranchOnList: Python reads the value of a computed tensor"),
    ("scale_from_numpy", "ScaleFromNumpy: Python reads the value of a computed tensor"),
])
def test_what_is_not_exact_arithmetic_is_refused_in_one_line(name: str, says: str) -> None:
    with pytest.raises(LoweringError) as e:
        lower_trace(_single(f"{OUTSIDE}:{name}"), SIZES["vocab"])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def probe_empty_half_written(**_kw) -> Probe:
    """An empty tensor read where nothing was written."""
    def body(m, x):
        y = x.new_empty(*x.shape)
        y[..., :2].copy_(m["lin"](x)[..., :2])
        return y * x
    return Probe(body, lin=nn.Linear(H, H))


def test_an_empty_tensor_read_where_nothing_was_written_is_refused() -> None:
    with pytest.raises(LoweringError) as e:
        lower_trace(_single(f"{__name__}:probe_empty_half_written"), SIZES["vocab"])
    assert "uninitialized memory" in str(e.value) and "\n" not in str(e.value)


def probe_max_index_read(**_kw) -> Probe:
    """An argmax read as a value (a position used as a number)."""
    def body(m, x):
        return x * m["lin"](x).max(-1).indices.unsqueeze(-1).to(x.dtype)
    return Probe(body, lin=nn.Linear(H, H))


def test_the_index_of_a_maximum_read_otherwise_is_refused() -> None:
    """``x.max(dim)``'s values and their backward are lowered; its indices
    are lowered only as that backward's scatter."""
    with pytest.raises(LoweringError) as e:
        lower_trace(_single(f"{__name__}:probe_max_index_read"), SIZES["vocab"])
    assert "the index of a maximum" in str(e.value) and "\n" not in str(e.value)


def probe_max_pool_padded(**_kw) -> Probe:
    return Probe(lambda m, x: F.max_pool1d(x, 3, stride=1, padding=1), lin=nn.Linear(H, H))


def test_max_pooling_with_padding_matches_torch() -> None:
    """Padding (-inf in torch) is lowered (backends/torch/lowering/pool.py)."""
    _lower_and_check(_single(f"{__name__}:probe_max_pool_padded"))


def _verdict(argv: str):
    from backends.torch.__main__ import parser, resolve, trace_and_build
    from main import verify
    args = resolve(parser().parse_args([*argv.split(), "--hidden", "8", "--ffn", "8"]))
    (plan_s, plan_p), _ = trace_and_build(args)
    return verify(plan_s, plan_p), plan_p


@pytest.mark.parametrize("argv", [
    # the ids transposed (sequence first), nn.MultiheadAttention with a bool mask
    f"--model {OUTSIDE}:mha_seq_first --recipe backends.torch.stock_recipes:ddp --dp 2 --tp 1",
    # token types from zeros_like(ids), labels[:, 0] % 3, a 3-class head, mean pooling
    f"--model {OUTSIDE}:sentence_classifier --recipe ddp_avg --dp 2 --tp 1",
    # (labels % 2) as numbers, BCE with logits, F.glu, addcmul, FSDP2 (one-row head padded)
    f"--model {OUTSIDE}:glu_tagger --recipe backends.torch.stock_recipes:fsdp --dp 2 --tp 1",
    # causal depthwise and pointwise nn.Conv1d (replicated) beside a Megatron-split MLP
    f"--model {OUTSIDE}:conv_tagger --recipe backends.torch.stock_recipes:tp_mlp --dp 2 --tp 2",
    # nn.Conv1d filters, torch.amax pooling over time, a per-rank mean averaged over dp
    f"--model {OUTSIDE}:conv_pool_classifier --recipe ddp_avg --dp 2 --tp 1",
])
def test_outside_models_verify_in_parallel(argv: str) -> None:
    verdict, _ = _verdict(argv)
    assert verdict.success, verdict.message


def test_rowwise_output_left_partial_fails_at_the_residual_add() -> None:
    """Each tensor-parallel rank adds its partial sum of ``mlp.c_proj`` to
    the residual stream (the real run differs): the counterexample is the
    block's residual addition, on every rank."""
    verdict, plan_p = _verdict(f"--model {OUTSIDE}:sigmoid_tower --recipe "
                               f"tests.outside_mistakes:tp_mlp_partial_output --dp 1 --tp 2")
    assert not verdict.success and verdict.kind == "stage"
    nodes = [plan_p.nodes[i] for r in verdict.failed for i in r.stage.gp_nodes]
    assert {(n.op, n.name) for n in nodes} == {("add", "SigmoidTower.blocks.0")}


def test_average_divided_twice_names_the_division_and_the_rank() -> None:
    verdict, _ = _verdict(f"--model {OUTSIDE}:baddbmm_lm --recipe "
                          f"tests.outside_mistakes:ddp_avg_divided_twice --dp 2 --tp 1")
    assert not verdict.success
    assert "rank 0" in verdict.message and "1/2 x the gradient" in verdict.message


def test_convolutions_left_out_of_the_dp_sum_fail_at_their_gradients() -> None:
    """A hand-written DDP that sums the gradients of ``nn.Linear`` and
    ``nn.Embedding`` modules only: each replica keeps its own convolution
    gradients, and the failure names a convolution."""
    verdict, _ = _verdict(f"--model {OUTSIDE}:conv_tagger --recipe "
                          f"tests.outside_mistakes:ddp_linear_only --dp 2 --tp 1")
    assert not verdict.success
    assert "rank" in verdict.message and any(f"blocks.0.{m}wise" in verdict.message
                                            for m in ("depth", "point")), verdict.message


def probe_conv_circular(**_kw) -> Probe:
    return Probe(lambda m, x: m["conv"](m["lin"](x).transpose(1, 2)).transpose(1, 2),
                 lin=nn.Linear(H, H), conv=nn.Conv1d(H, H, 3, padding=1, padding_mode="circular"))


def probe_circular_crop(**_kw) -> Probe:
    return Probe(lambda m, x: F.pad(m["lin"](x), (-1, 1), mode="circular"), lin=nn.Linear(H, H))


def test_circular_padding_matches_torch_and_a_crop_is_refused() -> None:
    """Torch writes circular padding into slices of an empty tensor; the
    recorder runs it as a concatenation of slices (docs/soundness.md, "Plans
    traced from PyTorch", 27). A negative (cropping) circular padding still
    reaches torch's kernel: it writes the cropped part into an empty tensor,
    then copies the wrapped column from that tensor before it is whole: a
    read of a tensor partly written, refused."""
    _lower_and_check(_single(f"{__name__}:probe_conv_circular"))
    with pytest.raises(LoweringError) as e:
        lower_trace(_single(f"{__name__}:probe_circular_crop"), SIZES["vocab"])
    assert "uninitialized memory" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("recipe", ["ddp_ignore_index_first_rank", "ddp_key_mask_off_by_one"])
def test_a_pad_id_that_differs_on_one_rank_fails_there(recipe: str) -> None:
    """Rank 1 ignores (or masks) another id than the single-device step: its
    constant is an input of its own, its column of the ids another one;
    both FAIL at the model's node on rank 1, as the real runs differ."""
    verdict, plan_p = _verdict(f"--model gpt2_padded --recipe {recipe} --dp 2 --tp 1")
    assert not verdict.success and verdict.kind == "stage"
    nodes = [plan_p.nodes[i] for r in verdict.failed for i in r.stage.gp_nodes]
    assert any(n.rank == 1 and n.name == "MaskedLM" for n in nodes), nodes


def _flipped(truth):
    return lambda x, y: truth(y, x)


def _one_point_fewer(real):
    """One-hot rows of bounded integers interpolated without their top value."""
    def rows(lw, v, n):
        lo, hi = lw.integral[v]
        lw.integral[v] = (lo, hi - 1)
        return real(lw, v, n)
    return rows


@pytest.mark.parametrize("name, module, helper, wrong", [
    ("written_blocks", "activations", "put_region",
     lambda real: lambda lw, x, starts, steps, block, shape=None:
     real(lw, x, [max(s - 1, 0) for s in starts], steps, block, shape)),
    ("index_at_constant_indices", "const_index", "_checked",
     lambda real: lambda lw, values, size: (real(lw, values, size) + 1) % size),
    ("positions_from_ids", "counts", "one_hot_rows", _one_point_fewer),
    ("unit_triangular_solve", "triangular", "unit_triangular_inverse",
     lambda real: lambda lw, a, upper: real(lw, a, not upper)),
    ("split_rejoined", "layout", "_cat_part",
     lambda real: lambda lw, f: real(lw, type(f)(f.x, f.dim, 0, f.length))),
    # a comparison's truths read from the other side (a < b as b < a)
    ("lengths_and_segments", "counts", "COMPARISONS",
     lambda real: {op: (_flipped(truth), swapped) for op, (truth, swapped) in real.items()}),
    # the rows divided by another common denominator than theirs
    ("lengths_and_segments", "counts", "scaled_rows",
     lambda real: lambda lw, v: (lambda rows, d: (rows, d + 1))(*real(lw, v))),
    ("where_between_tensors", "arithmetic", "selected",
     lambda real: lambda lw, cmp, t, where_true, shape: real(lw, cmp, t, not where_true, shape)),
])
def test_a_lowering_made_wrong_fails_the_comparison(monkeypatch, name, module, helper, wrong) -> None:
    """The comparison with PyTorch is the oracle of these lowerings: a block
    moved by one, indices off by one, or the branches swapped, do not match."""
    import importlib
    mod = importlib.import_module(f"backends.torch.lowering.{module}")
    monkeypatch.setattr(mod, helper, wrong(getattr(mod, helper)))
    with pytest.raises(AssertionError):
        _lower_and_check(_single(f"{__name__}:probe_{name}"))


def test_block_write_under_a_per_rank_mean_verifies_and_its_sum_fails_at_the_mean() -> None:
    """``y[:, 0] = 0``: its backward puts a block of zeros beside the
    gradient, which a per-rank mean scales by 2 on each of two replicas;
    the zeros take that factor (docs/soundness.md, "Plans traced from
    PyTorch", 40), so averaging over dp verifies, and summing over dp
    fails naming the loss's division, not the zeros."""
    verdict, _ = _verdict(f"--model {OUTSIDE}:partial_write --recipe ddp_avg --dp 2 --tp 1")
    assert verdict.success, verdict.message
    verdict, _ = _verdict(f"--model {OUTSIDE}:partial_write --recipe "
                          f"backends.torch.stock_recipes:ddp --dp 2 --tp 1")
    assert not verdict.success
    assert "2 x the gradient, a factor applied by div" in verdict.message
