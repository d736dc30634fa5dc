"""Any Hugging Face causal-LM family, built from transformers' own auto
mappings and parallelized by transformers itself (``--hf FAMILY``).

The families here take distinct paths through the backend: GLM (interleaved
and partial rotary: strided and empty slices; a chunked gate/up projection),
Gemma2 (soft-capping, scaled embeddings, a sliding window, a
vocabulary-parallel lookup with a ``padding_idx``), Phi-3 (fused projections
gathered, a rotary pass-through part that is empty), GPT-2 (no tensor-parallel
plan: DDP only; learned positions, layer norm with bias). Wrong plans built
from a family's own plan fail naming the module and the rank; families the
backend cannot build are one line. The other families and meshes are suite
cases (scripts/torch_suite.py -k hf).
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

from backends.torch.__main__ import main as backend_main  # noqa: E402
from backends.torch.__main__ import parser, trace_and_build  # noqa: E402
from backends.torch.lowering import LoweringError  # noqa: E402
from backends.torch.zoo import hf  # noqa: E402
from main import verify  # noqa: E402
from verdict.report import failure  # noqa: E402


def verdict_of(argv: str):
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(argv.split()))
    return verify(plan_s, plan_p)


def failure_text(argv: str) -> str:
    """What ``main.py`` prints for a plan pair that is not equivalent."""
    (plan_s, plan_p), _ = trace_and_build(parser().parse_args(argv.split()))
    verdict = verify(plan_s, plan_p)
    assert not verdict.success and verdict.kind != "internal", verdict.message
    return "\n".join([verdict.message, *failure(verdict, plan_s, plan_p)])


@pytest.mark.parametrize("argv", [
    "--hf glm --dp 1 --tp 2",
    "--hf gemma2 --dp 1 --tp 2",
    "--hf phi3 --dp 1 --tp 2",
    "--hf gpt2 --recipe ddp --dp 2 --tp 1",
])
def test_family_verifies(argv: str) -> None:
    verdict = verdict_of(argv)
    assert verdict.success, verdict.message


def test_rowwise_output_left_partial_fails_where_it_is_read() -> None:
    text = failure_text("--hf mistral --recipe tp_rowwise_not_reduced --dp 1 --tp 2")
    assert "rank=1" in text and "layers.0.add" in text, text  # the residual add reads the partial sum


def test_ddp_averaging_a_shared_out_loss_fails() -> None:
    text = failure_text("--hf opt --recipe ddp_avg --dp 2 --tp 1")
    assert "rank 0" in text and "1/2 x" in text, text


@pytest.mark.parametrize("family, reason", [
    ("gpt2", "no tensor-parallel plan"),
    ("mllama", "composite model"),  # its text model is no causal-LM family
    ("gemma4_assistant", "takes no labels and computes no loss"),
    ("no_such_family", "not a causal-LM model type"),
])
def test_refused_in_one_line(family: str, reason: str, capsys) -> None:
    assert backend_main(["--hf", family, "--dp", "1", "--tp", "2", "-o", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert reason in err and len(err.splitlines()) == 1, err


def test_a_family_transformers_cannot_build_by_default_is_fitted() -> None:
    """DBRX's attention reads ``attn_config.rope_theta``, which its own
    attention configuration does not have: transformers cannot build its
    default, and the backend's small configuration gives the part the field
    (docs/soundness.md, "Plans traced from PyTorch", 117 (b))."""
    assert "rope_theta" in (hf.default_build_error("dbrx") or "")
    assert hf.default_build_error("llama") is None
    hf.build("dbrx", layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)


def test_a_composite_family_is_built_as_its_text_model(capsys) -> None:
    from backends.torch.__main__ import text_of_composite
    assert text_of_composite("gemma3") == "gemma3_text" and text_of_composite("qwen3_5") == "qwen3_5_text"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "vision_config, left out" in err[0] and "no tower in it" in err[1], err
    assert text_of_composite("gemma4_unified_assistant") == "gemma4_unified_assistant"  # no labels
    assert text_of_composite("llama") == "llama"


def test_families_come_from_transformers_auto_mapping() -> None:
    families = hf.families()
    assert {"gemma2", "phi3", "gpt_neox", "falcon", "opt"} <= set(families)
    cfg = hf.config("gemma2", layers=2, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.vocab_size) == (16, 2, 4, 16)
    assert cfg.sliding_window == 2 and cfg.num_key_value_heads == 2
    gpt2 = hf.config("gpt2", layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)
    assert (gpt2.n_embd, gpt2.n_inner, gpt2.resid_pdrop, gpt2.eos_token_id) == (16, 32, 0.0, 15)


def test_unknown_family_is_not_a_model_factory() -> None:
    with pytest.raises(AttributeError):
        hf.no_such_family  # noqa: B018
    with pytest.raises(LoweringError, match="not a causal-LM model type"):
        trace_and_build(parser().parse_args(["--hf", "bert_nope"]))


def test_linear_attention_heads_fit_the_small_sizes() -> None:
    """Kimi Delta Attention's heads (``linear_num_heads``, ``linear_head_dim``)
    as many and as wide as the others: at its default 32 heads of 128 its zero
    state alone is 4 x 32 x 128 x 128 values, refused as a constant too large
    to keep."""
    cfg = hf.config("kimi_linear", layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)
    assert (cfg.linear_num_heads, cfg.linear_head_dim) == (4, 4)


@pytest.mark.parametrize("family", ["codegen", "gptj", "blenderbot", "gpt_neo", "hunyuan_v1_dense",
                                    "bamba", "gemma3n_text", "mamba2", "gemma4_text", "prophetnet",
                                    "xmod"])
def test_per_layer_and_per_head_fields_fit_the_small_sizes(family: str) -> None:
    """Fields a family checks against the sizes (a rotary width, the
    decoder's heads, a list of attention kinds, shared key-value layers, a
    Mamba mixer's heads, a head size left None) fitted to them: the family's
    model runs one step at the backend's small sizes."""
    import torch
    model = hf.build(family, layers=1, hidden=16, heads=4, ffn=8, vocab=16, seqlen=4).double()
    tokens = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()


@pytest.mark.parametrize("family, layers", [("olmo_hybrid", 2), ("zamba", 2), ("zamba2", 2),
                                            ("llama", 1), ("rwkv", 2)])
def test_a_family_refusing_one_layer_builds_with_each_kind(family: str, layers: int) -> None:
    """A hybrid whose configuration refuses one layer (it needs each of its
    kinds of layer) is built with the fewest layers that hold every kind;
    a family whose model cannot be built with one layer (RWKV divides by
    the layer count less one) with two."""
    assert hf.fewest_layers(family) == layers
    cfg = hf.config(family, layers=layers, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)
    kinds = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    default = hf.classes(family)[0]()
    every = getattr(default, "layer_types", None) or getattr(default, "layers_block_type", None)
    if every:
        assert set(kinds) == set(every) and len(kinds) == layers


@pytest.mark.parametrize("family", ["dots1", "reformer", "lfm2_moe", "dots3_note_text"])
def test_a_default_that_does_not_fit_the_sizes_is_fitted(family: str) -> None:
    """Defaults that left a field unset or per layer, or sized to the
    family's own positions, fitted from the configuration: Dots1's expert
    and shared-expert counts left None, Reformer's axial position factors
    (their product the sequence) and widths (their sum the hidden size),
    LFM2-MoE's layer kinds left None, Dots3's per-layer latent rank read
    globally; each runs one step at the backend's small sizes."""
    import torch
    model = hf.build(family, layers=1, hidden=16, heads=4, ffn=8, vocab=16, seqlen=4).double()
    tokens = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()


def test_axial_positions_fit_the_sequence_and_the_width() -> None:
    cfg = hf.config("reformer", layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=6)
    assert list(cfg.axial_pos_shape) == [2, 3] and sum(cfg.axial_pos_embds_dim) == 16
    assert cfg.lsh_attn_chunk_length == cfg.local_attn_chunk_length == 6
    assert cfg.attention_head_size == 4 and cfg.feed_forward_size == 32


def test_an_expert_count_left_none_means_a_mixture_only_with_an_expert_width() -> None:
    dots1 = hf.config("dots1", layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)
    assert (dots1.n_routed_experts, dots1.num_experts_per_tok, dots1.n_shared_experts) == (4, 2, 1)
    gemma4 = hf.config("gemma4_text", layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)
    assert gemma4.num_experts is None and not gemma4.enable_moe_block


def test_one_layer_too_few_for_a_hybrid_is_one_line() -> None:
    with pytest.raises(ValueError, match="each of its kinds of layer .*--layers 2"):
        hf.config("zamba", layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)


@pytest.mark.parametrize("family", ["bart", "marian", "prophetnet", "trocr"])
def test_an_encoder_decoder_family_gets_the_layer_count_in_both_stacks(family: str) -> None:
    """Its causal LM is the decoder: the decoder's layers are the backend's
    count (bart's decoder kept its 12 where ``num_hidden_layers`` names the
    encoder's), and it is a decoder (``is_decoder``)."""
    cfg = hf.config(family, layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4)
    fields = cfg.to_dict()
    counts = [fields[n] for n in ("encoder_layers", "decoder_layers", "num_encoder_layers",
                                  "num_decoder_layers") if n in fields]
    assert counts and set(counts) == {1}, fields
    assert cfg.is_decoder


def _rms_norm_in_float64(self, hidden):
    return hidden * (hidden.pow(2).mean(dim=-1, keepdim=True) + self.eps).rsqrt() * self.weight


def test_cpmant_masks_from_counts_lower_exactly(monkeypatch) -> None:
    """CPM-Ant builds its attention mask and position bias from the ids:
    lengths counted from them and compared with ranges of positions, segments
    compared with each other, prompt ids joined before the tokens, a bucket
    selected between a constant and the segments' and looked up, rows with
    every key masked (NaN in torch) zeroed by a later fill. Its step, with
    its layer norm in float64 (it computes the variance in float32), lowers
    to torch's loss and gradients."""
    from transformers.models.cpmant import modeling_cpmant

    from backends.torch.lowering import lower_trace
    from backends.torch.tracer.check import check_lowering
    from backends.torch.tracer.rank import run
    monkeypatch.setattr(modeling_cpmant.CpmAntLayerNorm, "forward", _rms_norm_in_float64)
    sizes = {"layers": 1, "hidden": 16, "heads": 4, "ffn": 32, "vocab": 16, "seqlen": 4}
    trace = run({"model": "backends.torch.hf:cpmant", "model_kwargs": sizes, "recipe": "",
                 "dp": 1, "tp": 1, "pp": 1, "batch": 4, "seqlen": 4, "vocab": 16, "seed": 0,
                 "parallel": False, "keep_values": True}, 0)
    check = check_lowering(trace, lower_trace(trace, 16), 16)
    assert check.grads and not check.differences(rtol=1e-9, atol=1e-11), check.differences()


@pytest.mark.parametrize("family, mean", [("bart", True), ("cpmant", True), ("xlm", True),
                                          ("llama", False), ("gpt2", False)])
def test_a_family_computing_its_own_mean_gives_the_ranks_share(family: str, mean: bool) -> None:
    """A family whose forward takes its own mean over the tokens it is given
    (no ``num_items_in_batch``) returns, like the others, the rank's share of
    the step's mean: its mean times the rank's tokens over the step's."""
    import torch
    model = hf.build(family, layers=1, hidden=16, heads=4, ffn=32, vocab=16, seqlen=4).double()
    assert model.mean_loss is mean
    tokens = torch.randint(1, 16, (2, 4), generator=torch.Generator().manual_seed(0))
    model.global_tokens = tokens.numel()
    whole = model(tokens, tokens)
    model.global_tokens = 2 * tokens.numel()
    assert torch.allclose(model(tokens, tokens), whole / 2)
