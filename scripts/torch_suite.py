"""Trace and verify every (model, recipe) case of the PyTorch backend's table.

    .venv/bin/python scripts/torch_suite.py [-k SUBSTRING ...] [--list]

Each case is one line of ``CASES``: a name, the arguments of
``python -m backends.torch`` (model, recipe, sizes, mesh) and the exit code
expected of the whole run (0 equivalent, 1 not equivalent, 2 refused). A
case is traced in this process as the backend's CLI does (one process per
rank), its plan pair verified as ``main.py`` does, and reported on one line:
case, expected, got, wall seconds, CPU seconds (this process and the rank
processes). The single-device trace is shared by the cases of the same
model and sizes. The last line is ``torch suite: N of M as expected``; the
exit status is 0 when every case ran as expected.
"""

from __future__ import annotations

import argparse
import resource
import shlex
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.torch.__main__ import parser as backend_parser  # noqa: E402
from backends.torch.__main__ import resolve, trace_and_build  # noqa: E402
from backends.torch.errors import WrongStep  # noqa: E402
from backends.torch.lowering import LoweringError  # noqa: E402
from backends.torch.tracer.check import LoadedValueMismatch  # noqa: E402
from backends.torch.tracer.rank import load  # noqa: E402
from main import verify  # noqa: E402
from verdict.diagnosis import diagnose  # noqa: E402

STOCK = "backends.torch.stock_recipes:"
HASH_MOE = "tests.hash_routed_models:hash_moe_tagger"
CLIPPED = "tests.hash_routed_models:clipped_tagger"
ROOT_CLIPPED = "tests.hash_routed_models:root_clipped_tagger"
HASH_SIZES = "--hidden 8 --ffn 12 --vocab 10"
SCALING = "backends.torch.scaling_recipes:"
#: torchtitan's Llama3 debugmodel under its own parallelize_llama (backends/torch/zoo/titan.py)
TITAN = ("--model backends.torch.titan:llama3_debugmodel --recipe backends.torch.titan:parallelize "
         "--vocab 2048")

#: Megatron-Core's GPTModel and training step, run by Megatron itself (backends/torch/zoo/megatron.py)
MEGATRON = "--model backends.torch.megatron:gpt --recipe backends.torch.megatron:"
#: users' own Megatron steps (tests/megatron_user_steps.py), models and recipes
MEGATRON_USER = "--model tests.megatron_user_steps:"
USER_RECIPES = "tests.megatron_user_steps:"

#: recipes written with PyTorch's own APIs outside the backend (tests/outside_recipes.py)
OUTSIDE = "tests.outside_recipes:"
#: models written outside the backend (tests/outside_models.py), recipes with mistakes for them
USER_MODELS = "tests.outside_models:"
MISTAKES = "tests.outside_mistakes:"
#: the second set written outside the backend (tests/outside_apis_models.py, outside_apis_recipes.py)
OUT_APIS_M = "tests.outside_apis_models:"
OUT_APIS_R = "tests.outside_apis_recipes:"
#: the third set (tests/outside_apis_causal_models.py, outside_apis_causal_recipes.py)
OC_M = "tests.outside_apis_causal_models:"
OC_R = "tests.outside_apis_causal_recipes:"
#: a rotary table whose batch is its second dim (tests/recut_models.py)
RECUT = "tests.recut_models:"
NO_ENTRIES = "tests.no_entries_models:no_entries_lm"
#: models with strided slices and writes (tests/strided_models.py)
STRIDED = "tests.strided_models:"
#: their mistakes on one rank (tests/strided_mistakes.py)
STRIDED_BUGS = "tests.strided_mistakes:"
#: whole-tensor maxima, padded pooling, circular padding (tests/pooling_padding_models.py),
#: uneven Shard(1) (tests/uneven_shard_recipes.py)
POOL_MODELS = "tests.pooling_padding_models:"
UNEVEN_RECIPES = "tests.uneven_shard_recipes:"
LOADED = "tests.loaded_values_recipes:"
#: PyTorch's test Transformer and its own parallelize (tests/dtensor_transformer.py)
DT = "tests.dtensor_transformer:"
#: labels masked before the loss (tests/label_mask_models.py)
LM = "tests.label_mask_models:"
#: losses read off the log-probabilities (tests/loss_parallel_models.py)
LP = "tests.loss_parallel_models:"
#: plans applied to values they do not describe (tests/tp_plan_mistakes.py)
TPM = "tests.tp_plan_mistakes:"
#: clipping by trainers' gradient norms (tests/norm_clippers.py)
CLIP = "--clip 0.5 --clipper tests.norm_clippers:"
MESHES = {"dp2": "--dp 2 --tp 1", "dp2 tp2": "--dp 2 --tp 2", "dp1 tp2": "--dp 1 --tp 2"}

#: (case, arguments of ``python -m backends.torch``, expected exit code)
CASES: list[tuple[str, str, int]] = [
    ("llama tp_sp dp2 tp2", "--model llama --recipe tp_sp --dp 2 --tp 2", 0),
    ("llama tp_sp_vocab dp2 tp2", "--model llama --recipe tp_sp_vocab --dp 2 --tp 2", 0),
    ("llama fsdp_tp dp2 tp2", "--model llama --recipe fsdp_tp --dp 2 --tp 2", 0),
    ("llama pp_gpipe pp2", "--model llama --recipe pp_gpipe --pp 2 --dp 1 --tp 1 --layers 2", 0),
    ("llama pp_1f1b pp2", "--model llama --recipe pp_1f1b --pp 2 --dp 1 --tp 1 --layers 2", 0),
    ("llama bug partial as replicate", "--model llama --recipe tp_sp_partial_as_replicate", 1),
    ("llama bug norm not parallel", "--model llama --recipe tp_sp_norm_not_parallel", 1),
    ("llama bug fsdp default divide", "--model llama --recipe fsdp_tp_default_divide", 1),
    ("llama_titan tp_sp dp2 tp2", "--model llama_titan --recipe tp_sp --dp 2 --tp 2", 0),
    ("llama_titan fsdp_tp dp2 tp2", "--model llama_titan --recipe fsdp_tp --dp 2 --tp 2", 0),
    ("gpt2 ddp dp2", f"--model gpt2 --recipe {STOCK}ddp --dp 2 --tp 1 --layers 2", 0),
    ("gpt2 ddp dp2 tp2", f"--model gpt2 --recipe {STOCK}ddp --dp 2 --tp 2 --layers 2", 0),
    ("gpt2_masked ddp dp2", f"--model gpt2_masked --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("gpt2 fsdp dp2", f"--model gpt2 --recipe {STOCK}fsdp --dp 2 --tp 1", 0),
    ("gpt2 tp_mlp dp2 tp2", f"--model gpt2 --recipe {STOCK}tp_mlp --dp 2 --tp 2 --layers 2", 0),
    ("mlp tp_mlp dp2 tp2", f"--model mlp --recipe {STOCK}tp_mlp --dp 2 --tp 2", 0),
    ("mlp ddp dp2", f"--model mlp --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("mlp fsdp dp2", f"--model mlp --recipe {STOCK}fsdp --dp 2 --tp 1", 0),
    # Hugging Face transformers, parallelized by transformers itself (backends/torch/zoo/hf.py)
    ("hf llama tp2", "--hf llama --dp 1 --tp 2", 0),
    ("hf llama tp2 fsdp2", "--hf llama --dp 2 --tp 2", 0),
    ("hf qwen2 tp2", "--hf qwen2 --dp 1 --tp 2", 0),
    ("hf qwen2 tp2 fsdp2", "--hf qwen2 --dp 2 --tp 2", 0),
    ("hf qwen3 tp2", "--hf qwen3 --dp 1 --tp 2", 0),
    ("hf qwen3 tp2 fsdp2", "--hf qwen3 --dp 2 --tp 2", 0),
    ("hf qwen3 bug norm grads not reduced", "--hf qwen3 --recipe tp_norm_grads_not_reduced --dp 1 --tp 2", 1),
    ("hf llama bug fsdp avg", "--hf llama --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    ("hf qwen3_moe ep over the tp ranks (refused before: the backward picked a rank's pairs "
     "among the batch's; verifies since soundness 99; gloo same)",
     "--hf qwen3_moe --recipe ep_fsdp --dp 1 --tp 2", 0),
    ("hf llama hsdp dp4", "--hf llama --recipe hsdp --dp 4 --tp 1", 0),
    # the families' table re-run (docs/soundness.md, "Plans traced from PyTorch", 95):
    # transformers' Apertus plan leaves xIELU's one-element parameters unreduced over tp
    # (gloo differs); Dots1's default leaves its experts' counts None (fitted)
    ("hf apertus dp2 tp2 bug xielu scalars not reduced over tp",
     "--hf apertus --dp 2 --tp 2", 1),
    ("hf dots1 dp2 tp2 (expert counts left None by the default)", "--hf dots1 --dp 2 --tp 2", 0),
    ("hf dots1 bug fsdp avg", "--hf dots1 --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    ("hf reformer dp2 (axial positions fitted to the sequence, reversible layers)",
     "--hf reformer --dp 2 --tp 1", 0),
    ("hf reformer ddp avg bug", "--hf reformer --recipe ddp_avg --dp 2 --tp 1", 1),
    # MoE families refused before (docs/soundness.md, "Plans traced from PyTorch", 109):
    # one expert's one-row weight cut over tp and padded over dp (gloo same, avg differs),
    # ERNIE's [1, n] moe_statics added in the forward (gloo --rtol 1e-6 same, avg
    # differs), Inkling2's float32 router read in float64 and its experts' gate_up
    # "colwise" where the others pack it (gloo differs), PhiMoE's Gumbel-sampled routing
    ("moe hf hunyuan_v1_moe dp2 tp2 (one expert's row padded over dp)",
     "--hf hunyuan_v1_moe --dp 2 --tp 2", 0),
    ("moe hf hunyuan_v1_moe bug fsdp avg", "--hf hunyuan_v1_moe --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    ("moe hf ernie4_5_moe dp2 tp2 (moe_statics added in the forward)",
     "--hf ernie4_5_moe --dp 2 --tp 2", 0),
    ("moe hf ernie4_5_moe bug fsdp avg", "--hf ernie4_5_moe --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    ("moe hf inkling2_text dp2 tp2 bug gate_up colwise, not packed",
     "--hf inkling2_text --dp 2 --tp 2", 1),
    ("moe hf phimoe refused (Gumbel-sampled routing read by Python)",
     "--hf phimoe --dp 2 --tp 2", 2),
    # a rank whose rows all go to one expert (deepseek_v2, rank 2: expert 3) writes the
    # single-device step's row mask of ones, forward and backward (soundness 121 a; gloo same)
    ("moe hf deepseek_v2 dp2 tp2 (a rank's rows all routed to one expert: its mask of ones)",
     "--hf deepseek_v2 --dp 2 --tp 2", 0),
    ("moe hf deepseek_v2 bug fsdp avg", "--hf deepseek_v2 --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    # a hash router's experts, a constant table looked up at the ids (DeepSeek-V4's
    # tid2eid[input_ids]), as recorded routing; a rank routing by another table is a
    # finding (soundness 128 b; gloo same, the other table and avg differ)
    ("moe hf deepseek_v4 dp2 tp2 (a hash router: its table looked up at the ids)",
     "--hf deepseek_v4 --dp 2 --tp 2", 0),
    ("moe hf deepseek_v4 bug fsdp avg", "--hf deepseek_v4 --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    ("moe hf deepseek_v4 ep2 (a hash router under its own expert-parallel plan)",
     "--hf deepseek_v4 --dp 2 --tp 1 --ep 2", 0),
    ("moe hash_moe_tagger ddp (a hash router)",
     f"--model {HASH_MOE} --recipe {STOCK}ddp --dp 2 --tp 1 {HASH_SIZES}", 0),
    ("moe hash_moe_tagger bug other table on a rank",
     f"--model {HASH_MOE} --recipe tests.hash_routed_models:ddp_other_table --dp 2 --tp 1 "
     f"{HASH_SIZES}", 1),
    # issue 30: families at dp2 ep2 through their own expert-parallel plan (soundness 114):
    # ranks sending different numbers of experts' results (gloo same; the undivided
    # experts' gradients FAIL), a rank whose experts receive no token (refused by the lowering)
    ("moe hf zaya ep2 (ranks send different numbers of experts' results, soundness 114 b)",
     "--hf zaya --dp 2 --tp 1 --ep 2", 0),
    ("moe hf zaya ep2 bug expert grads 2x (pytorch 160285)",
     "--hf zaya --recipe harness.moe_bugs:ep_expert_grads_undivided --dp 2 --tp 1 --ep 2", 1),
    # a rank whose experts receive no token (afmoe: a zero-initialized router, every token to
    # experts 2 and 3): its placeholder row's backward zeros, its gradients the single-device
    # terms' pieces proved zero (soundness 125; gloo same; the undivided gradients FAIL)
    ("moe hf afmoe dp2 ep2 (rank 0's experts receive no token, soundness 125)",
     "--hf afmoe --dp 2 --tp 1 --ep 2", 0),
    ("moe hf afmoe dp2 ep2 bug expert grads 2x (pytorch 160285)",
     "--hf afmoe --recipe harness.moe_bugs:ep_expert_grads_undivided --dp 2 --tp 1 --ep 2", 1),
    ("moe hf afmoe dp2 ep2 bug token to another expert refused (no SUCCESS)",
     "--hf afmoe --recipe harness.moe_bugs:ep_token_to_other_expert --dp 2 --tp 1 --ep 2", 2),
    # issue 33's families: blocks written into an empty tensor and a split rejoined
    # (MiniCPM3), positions counted from the ids (RoBERTa's), a unit triangular
    # solve (Gated DeltaNet); each with a wrong plan
    ("outside hf minicpm3 dp2 tp2", "--hf minicpm3 --dp 2 --tp 2", 0),
    ("outside hf minicpm3 mla rope not reduced bug",
     "--hf minicpm3 --recipe tp_mla_rope_not_reduced --dp 1 --tp 2", 1),
    ("outside hf camembert dp2", "--hf camembert --dp 2 --tp 1", 0),
    ("outside hf data2vec-text dp2", "--hf data2vec-text --dp 2 --tp 1", 0),
    ("outside hf camembert ddp avg bug", "--hf camembert --recipe ddp_avg --dp 2 --tp 1", 1),
    ("outside hf qwen3_5_text dp2 tp2", "--hf qwen3_5_text --dp 2 --tp 2", 0),
    ("outside hf qwen3_5_text fsdp avg bug",
     "--hf qwen3_5_text --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    # exp of scores masked with -inf (Kimi Delta Attention's decay mask: soundness 96),
    # with a wrong plan leaving the decay parameters' gradients unreduced
    ("hf bailing_hybrid dp2 (Kimi Delta Attention: exp of -inf masked decay)",
     "--hf bailing_hybrid --dp 2 --tp 1", 0),
    ("hf bailing_hybrid dp2 tp2", "--hf bailing_hybrid --dp 2 --tp 2", 0),
    ("hf kimi_linear dp2 (Kimi Delta Attention: exp of -inf masked decay)",
     "--hf kimi_linear --dp 2 --tp 1", 0),
    ("hf kimi_linear dp2 tp2", "--hf kimi_linear --dp 2 --tp 2", 0),
    ("hf bailing_hybrid bug decay gradients not reduced",
     "--hf bailing_hybrid --recipe harness.linear_attn_bugs:ddp_decay_unreduced --dp 2 --tp 1", 1),
    # Gated DeltaNet with experts (its zero padding read by other ops: lowering/scan.py)
    ("hf qwen3_5_moe_text dp2 tp2", "--hf qwen3_5_moe_text --dp 2 --tp 2", 0),
    ("decay_tagger exp of -inf masked scores ddp dp2",
     f"--model tests.decay_models:decay_tagger --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    # CPM-Ant's masks from counts of the ids (lengths against position ranges, segments,
    # prompt ids joined, position buckets selected and looked up, rows zeroed after a NaN
    # softmax); its loss a mean over the rank's tokens, taken as the rank's share
    ("hf cpmant dp2", "--hf cpmant --dp 2 --tp 1", 0),
    ("hf cpmant ddp dp2", "--hf cpmant --recipe ddp --dp 2 --tp 1", 0),
    ("hf cpmant ddp avg bug", "--hf cpmant --recipe ddp_avg --dp 2 --tp 1", 1),
    # an encoder-decoder family's decoder (its mean loss taken as the rank's share; its
    # decoder at the layer count)
    ("hf bart dp2", "--hf bart --dp 2 --tp 1", 0),
    ("hf bart ddp avg bug", "--hf bart --recipe ddp_avg --dp 2 --tp 1", 1),
    # positions looked up at a constant index of two dims (Whisper's decoder)
    ("hf whisper dp2", "--hf whisper --dp 2 --tp 1", 0),
    ("hf whisper ddp avg bug", "--hf whisper --recipe ddp_avg --dp 2 --tp 1", 1),
    # a computed tensor's slices at a constant index along any dim, and index_add back
    # (XLNet's relative shift: index_select at arange(klen) along the key dim)
    ("hf xlnet dp2", "--hf xlnet --dp 2 --tp 1", 0),
    ("hf xlnet ddp avg bug", "--hf xlnet --recipe ddp_avg --dp 2 --tp 1", 1),
    # a computed tensor at a constant boolean mask and written back at it (X-MOD's
    # language adapters, picked by a constant language id per row)
    ("hf xmod dp2", "--hf xmod --dp 2 --tp 1", 0),
    ("hf xmod ddp avg bug", "--hf xmod --recipe ddp_avg --dp 2 --tp 1", 1),
    # the labels copied into each block of a constant filled with the ignore index
    # (ProphetNet's n-gram targets), positions gathered at constant buckets that repeat
    ("hf prophetnet dp2", "--hf prophetnet --dp 2 --tp 1", 0),
    ("hf prophetnet ddp avg bug", "--hf prophetnet --recipe ddp_avg --dp 2 --tp 1", 1),
    # masks of lengths counted from the ids (XLM's), a cache started empty
    ("hf xlm dp2", "--hf xlm --dp 2 --tp 1", 0),
    ("hf xlm ddp avg bug", "--hf xlm --recipe ddp_avg --dp 2 --tp 1", 1),
    # configurations fitted: Mamba-2's heads, hybrids at two layers
    ("hf mamba2 dp2", "--hf mamba2 --dp 2 --tp 1", 0),
    ("hf olmo_hybrid dp2 tp2 ly2", "--hf olmo_hybrid --dp 2 --tp 2 --layers 2", 0),
    ("hf gemma4_text dp2 tp2", "--hf gemma4_text --dp 2 --tp 2", 0),
    ("hf olmo_hybrid fsdp avg bug", "--hf olmo_hybrid --recipe tp_fsdp_avg --dp 2 --tp 2 --layers 2", 1),
    # Zamba's one attention block shared by its two hybrid layers at 8 layers (hf.tie_shared):
    # transformers' per-layer FSDP2 does not run (PyTorch refuses a parameter in two groups),
    # the sharing layers as one group and DDP verify, sums layer by layer FAIL
    ("hf zamba ly8 fsdp per layer refused by PyTorch",
     "--hf zamba --dp 2 --tp 1 --layers 8", 2),
    ("hf zamba ly8 fsdp grouped", "--hf zamba --recipe fsdp_grouped --dp 2 --tp 1 --layers 8", 0),
    ("hf zamba ly8 ddp", "--hf zamba --recipe ddp --dp 2 --tp 1 --layers 8", 0),
    ("hf zamba ly8 bug sums per layer",
     "--hf zamba --recipe ddp_per_layer --dp 2 --tp 1 --layers 8", 1),
    # issue 33: a stack of two scalars as a gradient (HY-V4's scale.unbind), a plan that does not
    # run refused naming its module (docs/soundness.md, "Plans traced from PyTorch", 110)
    ("hf hy_v4 dp2 tp2 (a stacked-scalar gradient)", "--hf hy_v4 --dp 2 --tp 2", 0),
    ("hf hy_v4 bug fsdp avg", "--hf hy_v4 --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    ("hf doge dp2 tp2 refused: its own plan does not run", "--hf doge --dp 2 --tp 2", 2),
    ("hf xglm dp2 (float64's bound filled in its own dtype)", "--hf xglm --dp 2 --tp 1", 0),
    ("hf xglm ddp avg bug", "--hf xglm --recipe ddp_avg --dp 2 --tp 1", 1),
    ("hf dbrx dp2 (its attention's rotary base from rope_parameters)", "--hf dbrx --dp 2 --tp 1", 0),
    ("hf dbrx ddp avg bug", "--hf dbrx --recipe ddp_avg --dp 2 --tp 1", 1),
    ("hf gemma3 dp2 tp2 (its text model, the vision tower left out)", "--hf gemma3 --dp 2 --tp 2", 0),
    ("hf gemma3 bug fsdp avg", "--hf gemma3 --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    # a parameter clamped in place in the forward (Gemma 3n's AltUp coefficients,
    # soundness 128 a): by hand, and at tp 2 alone, it verifies (gloo same); FSDP2 clamps
    # its gathered copy, never the shard its backward gathers again and its step reads
    # (soundness 134): FAILs where the clip binds (gloo differs for the clipped tagger;
    # AltUp's clip at 120 binds on no weight of the small model, so its gloo run is same)
    ("hf gemma3n_text bug dp2 tp2 (AltUp's clamp writes FSDP's gathered copy only)",
     "--hf gemma3n_text --dp 2 --tp 2", 1),
    ("hf gemma3n_text tp2 (AltUp's coefficients clamped in place in each rank's own shard)",
     "--hf gemma3n_text --dp 1 --tp 2", 0),
    ("outside clipped_tagger ddp sgd (a weight clamped in place)",
     f"--model {CLIPPED} --recipe {STOCK}ddp --dp 2 --tp 1 {HASH_SIZES} --optimizer sgd", 0),
    ("outside clipped_tagger bug fsdp (a gathered copy of a weight clamped in place)",
     f"--model {CLIPPED} --recipe {STOCK}fsdp --dp 2 --tp 1 {HASH_SIZES}", 1),
    ("outside root_clipped_tagger fsdp sgd (the root clamps each block's shard before its gather)",
     f"--model {ROOT_CLIPPED} --recipe {STOCK}fsdp --dp 2 --tp 1 {HASH_SIZES} --optimizer sgd", 0),
    ("hf qwen3_5 dp2 tp2 (its causal LM is its text model)", "--hf qwen3_5 --dp 2 --tp 2", 0),
    ("outside no_entries_lm ddp", f"--model {NO_ENTRIES} --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("outside no_entries_lm tp_attention dp2 tp2",
     f"--model {NO_ENTRIES} --recipe {STOCK}tp_attention --dp 2 --tp 2", 0),
    ("outside no_entries_lm fsdp", f"--model {NO_ENTRIES} --recipe {STOCK}fsdp --dp 2 --tp 1", 0),
    ("outside no_entries_lm bug scale unreduced",
     f"--model {NO_ENTRIES} --recipe {STOCK}ddp_weights_only --dp 2 --tp 1", 1),
    ("outside no_entries_lm bug no dp sum",
     f"--model {NO_ENTRIES} --recipe {STOCK}tp_attention_no_dp_sum --dp 2 --tp 2", 1),
    # torchtitan 0.3.0, its own parallelize_llama (backends/torch/zoo/titan.py; docs/torch-backend.md,
    # "Third-party parallel code, unmodified")
    ("titan llama3 debugmodel tp2", f"{TITAN} --dp 1 --tp 2 --batch 2", 0),
    ("llama pp_tp pp2 tp2", "--model llama --recipe pp_tp --pp 2 --dp 1 --tp 2 --layers 2", 0),
    ("llama pp_interleaved_1f1b pp2 v2",
     "--model llama --recipe pp_interleaved_1f1b --pp 2 --dp 1 --tp 1 --layers 4", 0),
    ("llama pp_looped_bfs pp2 v2",
     "--model llama --recipe pp_looped_bfs --pp 2 --dp 1 --tp 1 --layers 4", 0),
    ("llama pp_interleaved_zero_bubble pp2 v2",
     "--model llama --recipe pp_interleaved_zero_bubble --pp 2 --dp 1 --tp 1 --layers 4", 0),
    ("llama pp_zbv pp2 v2", "--model llama --recipe pp_zbv --pp 2 --dp 1 --tp 1 --layers 4", 0),
    ("llama pp_dualpipev pp2 v2",
     "--model llama --recipe pp_dualpipev --pp 2 --dp 1 --tp 1 --layers 4", 0),
    ("llama tp_sp adamw", "--model llama --recipe tp_sp --optimizer adamw", 0),
    ("llama tp_sp sgd", "--model llama --recipe tp_sp --optimizer sgd", 0),
    ("llama tp_sp_vocab clip adamw",
     "--model llama --recipe tp_sp_vocab --clip 0.5 --optimizer adamw", 0),
    ("llama bug clip local norm", "--model llama --recipe tp_sp_vocab --clip 0.5 "
     "--optimizer adamw --clipper harness.torch_bugs:clip_local_norm", 1),
    ("llama bug local token mean (Megatron 7452/3)",
     "--model llama --recipe harness.torch_bugs:tp_sp_local_token_mean", 1),
    ("llama pp_gpipe clip adamw pp2", "--model llama --recipe pp_gpipe --pp 2 --dp 1 --tp 1 "
     "--layers 2 --clip 0.5 --optimizer adamw", 0),
    ("llama bug clip stage norm (torchtitan 596)", "--model llama --recipe pp_gpipe --pp 2 "
     "--dp 1 --tp 1 --layers 2 --clip 0.5 --optimizer adamw "
     "--clipper harness.torch_bugs:clip_stage_norm", 1),
    ("llama cp refused", "--model llama --recipe cp_sdpa --dp 2 --tp 1", 2),
    ("gpt2 bug ddp weights only", f"--model gpt2 --recipe {STOCK}ddp_weights_only --dp 2 --tp 1", 1),
    ("encoder ddp dp2", f"--model encoder --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("encoder_prenorm fsdp dp2", f"--model encoder_prenorm --recipe {STOCK}fsdp --dp 2 --tp 1", 0),
    ("gpt2_mean ddp_avg dp2", "--model gpt2_mean --recipe ddp_avg --dp 2 --tp 1", 0),
    ("gpt2_mean fsdp default divide dp2",
     f"--model gpt2_mean --recipe {SCALING}fsdp_default --dp 2 --tp 1", 0),
    ("mlp_mean ddp_avg dp2", "--model mlp_mean --recipe ddp_avg --dp 2 --tp 1", 0),
    ("mlp_mean fsdp default divide dp2", f"--model mlp_mean --recipe {SCALING}fsdp_default --dp 2 --tp 1", 0),
    ("gpt2_mean bug mean summed over dp", f"--model gpt2_mean --recipe {STOCK}ddp --dp 2 --tp 1", 1),
    ("gpt2 bug fsdp divides a shared loss", f"--model gpt2 --recipe {SCALING}fsdp_default --dp 2 --tp 1", 1),
    # scaling conventions (docs/torch-backend.md, "Scaling conventions and their mistakes")
    ("llama_mean ddp_avg dp2", "--model llama_mean --recipe ddp_avg --dp 2 --tp 1", 0),
    ("llama_mean tp_sp_avg dp2 tp2", "--model llama_mean --recipe tp_sp_avg", 0),
    ("llama_mean fsdp default divide", "--model llama_mean --recipe fsdp_tp_default_divide", 0),
    ("llama_mean pp_gpipe scale_grads pp2", "--model llama_mean --recipe pp_gpipe_scale_grads "
     "--pp 2 --dp 1 --tp 1 --layers 2", 0),
    ("llama_mean pp_1f1b scale_grads pp2", "--model llama_mean --recipe pp_1f1b_scale_grads "
     "--pp 2 --dp 1 --tp 1 --layers 2", 0),
    ("llama tp_sp dp1 tp2 (groups of one)", "--model llama --recipe tp_sp --dp 1 --tp 2", 0),
    ("llama tp dp2 tp2", "--model llama --recipe tp", 0),
    ("llama fsdp block left out (no value)", "--model llama --recipe fsdp_tp_block_left_out "
     "--layers 2", 0),
    ("llama_mean bug mean summed over dp", "--model llama_mean --recipe tp_sp", 1),
    ("llama bug avg where sum", "--model llama --recipe tp_sp_avg", 1),
    ("llama bug divided by dp twice", "--model llama --recipe ddp_avg --dp 2 --tp 1", 1),
    ("llama_mean bug pp scale_grads False", "--model llama_mean --recipe pp_gpipe --pp 2 --dp 1 "
     "--tp 1 --layers 2", 1),
    ("llama bug dp reduction on tp", "--model llama --recipe tp_sp_wrong_mesh_dim", 1),
    ("llama bug rowwise output partial", "--model llama --recipe tp_rowwise_partial", 1),
    ("gpt2 fsdp_tp_mlp dp2 tp2 (biases)", f"--model gpt2 --recipe {STOCK}fsdp_tp_mlp", 0),
    ("gpt2_mean fsdp default divide", f"--model gpt2_mean --recipe {SCALING}fsdp_default "
     "--dp 2 --tp 1", 0),
    ("gpt2_mean fsdp_tp_mlp default divide", f"--model gpt2_mean --recipe "
     f"{SCALING}fsdp_tp_mlp_default", 0),
    ("mlp_mean tp_mlp avg", f"--model mlp_mean --recipe {SCALING}tp_mlp_avg", 0),
    ("mlp_mean fsdp default divide", f"--model mlp_mean --recipe {SCALING}fsdp_default "
     "--dp 2 --tp 1", 0),
    ("gpt2_mean bug fsdp mean summed", f"--model gpt2_mean --recipe {STOCK}fsdp --dp 2 --tp 1",
     1),
    ("gpt2 bug colwise fused qkv", f"--model gpt2 --recipe {SCALING}tp_fused_qkv_colwise", 1),
    # loss parallelism (backends/torch/lowering/vocab_parallel.py) and torchtitan's meshes
    ("llama tp_sp_loss_parallel tp2", "--model llama --recipe tp_sp_loss_parallel --dp 1 --tp 2", 0),
    ("llama tp_sp_loss_parallel dp2 tp2", "--model llama --recipe tp_sp_loss_parallel", 0),
    ("llama bug loss_parallel partial as replicate (torchtitan 3412)",
     "--model llama --recipe tp_sp_loss_parallel_partial_as_replicate", 1),
    ("llama bug loss_parallel local max",
     "--model llama --recipe harness.loss_parallel_mistakes:loss_parallel_local_max --dp 1", 1),
    ("llama bug loss_parallel sum max",
     "--model llama --recipe harness.loss_parallel_mistakes:loss_parallel_sum_max --dp 1", 1),
    ("titan llama3 debugmodel dp2 tp2", f"{TITAN} --dp 2 --tp 2 --batch 4", 0),
    ("titan llama3 debugmodel pp2 (pipeline_llm 1F1B)", f"{TITAN} --dp 1 --tp 1 --pp 2 --batch 4", 0),
    ("titan llama3 debugmodel tp2 pp2", f"{TITAN} --dp 1 --tp 2 --pp 2 --batch 4", 0),
    ("titan llama3 debugmodel dp2 tp2 pp2", f"{TITAN} --dp 2 --tp 2 --pp 2 --batch 8", 0),
    ("megatron tp2", f"{MEGATRON}tp --dp 1 --tp 2", 0),
    ("megatron tp2 sp", f"{MEGATRON}tp_sp --dp 1 --tp 2", 0),
    # Megatron's own clipping: the norm's .item() traced, its `if clip_coeff < 1.0:` a guard
    # taken alike on one device (Megatron's code at world size 1), each rank's number proved
    # equal to the single-device one (docs/soundness.md, "Plans traced from PyTorch", 69-71)
    ("megatron tp2 clip_grad_norm (branch clip_coeff < 1.0 taken)",
     f"{MEGATRON}tp --dp 1 --tp 2 --clip 0.5 --clipper backends.torch.megatron:clip_grad_norm", 0),
    ("megatron dp2 ddp clip_grad_norm (branch clip_coeff < 1.0 taken)",
     f"{MEGATRON}ddp --dp 2 --tp 1 --batch 8 --clip 0.5 "
     "--clipper backends.torch.megatron:clip_grad_norm", 0),
    # with the distributed optimizer: the norm over every rank's shards (docs/soundness.md, 79-81;
    # --clip 0.1 at tp 2 so that each rank's traced local number takes the single-device branch)
    ("megatron dp2 distributed optimizer clip_grad_norm (the norm over the shards)",
     f"{MEGATRON}dist_opt --dp 2 --tp 1 --batch 8 --hidden 24 --clip 0.5 "
     "--clipper backends.torch.megatron:clip_grad_norm", 0),
    ("megatron dp2 tp2 distributed optimizer clip_grad_norm (the norm over the shards)",
     f"{MEGATRON}dist_opt --dp 2 --tp 2 --batch 8 --hidden 24 --clip 0.1 "
     "--clipper backends.torch.megatron:clip_grad_norm", 0),
    ("megatron bug dp2 distributed optimizer clip_grad_norm not all-reduced (each rank's own "
     "shards' norm)",
     f"{MEGATRON}dist_opt --dp 2 --tp 1 --batch 8 --hidden 24 --clip 0.5 "
     "--clipper tests.norm_clippers:megatron_dist_opt_norm_over_tp", 1),
    ("megatron bug dp2 tp2 distributed optimizer clip_grad_norm over the tp group",
     f"{MEGATRON}dist_opt --dp 2 --tp 2 --batch 8 --hidden 24 --clip 0.1 "
     "--clipper tests.norm_clippers:megatron_dist_opt_norm_over_tp", 1),
    ("megatron tp2 clip_grad_norm max_norm 1000 (branch not taken, the number still compared)",
     f"{MEGATRON}tp --dp 1 --tp 2 --clip 1000 --clipper backends.torch.megatron:clip_grad_norm",
     0),
    ("megatron bug tp2 clip_grad_norm over the data-parallel group (a rank's own norm)",
     f"{MEGATRON}tp --dp 1 --tp 2 --clip 0.5 --clipper tests.norm_clippers:megatron_norm_over_dp",
     1),
    ("megatron tp2 clip_grad_norm against torch's clip_grad_norm_ on one device (refused: no "
     "single-device branch to match)",
     f"{MEGATRON}tp --dp 1 --tp 2 --clip 0.5 "
     "--clipper tests.norm_clippers:megatron_large_branch_other_side", 2),
    # Megatron's strided shard (partition_stride 2: a gated MLP's fused linear_fc1), soundness
    # 108 (e); was refused
    ("megatron tp2 sp gated mlp (a strided linear_fc1)",
     "--model tests.megatron_user_step:gated_model --recipe tests.megatron_user_step:tp_sp "
     "--dp 1 --tp 2", 0),
    ("megatron bug tp2 sp gated mlp loaded as plain blocks (the stride taken away)",
     "--model tests.megatron_user_step:gated_unstrided_model "
     "--recipe tests.megatron_user_step:tp_sp --dp 1 --tp 2", 1),
    # users' own Megatron steps through the documented contract (tests/megatron_user_steps.py)
    ("megatron user tp2 sp rope gqa swiglu rmsnorm untied",
     f"{MEGATRON_USER}llama_like --recipe {USER_RECIPES}tp_sp --dp 1 --tp 2 --batch 4", 0),
    ("megatron user dp2 tp2 sp rope gqa swiglu rmsnorm untied",
     f"{MEGATRON_USER}llama_like --recipe {USER_RECIPES}tp_sp --dp 2 --tp 2 --batch 8", 0),
    ("megatron user dp2 masked per-token loss qk_layernorm, overlap and small buckets",
     f"{MEGATRON_USER}masked_tokens --recipe {USER_RECIPES}ddp_small_buckets --dp 2 --tp 1 "
     "--batch 8 --seed 1", 0),
    ("megatron user bug dp2 masked mean per microbatch (no calculate_per_token_loss)",
     f"{MEGATRON_USER}masked_mean --recipe {USER_RECIPES}ddp --dp 2 --tp 1 --batch 8 --seed 1", 1),
    ("megatron user bug dp2 token sum without calculate_per_token_loss",
     f"{MEGATRON_USER}token_sum --recipe {USER_RECIPES}ddp --dp 2 --tp 1 --batch 8", 1),
    ("megatron user pp2 1f1b rope 4 layers",
     f"{MEGATRON_USER}deep --recipe {USER_RECIPES}pp_1f1b --pp 2 --dp 1 --tp 1 --layers 4 "
     "--batch 8", 0),
    ("megatron user pp2 interleaved rope 4 layers",
     f"{MEGATRON_USER}deep --recipe {USER_RECIPES}pp_interleaved --pp 2 --dp 1 --tp 1 "
     "--layers 4 --batch 8", 0),
    ("megatron user dp2 distributed optimizer small buckets step adamw (rope gqa swiglu)",
     f"{MEGATRON_USER}llama_like --recipe {USER_RECIPES}dist_opt_small_buckets --dp 2 --tp 1 "
     "--batch 8 --optimizer adamw", 0),
    # an optimizer step over a strided shard (SwiGLU's linear_fc1 at tp 2): its claimed
    # blocks listed as the rank's final blocks (soundness 116 (c); was refused)
    ("megatron user tp2 optimizer step sgd over a strided shard",
     f"{MEGATRON_USER}llama_like --recipe {USER_RECIPES}ddp --dp 1 --tp 2 --batch 4 "
     "--optimizer sgd", 0),
    ("megatron user dp2 tp2 optimizer step adamw over a strided shard",
     f"{MEGATRON_USER}llama_like --recipe {USER_RECIPES}ddp --dp 2 --tp 2 --batch 8 "
     "--optimizer adamw", 0),
    ("megatron user bug dp2 tp2 strided shard stepped with the learning rate times dp",
     f"{MEGATRON_USER}llama_like --recipe {USER_RECIPES}ddp_lr_times_dp --dp 2 --tp 2 "
     "--batch 8 --optimizer sgd", 1),
    ("megatron user dp2 tp2 average_in_collective overlap step sgd",
     f"{MEGATRON_USER}deep --recipe {USER_RECIPES}ddp_average_overlap --dp 2 --tp 2 --batch 8 "
     "--optimizer sgd", 0),
    ("megatron tp2 one-row batch (dp 1, one microbatch)",
     f"{MEGATRON}tp --dp 1 --tp 2 --batch 1", 0),
    ("megatron dp2 ddp 2 microbatches", f"{MEGATRON}ddp --dp 2 --tp 1 --batch 8", 0),
    ("megatron dp2 ddp average_in_collective", f"{MEGATRON}ddp_average --dp 2 --tp 1 --batch 8", 0),
    ("megatron dp2 ddp overlap_grad_reduce", f"{MEGATRON}ddp_overlap --dp 2 --tp 1 --batch 8", 0),
    ("megatron pp2 1f1b", f"{MEGATRON}pp_1f1b --pp 2 --dp 1 --tp 1 --layers 2", 0),
    ("megatron pp2 interleaved unbatched p2p",
     f"{MEGATRON}pp_interleaved_unbatched --pp 2 --dp 1 --tp 1 --layers 4 --batch 8", 0),
    ("megatron dp2 tp2 pp2 sp", f"{MEGATRON}full --pp 2 --dp 2 --tp 2 --layers 2 --batch 8", 0),
    ("megatron bug sp norm unmarked (1446)", f"{MEGATRON}tp_sp_norm_unmarked --dp 1 --tp 2", 1),
    ("megatron bug tied embedding not reduced",
     f"{MEGATRON}pp_tied_embedding_not_reduced --pp 2 --dp 1 --tp 1 --layers 2", 1),
    ("megatron bug loss over microbatches twice",
     f"{MEGATRON}loss_over_microbatches --dp 2 --tp 1 --batch 8", 1),
    ("megatron bug global mean averaged by ddp", f"{MEGATRON}loss_global_mean --dp 2 --tp 1 --batch 8", 1),
    ("megatron bug global mean averaged in collective",
     f"{MEGATRON}ddp_average_global_mean --dp 2 --tp 1 --batch 8", 1),
    ("megatron bug ddp buckets reduced over the tp group",
     f"{MEGATRON}ddp_wrong_group --dp 2 --tp 2 --batch 8", 1),
    ("megatron dp2 mtp", "--model backends.torch.megatron:gpt_mtp --recipe backends.torch.megatron:tp "
     "--dp 2 --tp 1 --batch 4", 0),
    ("megatron bug mtp loss normalized by local token counts (7452)",
     "--model backends.torch.megatron:gpt_mtp_masked --recipe backends.torch.megatron:tp "
     "--dp 2 --tp 1 --batch 4 --seed 1", 1),
    ("megatron tp2 mtp (the rolled ids' vocabulary-parallel lookup)",
     "--model backends.torch.megatron:gpt_mtp --recipe backends.torch.megatron:tp --dp 1 --tp 2", 0),
    ("megatron dp2 tp2 mtp 2 microbatches (a loss mask of each microbatch)",
     "--model backends.torch.megatron:gpt_mtp --recipe backends.torch.megatron:ddp "
     "--dp 2 --tp 2 --batch 8", 0),
    ("megatron bug mtp tp2 2 microbatches, each normalized by its own token count (7452)",
     "--model backends.torch.megatron:gpt_mtp_masked --recipe backends.torch.megatron:ddp "
     "--dp 1 --tp 2 --batch 4 --seed 1", 1),
    ("megatron mtp per-token loss, the token count all-reduced (7452's fix)",
     "--model backends.torch.megatron:gpt_mtp_per_token --recipe backends.torch.megatron:tp "
     "--dp 2 --tp 1 --batch 4 --seed 1", 0),
    ("megatron mtp dp2 tp2 2 microbatches per-token loss, the token count all-reduced (7452's fix)",
     "--model backends.torch.megatron:gpt_mtp_per_token --recipe backends.torch.megatron:ddp "
     "--dp 2 --tp 2 --batch 8 --seed 1", 0),
    ("megatron mtp tp2 2 microbatches per-token loss, the token count all-reduced (7452's fix)",
     "--model backends.torch.megatron:gpt_mtp_per_token --recipe backends.torch.megatron:ddp "
     "--dp 1 --tp 2 --batch 4 --seed 1", 0),
    ("megatron bug mtp per-token loss, the token count all-reduced over the tp group",
     "--model backends.torch.megatron:gpt_mtp_per_token "
     "--recipe backends.torch.megatron:tp_token_count_over_tp --dp 2 --tp 1 --batch 4 --seed 1", 1),
    # at pp 2 the MTP block on the last stage looks up its own copy of the position
    # embeddings, whose gradient finalize_model_grads never reduces with the first stage's
    # (the position-embedding group is the first stage): gloo differs (0.987 x on stage 0);
    # the token count broadcast from the last stage is answered (soundness 102 (d))
    ("megatron bug mtp pp2 1f1b per-token loss: the MTP's position embeddings never reduced "
     "with the first stage's (7452 at pp 2)",
     "--model backends.torch.megatron:gpt_mtp_per_token --recipe backends.torch.megatron:pp_1f1b "
     "--pp 2 --dp 1 --tp 1 --layers 2 --batch 4 --seed 1", 1),
    ("megatron bug mtp pp2 1f1b: the MTP's position embeddings never reduced with the first "
     "stage's",
     "--model backends.torch.megatron:gpt_mtp --recipe backends.torch.megatron:pp_1f1b "
     "--pp 2 --dp 1 --tp 1 --layers 2 --batch 4", 1),
    ("megatron mtp pp2 1f1b with the MTP's position embeddings reduced with the first stage's "
     "(a fix)",
     "--model backends.torch.megatron:gpt_mtp "
     "--recipe backends.torch.megatron:pp_1f1b_mtp_positions_reduced "
     "--pp 2 --dp 1 --tp 1 --layers 2 --batch 4", 0),
    ("megatron mtp pp2 1f1b per-token loss with the MTP's position embeddings reduced (the "
     "count broadcast from the last stage answered)",
     "--model backends.torch.megatron:gpt_mtp_per_token "
     "--recipe backends.torch.megatron:pp_1f1b_mtp_positions_reduced "
     "--pp 2 --dp 1 --tp 1 --layers 2 --batch 4 --seed 1", 0),
    # the last stage's unread output-layer weight: its zero gradient all-reduced over dp is
    # zeros (soundness 108 (d)); was refused
    ("megatron bug mtp dp2 pp2 per-token loss, the token count all-reduced over the tp group",
     "--model backends.torch.megatron:gpt_mtp_per_token "
     "--recipe backends.torch.megatron:tp_token_count_over_tp --pp 2 --dp 2 --tp 1 --layers 2 "
     "--batch 4 --seed 1", 1),
    ("megatron mtp dp2 pp2 per-token loss with the MTP's position embeddings reduced (a fix)",
     "--model backends.torch.megatron:gpt_mtp_per_token "
     "--recipe backends.torch.megatron:pp_1f1b_mtp_positions_reduced --pp 2 --dp 2 --tp 1 "
     "--layers 2 --batch 8 --seed 1", 0),
    # Megatron's own optimizer step (get_megatron_optimizer, FP32Optimizer over torch's
    # AdamW or SGD) against torch's optimizer on the single-device gradients
    ("megatron dp2 tp2 optimizer step adamw",
     f"{MEGATRON}ddp --dp 2 --tp 2 --batch 8 --optimizer adamw", 0),
    ("megatron tp2 optimizer step sgd", f"{MEGATRON}tp --dp 1 --tp 2 --optimizer sgd", 0),
    ("megatron pp2 1f1b optimizer step adamw (both stages' copies of the tied embedding)",
     f"{MEGATRON}pp_1f1b --pp 2 --dp 1 --tp 1 --layers 2 --optimizer adamw", 0),
    ("megatron bug optimizer step: tp duplicates stepped on tp rank 0 only (rank 1 stale)",
     f"{MEGATRON}ddp_duplicates_on_tp_rank0 --dp 2 --tp 2 --batch 8 --optimizer adamw", 1),
    ("megatron bug optimizer step with the learning rate times dp (adam_step on rank 0)",
     f"{MEGATRON}ddp_lr_times_dp --dp 2 --tp 2 --batch 8 --optimizer adamw", 1),
    ("megatron bug optimizer step sgd with the learning rate times dp",
     f"{MEGATRON}ddp_lr_times_dp --dp 2 --tp 2 --batch 8 --optimizer sgd", 1),
    ("megatron optimizer step sgd, learning rate times dp, decay and gradients over dp (the same "
     "update)", f"{MEGATRON}ddp_lr_times_dp_compensated --dp 2 --tp 2 --batch 8 --optimizer sgd", 0),
    # the distributed optimizer's own step: each rank steps its flat ranges, writes them into
    # the parameter buffer and all-gathers it (every rank ends with every parameter whole)
    ("megatron dp2 distributed optimizer step adamw",
     f"{MEGATRON}dist_opt --dp 2 --tp 1 --batch 8 --hidden 24 --optimizer adamw", 0),
    ("megatron dp2 tp2 distributed optimizer step adamw",
     f"{MEGATRON}dist_opt --dp 2 --tp 2 --batch 8 --hidden 24 --optimizer adamw", 0),
    # at pp 2 the shared embedding's bucket holds one gradient, all-reduced over the embedding
    # group after the reduce-scatter (soundness 108)
    ("megatron pp2 distributed optimizer (the embedding's bucket of one gradient)",
     f"{MEGATRON}dist_opt --pp 2 --dp 1 --tp 1 --layers 2 --batch 8 --hidden 24", 0),
    ("megatron dp2 pp2 distributed optimizer (the embedding group's all-reduce of the ranges)",
     f"{MEGATRON}dist_opt --pp 2 --dp 2 --tp 1 --layers 2 --batch 8 --hidden 24", 0),
    ("megatron pp2 distributed optimizer step adamw",
     f"{MEGATRON}dist_opt --pp 2 --dp 1 --tp 1 --layers 2 --batch 8 --hidden 24 --optimizer adamw",
     0),
    ("megatron dp2 pp2 distributed optimizer step adamw",
     f"{MEGATRON}dist_opt --pp 2 --dp 2 --tp 1 --layers 2 --batch 8 --hidden 24 --optimizer adamw",
     0),
    ("megatron bug dp2 pp2 distributed optimizer reads the next rank's ranges",
     f"{MEGATRON}dist_opt_range_shifted --pp 2 --dp 2 --tp 1 --layers 2 --batch 8 --hidden 24", 1),
    ("megatron bug dp2 pp2 distributed optimizer step: each rank all-gathers the next rank's "
     "stale range (a zeroed region's zeros loose)",
     f"{MEGATRON}dist_opt_gather_wrong_shard --pp 2 --dp 2 --tp 1 --layers 2 --batch 8 "
     "--hidden 24 --optimizer adamw", 1),
    ("megatron bug dp2 pp2 distributed optimizer step on the next rank's ranges",
     f"{MEGATRON}dist_opt_step_shifted --pp 2 --dp 2 --tp 1 --layers 2 --batch 8 --hidden 24 "
     "--optimizer adamw", 1),
    ("megatron distributed optimizer step sgd refused (Megatron's steps Adam only)",
     f"{MEGATRON}dist_opt --dp 2 --tp 1 --batch 8 --hidden 24 --optimizer sgd", 2),
    ("megatron bug distributed optimizer step on the next rank's ranges (unreduced gradients)",
     f"{MEGATRON}dist_opt_step_shifted --dp 2 --tp 1 --batch 8 --hidden 24 --optimizer adamw",
     1),
    ("megatron bug distributed optimizer step: the updated ranges never all-gathered (stale)",
     f"{MEGATRON}dist_opt_gather_skipped --dp 2 --tp 1 --batch 8 --hidden 24 --optimizer adamw",
     1),
    ("megatron bug distributed optimizer step: each rank all-gathers the next rank's stale range",
     f"{MEGATRON}dist_opt_gather_wrong_shard --dp 2 --tp 1 --batch 8 --hidden 24 "
     "--optimizer adamw", 1),
    # the distributed optimizer: hidden 24, so that a rank's flat range of the grad buffer
    # cuts linear_qkv.weight inside a row (rows 0-20 and 8 columns of row 21 on rank 0)
    ("megatron dp2 distributed optimizer 2 microbatches (flat ranges cut a row)",
     f"{MEGATRON}dist_opt --dp 2 --tp 1 --batch 8 --hidden 24", 0),
    ("megatron dp2 tp2 distributed optimizer", f"{MEGATRON}dist_opt --dp 2 --tp 2 --batch 8 --hidden 24", 0),
    ("megatron dp2 distributed optimizer overlap_grad_reduce",
     f"{MEGATRON}dist_opt_overlap --dp 2 --tp 1 --batch 8 --hidden 24", 0),
    ("megatron bug distributed optimizer reads the next rank's ranges",
     f"{MEGATRON}dist_opt_range_shifted --dp 2 --tp 1 --batch 8 --hidden 24", 1),
    ("megatron bug distributed optimizer's reduce-scatter left out",
     f"{MEGATRON}dist_opt_not_reduced --dp 2 --tp 1 --batch 8 --hidden 24", 1),
    ("megatron bug distributed optimizer reduce-scattered over the tp group (a range of other "
     "gradients' elements)",
     f"{MEGATRON}dist_opt_wrong_group --dp 2 --tp 2 --batch 8 --hidden 24", 1),
    ("megatron pp2 interleaved batched p2p (1450)",
     f"{MEGATRON}pp_interleaved --pp 2 --dp 1 --tp 1 --layers 4 --batch 8", 1),
    # layers as users write them (docs/torch-backend.md, "Models written by users")
    ("gpt2_split tp_attention dp2 tp2", "--model gpt2_split --recipe tp_attention --layers 2", 0),
    ("gpt2_split fsdp_tp_attention dp2 tp2", "--model gpt2_split --recipe fsdp_tp_attention", 0),
    ("gqa tp_attention dp2 tp2", "--model gqa --recipe tp_attention", 0),
    ("gqa_finfo fsdp_tp_attention dp2 tp2", "--model gqa_finfo --recipe fsdp_tp_attention", 0),
    ("gqa_additive tp_attention dp2 tp2", "--model gqa_additive --recipe tp_attention", 0),
    ("gqa_pad tp_attention dp2 tp2", "--model gqa_pad --recipe tp_attention", 0),
    ("gqa tp_attention dp1 tp2", "--model gqa --recipe tp_attention --dp 1 --tp 2", 0),
    ("mlp_l1 ddp_avg dp2", "--model mlp_l1 --recipe ddp_avg --dp 2 --tp 1", 0),
    ("mlp_smooth_l1 fsdp default divide dp2",
     f"--model mlp_smooth_l1 --recipe {SCALING}fsdp_default --dp 2 --tp 1", 0),
    ("mlp_smooth_l1 tp_mlp avg dp2 tp2", f"--model mlp_smooth_l1 --recipe {SCALING}tp_mlp_avg", 0),
    ("gqa_pad_mean bug avg of unequal token means",
     "--model gqa_pad_mean --recipe ddp_avg --dp 2 --tp 1", 1),
    ("mlp_l1 bug mean summed over dp", f"--model mlp_l1 --recipe {STOCK}ddp --dp 2 --tp 1", 1),
    ("gqa bug tp without dp sum", "--model gqa --recipe tp_attention_no_dp_sum", 1),
    ("mlp_l1 ddp sum then divide dp2",
     f"--model mlp_l1 --recipe {SCALING}ddp_sum_divide --dp 2 --tp 1", 0),
    ("gpt2_shifted ddp_avg dp2", "--model gpt2_shifted --recipe ddp_avg --dp 2 --tp 1", 0),
    ("gpt2_shifted fsdp_tp_mlp default divide dp2 tp2",
     f"--model gpt2_shifted --recipe {SCALING}fsdp_tp_mlp_default", 0),
    ("gpt2_shifted bug mean summed over dp", f"--model gpt2_shifted --recipe {STOCK}ddp --dp 2 --tp 1",
     1),
    ("swiglu_regression fsdp dp2 (one-row head padded)",
     f"--model swiglu_regression --recipe {STOCK}fsdp --dp 2 --tp 1", 0),
    ("swiglu_regression fsdp dp4", f"--model swiglu_regression --recipe {STOCK}fsdp --dp 4 --tp 1",
     0),
    ("swiglu_regression hsdp dp4", f"--model swiglu_regression --recipe {STOCK}hsdp --dp 4 --tp 1",
     0),
    ("swiglu_regression fsdp_tp_mlp dp2 tp2",
     f"--model swiglu_regression --recipe {STOCK}fsdp_tp_mlp --dp 2 --tp 2", 0),
    ("swiglu_regression_mean fsdp default divide dp2",
     f"--model swiglu_regression_mean --recipe {SCALING}fsdp_default --dp 2 --tp 1", 0),
    ("swiglu_regression bug fsdp divides a shared loss",
     f"--model swiglu_regression --recipe {SCALING}fsdp_default --dp 2 --tp 1", 1),
    ("swiglu_regression_mean bug fsdp mean summed",
     f"--model swiglu_regression_mean --recipe {STOCK}fsdp --dp 2 --tp 1", 1),
    ("mlp fsdp padded shards dp2 (15 rows: 8, 7)",
     f"--model mlp --recipe {STOCK}fsdp --dp 2 --tp 1 --vocab 15", 0),
    ("mlp fsdp padded shards dp4 adamw (10 rows: 3, 3, 3, 1)",
     f"--model mlp --recipe {STOCK}fsdp --dp 4 --tp 1 --vocab 10 --optimizer adamw", 0),
    ("mlp fsdp padded shards dp4 clip (5 rows: 2, 2, 1, 0)",
     f"--model mlp --recipe {STOCK}fsdp --dp 4 --tp 1 --vocab 5 --clip 1.0", 0),
    ("mlp_mean fsdp padded shards default divide dp2",
     f"--model mlp_mean --recipe {SCALING}fsdp_default --dp 2 --tp 1 --vocab 15", 0),
    ("mlp bug fsdp padded shards divide a shared loss",
     f"--model mlp --recipe {SCALING}fsdp_default --dp 2 --tp 1 --vocab 15", 1),
    ("mlp hsdp padded shards dp4 clip (5 rows over shard groups of 2: 3, 2)",
     f"--model mlp --recipe {STOCK}hsdp --dp 4 --tp 1 --vocab 5 --clip 1.0", 0),
    ("mlp fsdp_tp_mlp padded shards dp2 tp2", f"--model mlp --recipe {STOCK}fsdp_tp_mlp --dp 2 "
     "--tp 2 --vocab 15", 0),
    ("swiglu_regression fsdp dp4 hidden 10 ffn 14 (every layer padded)",
     f"--model swiglu_regression --recipe {STOCK}fsdp --dp 4 --tp 1 --hidden 10 --ffn 14", 0),
    ("llama tp_sp dp2 tp2 vocab 15 (DTensor's uneven colwise output: 8, 7)",
     "--model llama --recipe tp_sp --dp 2 --tp 2 --vocab 15", 0),
    ("llama fsdp_tp vocab 15 refused (FSDP2 over an uneven tensor-parallel shard)",
     "--model llama --recipe fsdp_tp --dp 2 --tp 2 --vocab 15", 2),
    ("swiglu_regression fsdp clip dp2 (one-row head padded)",
     f"--model swiglu_regression --recipe {STOCK}fsdp --dp 2 --tp 1 --clip 1.0", 0),
    # HSDP and FSDP2 over shard groups of one rank (issue 19, shipped bugs)
    ("hf llama hsdp dp4 tp2", "--hf llama --recipe hsdp --dp 4 --tp 2", 0),
    ("llama hsdp dp4 tp2", "--model llama --recipe hsdp --dp 4 --tp 2 --batch 8", 0),
    ("llama hsdp clip dp4", "--model llama --recipe hsdp --dp 4 --tp 1 --clip 0.5", 0),
    ("llama bug hsdp norm over all dp (VeOmni 862)", "--model llama --recipe hsdp --dp 4 "
     "--tp 1 --clip 0.5 --clipper harness.torch_bugs:clip_hsdp_norm_all_dp", 1),
    ("llama hsdp norm over the shard group (VeOmni 862 fix)", "--model llama --recipe hsdp "
     "--dp 4 --tp 1 --clip 0.5 --clipper harness.torch_bugs:clip_hsdp_norm_shard_group", 0),
    ("llama_mean replicate_fp32 dp2", "--model llama_mean --recipe replicate_fp32 --dp 2 --tp 1", 0),
    ("llama_mean bug divide factor ignored on one shard (pytorch 167178)",
     "--model llama_mean --recipe harness.torch_bugs:replicate_fp32_factor_ignored --dp 2 --tp 1", 1),
    ("llama_mean bug float64 one shard divided twice (torch 2.13)",
     "--model llama_mean --recipe replicate_fp64 --dp 2 --tp 1", 1),
    # expert parallelism with static shapes (backends/torch/zoo/moe.py)
    ("moe ep dp2", "--model backends.torch.moe:moe --recipe backends.torch.moe:ep --dp 2 --tp 1", 0),
    ("moe ep dp4", "--model backends.torch.moe:moe --recipe backends.torch.moe:ep --dp 4 --tp 1", 0),
    ("moe_mean ep_mean dp2 (pytorch 160285 fix)",
     "--model backends.torch.moe:moe_mean --recipe backends.torch.moe:ep_mean --dp 2 --tp 1", 0),
    ("moe_mean bug expert grads undivided (pytorch 160285)", "--model backends.torch.moe:moe_mean "
     "--recipe harness.torch_bugs:ep_mean_experts_undivided --dp 2 --tp 1", 1),
    ("moe bug experts summed over dp", "--model backends.torch.moe:moe "
     "--recipe harness.torch_bugs:ep_experts_summed_over_dp --dp 2 --tp 1", 1),
    # label smoothing, masks off the causal pattern and from the ids, the
    # token-weighted mean with its count all-reduced (backends/torch/zoo/loss_models.py)
    ("gpt2_smooth ddp dp2", f"--model gpt2_smooth --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("gpt2_smooth_mean ddp_avg dp2", "--model gpt2_smooth_mean --recipe ddp_avg --dp 2 --tp 1", 0),
    ("gpt2_smooth_pad fsdp dp2", f"--model gpt2_smooth_pad --recipe {STOCK}fsdp --dp 2 --tp 1", 0),
    ("gpt2_window tp_mlp dp2 tp2", f"--model gpt2_window --recipe {STOCK}tp_mlp --dp 2 --tp 2", 0),
    ("gpt2_padded ddp dp2", f"--model gpt2_padded --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("gpt2_padded_fill fsdp dp2", f"--model gpt2_padded_fill --recipe {STOCK}fsdp --dp 2 --tp 1",
     0),
    ("gpt2_token_weighted count all-reduced dp2",
     "--model gpt2_token_weighted --recipe ddp_token_weighted --dp 2 --tp 1", 0),
    ("gpt2_token_weighted count all-reduced dp4",
     "--model gpt2_token_weighted --recipe ddp_token_weighted --dp 4 --tp 1 --batch 8", 0),
    ("gpt2_token_weighted tp_mlp count all-reduced dp2 tp2",
     "--model gpt2_token_weighted --recipe tp_mlp_token_weighted --dp 2 --tp 2", 0),
    ("gpt2_smooth_pad_mean bug AVG of unequal kept-label means",
     "--model gpt2_smooth_pad_mean --recipe ddp_avg --dp 2 --tp 1", 1),
    ("gpt2_padded bug pad id off by one on one rank",
     "--model gpt2_padded --recipe ddp_pad_id_first_rank --dp 2 --tp 1", 1),
    ("gpt2_padded bug ignore index off by one on one rank (its own constant)",
     "--model gpt2_padded --recipe ddp_ignore_index_first_rank --dp 2 --tp 1", 1),
    ("gpt2_padded bug key mask off by one id on one rank (another column)",
     "--model gpt2_padded --recipe ddp_key_mask_off_by_one --dp 2 --tp 1", 1),
    ("gpt2_token_weighted bug local count",
     "--model gpt2_token_weighted --recipe ddp_local_count --dp 2 --tp 1", 1),
    ("gpt2_token_weighted bug count all-reduced and grads averaged",
     "--model gpt2_token_weighted --recipe ddp_token_weighted_avg --dp 2 --tp 1", 1),
    ("gpt2_smooth bug smoothing differs on one rank",
     "--model gpt2_smooth --recipe ddp_smoothing_first_rank --dp 2 --tp 1", 1),
    ("gpt2_smooth_mean bug smoothing differs on one rank, AVG",
     "--model gpt2_smooth_mean --recipe ddp_avg_unsmoothed_first_rank --dp 2 --tp 1", 1),
    # recipes as users write them (tests/outside_recipes.py; docs/torch-backend.md, "Recipes
    # written with PyTorch's own APIs")
    ("outside mlp_mean ddp dp2", f"--model mlp_mean --recipe {OUTSIDE}ddp --dp 2 --tp 1", 0),
    ("outside gpt2_mean ddp dp2", f"--model gpt2_mean --recipe {OUTSIDE}ddp --dp 2 --tp 1", 0),
    ("outside mlp_mean ddp dp2 tp2", f"--model mlp_mean --recipe {OUTSIDE}ddp --dp 2 --tp 2", 0),
    ("outside mlp ddp bug dp2", f"--model mlp --recipe {OUTSIDE}ddp --dp 2 --tp 1", 1),
    ("outside gpt2_mean ddp_bucket_view dp2",
     f"--model gpt2_mean --recipe {OUTSIDE}ddp_bucket_view --dp 2 --tp 1", 0),
    ("outside mlp_mean ddp_allreduce_hook dp2",
     f"--model mlp_mean --recipe {OUTSIDE}ddp_allreduce_hook --dp 2 --tp 1", 0),
    ("outside mlp_mean ddp_hook_divides_twice bug",
     f"--model mlp_mean --recipe {OUTSIDE}ddp_hook_divides_twice --dp 2 --tp 1", 1),
    ("outside mlp_mean ddp_wrong_group bug",
     f"--model mlp_mean --recipe {OUTSIDE}ddp_wrong_group --dp 2 --tp 2", 1),
    ("outside gpt2 ddp_sum_hook dp2", f"--model gpt2 --recipe {OUTSIDE}ddp_sum_hook --dp 2 --tp 1", 0),
    ("outside encoder ddp_sum_hook dp2",
     f"--model encoder --recipe {OUTSIDE}ddp_sum_hook --dp 2 --tp 1", 0),
    ("outside mlp_mean funcol_avg dp2", f"--model mlp_mean --recipe {OUTSIDE}funcol_avg --dp 2 --tp 1", 0),
    ("outside mlp_mean flat_bucket_by_hand dp2",
     f"--model mlp_mean --recipe {OUTSIDE}flat_bucket_by_hand --dp 2 --tp 1", 0),
    ("outside mlp zero2_by_hand dp2", f"--model mlp --recipe {OUTSIDE}zero2_by_hand --dp 2 --tp 1", 0),
    ("outside mlp all_reduce_wrong_dim bug",
     f"--model mlp --recipe {OUTSIDE}all_reduce_wrong_dim --dp 2 --tp 2", 1),
    ("outside gpt2_mean fsdp_keep_unsharded dp2",
     f"--model gpt2_mean --recipe {OUTSIDE}fsdp_keep_unsharded --dp 2 --tp 1", 0),
    ("outside mlp_mean fsdp_every_linear dp2",
     f"--model mlp_mean --recipe {OUTSIDE}fsdp_every_linear --dp 2 --tp 1", 0),
    ("outside llama_mean fsdp_root_only dp2",
     f"--model llama_mean --recipe {OUTSIDE}fsdp_root_only --dp 2 --tp 1", 0),
    ("outside llama_mean fsdp_root_only_sum bug",
     f"--model llama_mean --recipe {OUTSIDE}fsdp_root_only_sum --dp 2 --tp 1", 1),
    ("outside mlp_mean tp_wildcard dp2 tp2",
     f"--model mlp_mean --recipe {OUTSIDE}tp_wildcard --dp 2 --tp 2", 0),
    ("outside mlp tp_own_mesh dp2 tp2", f"--model mlp --recipe {OUTSIDE}tp_own_mesh --dp 2 --tp 2", 0),
    ("outside gpt2_split gpt2_tp_sp dp2 tp2",
     f"--model gpt2_split --recipe {OUTSIDE}gpt2_tp_sp --dp 2 --tp 2 --layers 2", 0),
    ("outside gpt2_split gpt2_tp_sp dp1 tp2",
     f"--model gpt2_split --recipe {OUTSIDE}gpt2_tp_sp --dp 1 --tp 2 --layers 2", 0),
    ("outside gpt2_split gpt2_tp_sp_norm_grads_local bug",
     f"--model gpt2_split --recipe {OUTSIDE}gpt2_tp_sp_norm_grads_local --dp 2 --tp 2", 1),
    ("outside gpt2_split gpt2_fsdp_tp_sp dp2 tp2",
     f"--model gpt2_split --recipe {OUTSIDE}gpt2_fsdp_tp_sp --dp 2 --tp 2 --layers 2", 0),
    ("outside mlp tp_explicit_layouts dp2 tp2",
     f"--model mlp --recipe {OUTSIDE}tp_explicit_layouts --dp 2 --tp 2", 0),
    ("outside gqa gqa_tp_loss_parallel dp2 tp2",
     f"--model gqa --recipe {OUTSIDE}gqa_tp_loss_parallel --dp 2 --tp 2", 0),
    ("outside mlp_mean tp_from_local dp2 tp2",
     f"--model mlp_mean --recipe {OUTSIDE}tp_from_local --dp 2 --tp 2", 0),
    ("outside mlp_mean tp_from_local_summed bug",
     f"--model mlp_mean --recipe {OUTSIDE}tp_from_local_summed --dp 2 --tp 2", 1),
    # models and recipes written outside the backend, second set (tests/outside_apis_*.py;
    # docs/torch-backend.md, "Models written outside the backend")
    ("outside apis bert_classifier fsdp_blocks_kept float32 params dp2",
     f"--model {OUT_APIS_M}bert_classifier --recipe {OUT_APIS_R}fsdp_blocks_kept --dp 2 --tp 1", 0),
    ("outside apis vit_classifier fsdp_blocks_resharded clip_foreach adamw dp2",
     f"--model {OUT_APIS_M}vit_classifier --recipe {OUT_APIS_R}fsdp_blocks_resharded --dp 2 --tp 1 "
     f"--clip 1.0 --clipper {OUT_APIS_R}clip_foreach --optimizer adamw", 0),
    ("outside apis bert_classifier fsdp_blocks_no_root bug",
     f"--model {OUT_APIS_M}bert_classifier --recipe {OUT_APIS_R}fsdp_blocks_no_root --dp 2 --tp 1", 1),
    ("outside apis vit_classifier fsdp_blocks_sum bug",
     f"--model {OUT_APIS_M}vit_classifier --recipe {OUT_APIS_R}fsdp_blocks_sum --dp 2 --tp 1", 1),
    ("outside apis vit_classifier fsdp_blocks_sum_share PREMUL_SUM(1) dp2",
     f"--model {OUT_APIS_M}vit_classifier --recipe {OUT_APIS_R}fsdp_blocks_sum_share --dp 2 --tp 1", 0),
    ("outside apis vit_classifier fsdp_blocks_factor4 bug",
     f"--model {OUT_APIS_M}vit_classifier --recipe {OUT_APIS_R}fsdp_blocks_factor4 --dp 2 --tp 1", 1),
    ("outside apis bert_classifier ddp_no_sync_accumulate sgd dp2",
     f"--model {OUT_APIS_M}bert_classifier --recipe {OUT_APIS_R}ddp_no_sync_accumulate --dp 2 --tp 1 "
     f"--optimizer sgd", 0),
    ("outside apis bert_classifier ddp_no_sync_unscaled bug",
     f"--model {OUT_APIS_M}bert_classifier --recipe {OUT_APIS_R}ddp_no_sync_unscaled --dp 2 --tp 1", 1),
    ("outside apis staged_tagger pp_gpipe pp2",
     f"--model {OUT_APIS_M}staged_tagger --recipe {OUT_APIS_R}pp_gpipe --mesh pp=2,dp=1 --layers 2", 0),
    ("outside apis staged_tagger pp_gpipe_scaled bug",
     f"--model {OUT_APIS_M}staged_tagger --recipe {OUT_APIS_R}pp_gpipe_scaled --mesh pp=2,dp=1 "
     f"--layers 2", 1),
    ("outside apis encoder_tagger tp_sp_loss_parallel (a real run raises too)",
     f"--model {OUT_APIS_M}encoder_tagger --recipe {OUT_APIS_R}tp_sp_loss_parallel --dp 2 --tp 2", 2),
    ("outside apis staged_tagger pp_interleaved pp2",
     f"--model {OUT_APIS_M}staged_tagger --recipe {OUT_APIS_R}pp_interleaved --mesh pp=2,dp=1 --layers 4", 0),
    ("outside apis staged_tagger pp_1f1b pp2 dp2",
     f"--model {OUT_APIS_M}staged_tagger --recipe {OUT_APIS_R}pp_1f1b --mesh pp=2,dp=2 --layers 2", 0),
    ("outside apis staged_tagger pp_1f1b_no_dp_sum bug",
     f"--model {OUT_APIS_M}staged_tagger --recipe {OUT_APIS_R}pp_1f1b_no_dp_sum --mesh pp=2,dp=2 "
     f"--layers 2", 1),
    ("outside apis encoder_tagger tp_sp_local_heads dp2 tp2",
     f"--model {OUT_APIS_M}encoder_tagger --recipe {OUT_APIS_R}tp_sp_local_heads --dp 2 --tp 2", 0),
    ("outside apis encoder_tagger tp_sp_partials_kept bug",
     f"--model {OUT_APIS_M}encoder_tagger --recipe {OUT_APIS_R}tp_sp_partials_kept --dp 2 --tp 2", 1),
    ("outside apis encoder_tagger tp_sp_summed_over_dp bug",
     f"--model {OUT_APIS_M}encoder_tagger --recipe {OUT_APIS_R}tp_sp_summed_over_dp --dp 2 --tp 2", 1),
    ("outside apis encoder_tagger tp_sp_local_heads clip_trainer dp2 tp2",
     f"--model {OUT_APIS_M}encoder_tagger --recipe {OUT_APIS_R}tp_sp_local_heads --dp 2 --tp 2 "
     f"--clip 1.0 --clipper {OUT_APIS_R}clip_trainer", 0),
    ("outside apis encoder_tagger tp_sp_local_heads clip_trainer_counted_everywhere bug",
     f"--model {OUT_APIS_M}encoder_tagger --recipe {OUT_APIS_R}tp_sp_local_heads --dp 2 --tp 2 "
     f"--clip 1.0 --clipper {OUT_APIS_R}clip_trainer_counted_everywhere", 1),
    # the third set written outside the backend (tests/outside_apis_causal_*.py)
    ("outside apis tied_causal_lm fsdp_float64_policy dp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_float64_policy --dp 2 --tp 1", 0),
    ("outside apis tied_causal_lm fsdp_float64_policy clip_total_norm dp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_float64_policy --dp 2 --tp 1 "
     f"--clip 0.5 --clipper {OC_R}clip_total_norm", 0),
    ("outside apis tied_causal_lm fsdp_float64_policy clip_total_norm_local bug",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_float64_policy --dp 2 --tp 1 "
     f"--clip 0.5 --clipper {OC_R}clip_total_norm_local", 1),
    ("outside apis tied_causal_lm fsdp_reshard_to_2 dp4",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_reshard_to_2 --dp 4 --tp 1 --batch 8", 0),
    ("outside apis mha_pooled_classifier fsdp_accumulate_no_sync dp2",
     f"--model {OC_M}mha_pooled_classifier --recipe {OC_R}fsdp_accumulate_no_sync --dp 2 --tp 1 "
     f"--batch 8", 0),
    ("outside apis mha_pooled_classifier fsdp_accumulate_unscaled bug",
     f"--model {OC_M}mha_pooled_classifier --recipe {OC_R}fsdp_accumulate_unscaled --dp 2 --tp 1 "
     f"--batch 8", 1),
    # microbatches of one row: refused (docs/torch-backend.md, "A third set")
    ("outside apis mha_pooled_classifier fsdp_accumulate_no_sync one-row microbatches refused",
     f"--model {OC_M}mha_pooled_classifier --recipe {OC_R}fsdp_accumulate_no_sync --dp 2 --tp 1", 2),
    # label smoothing over microbatches (docs/soundness.md, "Plans traced from PyTorch", 135 (d))
    ("outside apis tied_causal_lm fsdp_accumulate_no_sync label smoothing dp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_accumulate_no_sync --dp 2 --tp 1", 0),
    ("outside apis tied_causal_lm fsdp_accumulate_unscaled label smoothing bug",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_accumulate_unscaled --dp 2 --tp 1", 1),
    ("outside apis mha_pooled_classifier ddp_checkpoint_wrapper dp2",
     f"--model {OC_M}mha_pooled_classifier --recipe {OC_R}ddp_checkpoint_wrapper --dp 2 --tp 1", 0),
    ("outside apis tied_causal_lm ddp_checkpoint_wrapper dp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}ddp_checkpoint_wrapper --dp 2 --tp 1", 0),
    ("outside apis tied_causal_lm fsdp_checkpointed dp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_checkpointed --dp 2 --tp 1", 0),
    ("outside apis tied_causal_lm ddp_blocks_only_checkpointed bug",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}ddp_blocks_only_checkpointed --dp 2 --tp 1", 1),
    ("outside apis tied_causal_lm tp_sp_blocks dp2 tp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}tp_sp_blocks --dp 2 --tp 2", 0),
    ("outside apis tied_causal_lm tp_sp_blocks_mlp_seq dp2 tp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}tp_sp_blocks_mlp_seq --dp 2 --tp 2", 0),
    ("outside apis tied_causal_lm tp_sp_blocks_ln2_unplanned bug",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}tp_sp_blocks_ln2_unplanned --dp 2 --tp 2", 1),
    ("outside apis tied_causal_lm fsdp_adamw_for_loop adamw dp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_adamw_for_loop --dp 2 --tp 1 "
     f"--optimizer adamw", 0),
    # the fused AdamW and Adam kernels (docs/soundness.md, "Plans traced from PyTorch", 135)
    ("outside apis tied_causal_lm fsdp_adamw_fused adamw dp2",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_adamw_fused --dp 2 --tp 1 "
     f"--optimizer adamw", 0),
    ("outside apis tied_causal_lm replicated_adamw_fused_unreduced bug",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}replicated_adamw_fused_unreduced --dp 2 "
     f"--tp 1 --optimizer adamw", 1),
    # Adam's L2 decay where the single-device step is AdamW: judged (soundness 135 (f))
    ("outside apis tied_causal_lm fsdp_adam_fused_l2 bug",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_adam_fused_l2 --dp 2 --tp 1 "
     f"--optimizer adamw", 1),
    ("outside apis tied_causal_lm fsdp_adamw_warmup_half bug",
     f"--model {OC_M}tied_causal_lm --recipe {OC_R}fsdp_adamw_warmup_half --dp 2 --tp 1 "
     f"--optimizer adamw", 1),
    ("outside apis mha_pooled_classifier tp_ff_distribute_module dp2 tp2",
     f"--model {OC_M}mha_pooled_classifier --recipe {OC_R}tp_ff_distribute_module --dp 2 --tp 2", 0),
    ("outside apis mha_pooled_classifier tp_ff_partial_output bug",
     f"--model {OC_M}mha_pooled_classifier --recipe {OC_R}tp_ff_partial_output --dp 2 --tp 2", 1),
    ("outside mlp_mean replicate dp2",
     f"--model mlp_mean --recipe {OUTSIDE}replicate_dp --dp 2 --tp 1", 0),
    # replicate averages over dp: a loss that is already its share of the step's is divided twice
    ("outside mlp replicate dp2 averaged a share bug",
     f"--model mlp --recipe {OUTSIDE}replicate_dp --dp 2 --tp 1", 1),
    ("outside mlp_mean tp_rowwise_left_partial bug",
     f"--model mlp_mean --recipe {OUTSIDE}tp_rowwise_left_partial --dp 2 --tp 2", 1),
    # models written outside the backend (tests/outside_models.py) and users' recipes with
    # mistakes (tests/outside_mistakes.py); docs/torch-backend.md, "Models written by users"
    *[(f"user model {model} {recipe.split(':')[-1]} {mesh}",
       f"--model {USER_MODELS}{model} --recipe {recipe} {MESHES[mesh]}", expected)
      for model, recipe, mesh, expected in [
          ("mha_seq_first", f"{STOCK}ddp", "dp2", 0),
          ("mha_seq_first", f"{STOCK}fsdp", "dp2", 0),
          ("mha_seq_first", f"{STOCK}ddp", "dp1 tp2", 0),
          ("mha_causal", "ddp_avg", "dp2", 0),
          ("mha_causal", f"{SCALING}fsdp_default", "dp2", 0),
          ("mha_causal", f"{SCALING}tp_mlp_avg", "dp2 tp2", 0),
          ("mha_causal", f"{SCALING}fsdp_tp_mlp_default", "dp2 tp2", 0),
          ("mha_causal", "ddp_avg", "dp1 tp2", 0),
          ("sentence_classifier", "ddp_avg", "dp2", 0),
          ("decoder_regressor", f"{STOCK}ddp", "dp2", 0),
          ("decoder_regressor", f"{STOCK}fsdp", "dp2", 0),
          ("einsum_lm", f"{STOCK}ddp", "dp2", 0),
          ("einsum_lm", "tp_attention", "dp2 tp2", 0),
          ("einsum_lm", "fsdp_tp_attention", "dp2 tp2", 0),
          ("einsum_lm", f"{STOCK}tp_mlp", "dp2 tp2", 0),
          ("einsum_lm", f"{STOCK}fsdp_tp_mlp", "dp2 tp2", 0),
          ("einsum_lm", "tp_attention", "dp1 tp2", 0),
          ("baddbmm_lm", "ddp_avg", "dp2", 0),
          ("baddbmm_lm", f"{SCALING}fsdp_default", "dp2", 0),
          ("baddbmm_lm", f"{SCALING}tp_mlp_avg", "dp2 tp2", 0),
          ("baddbmm_lm", f"{SCALING}fsdp_tp_mlp_default", "dp2 tp2", 0),
          ("activation_tower", "ddp_avg", "dp2", 0),
          ("activation_tower", f"{SCALING}fsdp_default", "dp2", 0),
          ("glu_tagger", f"{STOCK}ddp", "dp2", 0),
          ("glu_tagger", f"{STOCK}fsdp", "dp2", 0),
          ("distiller", "ddp_avg", "dp2", 0),
          ("distiller", f"{SCALING}fsdp_default", "dp2", 0),
          ("distiller", f"{SCALING}tp_mlp_avg", "dp2 tp2", 0),
          ("distiller", f"{SCALING}fsdp_tp_mlp_default", "dp2 tp2", 0),
          ("sigmoid_tower", f"{STOCK}ddp", "dp2", 0),
          ("sigmoid_tower", f"{STOCK}fsdp", "dp2", 0),
          ("sigmoid_tower", f"{STOCK}tp_mlp", "dp2 tp2", 0),
          ("sigmoid_tower", f"{STOCK}fsdp_tp_mlp", "dp2 tp2", 0),
          ("rotary_lm", "ddp_avg", "dp2", 0),
          ("rotary_lm", f"{SCALING}fsdp_default", "dp2", 0),
          ("rotary_lm", f"{SCALING}tp_mlp_avg", "dp2 tp2", 0),
          ("rotary_lm", "tp_attention", "dp1 tp2", 0),
          ("mixer", f"{STOCK}ddp", "dp2", 0),
          ("mixer", f"{STOCK}fsdp", "dp2", 0),
          ("mixer", f"{STOCK}tp_mlp", "dp2 tp2", 0),
          ("mixer", f"{STOCK}fsdp_tp_mlp", "dp2 tp2", 0),
          ("lstm_tagger", "ddp_avg", "dp2", 0),
          ("lstm_tagger", f"{SCALING}fsdp_default", "dp2", 0),
          ("lstm_tagger", f"{STOCK}ddp", "dp2", 1),
          ("batchnorm_regressor", "ddp_avg", "dp1 tp2", 0),
          ("batchnorm_regressor", "ddp_avg", "dp2", 1),
          ("mixer", f"{MISTAKES}ddp_blocks_only", "dp2", 1),
          ("glu_tagger", f"{MISTAKES}ddp_blocks_only", "dp2", 1),
          ("rotary_lm", f"{MISTAKES}ddp_avg_wrong_dim", "dp2 tp2", 1),
          ("mha_causal", f"{MISTAKES}ddp_avg_wrong_dim", "dp2 tp2", 1),
          ("baddbmm_lm", f"{MISTAKES}ddp_avg_divided_twice", "dp2", 1),
          ("sentence_classifier", f"{MISTAKES}ddp_avg_divided_twice", "dp2", 1),
          ("sigmoid_tower", f"{MISTAKES}tp_mlp_partial_output", "dp2 tp2", 1),
          ("mixer", f"{MISTAKES}tp_mlp_partial_output", "dp1 tp2", 1),
          ("glu_tagger", f"{SCALING}fsdp_default", "dp2", 1),
          ("mixer", "ddp_avg", "dp2", 1),
          ("distiller", f"{STOCK}ddp", "dp2", 1),
          ("activation_tower", f"{STOCK}fsdp", "dp2", 1),
          ("dropout_mlp", f"{STOCK}ddp", "dp2", 2),
          ("branch_on_value", f"{STOCK}ddp", "dp2", 2),
          ("partial_write", "ddp_avg", "dp2", 0),
          ("partial_write", f"{STOCK}ddp", "dp2", 1),
          ("strided_write", "ddp_avg", "dp2", 0),
      ]],
    # strided slices and writes through strided views (tests/strided_models.py): interleaved
    # rotary pairs written into torch.empty, y[:, ::2] = 0, copy_ into a strided view,
    # slice_scatter with a step, as_strided views, pairs of a column-sharded projection
    *[(f"outside strided {model} {recipe.split(':')[-1]} {mesh}{' bug' if expected else ''}",
       f"--model {STRIDED}{model} --recipe {recipe} {MESHES[mesh]}", expected)
      for model, recipe, mesh, expected in [
          ("interleaved_rope", "ddp_avg", "dp2", 0),
          ("interleaved_rope", f"{SCALING}fsdp_default", "dp2", 0),
          ("every_other_zero", "ddp_avg", "dp2", 0),
          ("copy_into_strided", f"{SCALING}fsdp_default", "dp2", 0),
          ("slice_scatter", "ddp_avg", "dp2", 0),
          ("as_strided_pairs", f"{SCALING}fsdp_default", "dp2", 0),
          ("pair_gated", f"{SCALING}tp_mlp_avg", "dp2 tp2", 0),
          ("pair_gated", f"{SCALING}tp_mlp_avg", "dp1 tp2", 0),
          # a per-rank mean summed over dp (the shipped mistake of item "Scaling conventions")
          ("interleaved_rope", f"{STOCK}ddp", "dp2", 1),
          ("pair_gated", f"{STOCK}tp_mlp", "dp2 tp2", 1),
          # the halves written back swapped on rank 0: the rank's cat (or the
          # narrow keeping the other half) is claimed to be the single-device
          # one and refuted (docs/soundness.md, "Plans traced from PyTorch", 94)
          ("interleaved_rope", f"{STRIDED_BUGS}ddp_avg_swapped_on_rank_0", "dp2", 1),
          ("interleaved_rope", f"{STRIDED_BUGS}fsdp_swapped_on_rank_0", "dp2", 1),
          ("copy_into_strided", f"{STRIDED_BUGS}ddp_avg_swapped_on_rank_0", "dp2", 1),
          ("copy_into_strided", f"{STRIDED_BUGS}fsdp_swapped_on_rank_0", "dp2", 1),
          ("pair_gated", f"{STRIDED_BUGS}tp_mlp_avg_swapped_on_rank_0", "dp2 tp2", 1),
          ("pair_gated", f"{STRIDED_BUGS}tp_mlp_avg_swapped_on_rank_0", "dp1 tp2", 1),
      ]],
    # issue 18's last stock ops: convolutions (tests/outside_models.py:conv_tagger)
    ("outside conv_tagger ddp dp2", f"--model {USER_MODELS}conv_tagger --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("outside conv_tagger tp_mlp dp2 tp2",
     f"--model {USER_MODELS}conv_tagger --recipe {STOCK}tp_mlp --dp 2 --tp 2", 0),
    ("outside conv_tagger ddp_linear_only bug",
     f"--model {USER_MODELS}conv_tagger --recipe {MISTAKES}ddp_linear_only --dp 2 --tp 1", 1),
    # max pooling over time with torch.amax (ties share the gradient), per-rank mean loss
    ("outside conv_pool_classifier ddp_avg dp2",
     f"--model {USER_MODELS}conv_pool_classifier --recipe ddp_avg --dp 2 --tp 1", 0),
    ("outside conv_pool_classifier fsdp default dp2",
     f"--model {USER_MODELS}conv_pool_classifier --recipe {SCALING}fsdp_default --dp 2 --tp 1", 0),
    ("outside conv_pool_classifier summed over dp bug",
     f"--model {USER_MODELS}conv_pool_classifier --recipe {STOCK}ddp --dp 2 --tp 1", 1),
    # masks from counts of the ids: lengths against position ranges, segments against each
    # other (tests/outside_models.py:segment_length_lm; cpmant's mechanism)
    ("outside segment_length_lm ddp dp2",
     f"--model {USER_MODELS}segment_length_lm --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("outside segment_length_lm tp_mlp dp2 tp2",
     f"--model {USER_MODELS}segment_length_lm --recipe {STOCK}tp_mlp --dp 2 --tp 2 --layers 2", 0),
    ("outside segment_length_lm bug mlp output partial",
     f"--model {USER_MODELS}segment_length_lm --recipe {MISTAKES}tp_mlp_partial_output --dp 2 "
     f"--tp 2 --layers 2", 1),
    ("outside segment_length_lm bug ddp linear only",
     f"--model {USER_MODELS}segment_length_lm --recipe {MISTAKES}ddp_linear_only --dp 2 --tp 1", 1),
    # a rotary table laid out (axes, batch, sequence), alike on every row: cut as the queries
    # it meets (tests/recut_models.py; docs/soundness.md, "Plans traced from PyTorch", 68)
    ("outside batch_second_rotary_lm tp_attention dp2 tp2",
     f"--model {RECUT}batch_second_rotary_lm --recipe {STOCK}tp_attention --dp 2 --tp 2", 0),
    ("outside batch_second_rotary_lm fsdp_tp_attention dp2 tp2",
     f"--model {RECUT}batch_second_rotary_lm --recipe {STOCK}fsdp_tp_attention --dp 2 --tp 2", 0),
    ("outside batch_second_rotary_lm bug no dp sum",
     f"--model {RECUT}batch_second_rotary_lm --recipe {STOCK}tp_attention_no_dp_sum --dp 2 --tp 2", 1),
    ("outside row_offset_rotary_lm bug rows of the local index tp_attention",
     f"--model {RECUT}row_offset_rotary_lm --recipe {STOCK}tp_attention --dp 2 --tp 2", 1),
    ("outside row_offset_rotary_lm bug rows of the local index ddp",
     f"--model {RECUT}row_offset_rotary_lm --recipe {STOCK}ddp --dp 2 --tp 1", 1),
    ("hf cohere_compass_text dp2 tp2", "--hf cohere_compass_text --dp 2 --tp 2", 0),
    ("hf cohere_compass_text bug rowwise not reduced",
     "--hf cohere_compass_text --recipe tp_rowwise_not_reduced --dp 2 --tp 2", 1),
    # nn.ConvTranspose1d, padding_mode reflect and replicate (tests/outside_models.py:unet_tagger)
    ("outside unet_tagger ddp dp2", f"--model {USER_MODELS}unet_tagger --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("outside unet_tagger fsdp dp2",
     f"--model {USER_MODELS}unet_tagger --recipe {STOCK}fsdp --dp 2 --tp 1", 0),
    ("outside unet_tagger ddp_linear_only bug",
     f"--model {USER_MODELS}unet_tagger --recipe {MISTAKES}ddp_linear_only --dp 2 --tp 1", 1),
    # max pooling (nn.MaxPool2d, nn.MaxPool1d) and x.max(dim): the gradient to the first maximum
    ("outside max_pool_classifier ddp_avg dp2",
     f"--model {USER_MODELS}max_pool_classifier --recipe ddp_avg --dp 2 --tp 1", 0),
    ("outside max_pool_classifier fsdp default dp2",
     f"--model {USER_MODELS}max_pool_classifier --recipe {SCALING}fsdp_default --dp 2 --tp 1", 0),
    ("outside max_pool_classifier summed over dp bug",
     f"--model {USER_MODELS}max_pool_classifier --recipe {STOCK}ddp --dp 2 --tp 1", 1),
    # padded max and average pooling, circular conv and F.pad (tests/pooling_padding_models.py)
    ("pooling pooled_tagger ddp dp2", f"--model {POOL_MODELS}pooled_tagger --recipe {STOCK}ddp "
     "--dp 2 --tp 1 --hidden 8 --ffn 8", 0),
    ("pooling pooled_tagger tp_mlp dp2 tp2", f"--model {POOL_MODELS}pooled_tagger --recipe "
     f"{STOCK}tp_mlp --dp 2 --tp 2 --hidden 8 --ffn 8", 0),
    ("pooling pooled_tagger ddp_linear_only bug", f"--model {POOL_MODELS}pooled_tagger --recipe "
     f"{MISTAKES}ddp_linear_only --dp 2 --tp 1 --hidden 8 --ffn 8", 1),
    # x.max(), x.min() with no dim: of a weight (verifies), of the batch (data parallelism differs)
    ("pooling max_scaled_tagger ddp dp2", f"--model {POOL_MODELS}max_scaled_tagger --recipe "
     f"{STOCK}ddp --dp 2 --tp 1 --hidden 8 --ffn 8", 0),
    ("pooling batch_min_tagger ddp dp2 (h.min() over the batch)", f"--model {POOL_MODELS}"
     f"batch_min_tagger --recipe {STOCK}ddp --dp 2 --tp 1 --hidden 8 --ffn 8", 1),
    # DTensor's uneven Shard(1): each down weight 8 and 7 columns
    ("uneven shard mlp rowwise_replicated_input ffn 15 dp2 tp2", f"--model mlp --recipe "
     f"{UNEVEN_RECIPES}rowwise_replicated_input --dp 2 --tp 2 --hidden 8 --ffn 15", 0),
    ("uneven shard mlp rowwise_even_offsets ffn 15 bug", f"--model mlp --recipe "
     f"{UNEVEN_RECIPES}rowwise_even_offsets --dp 1 --tp 2 --hidden 8 --ffn 15", 1),
    # shards loaded at other offsets than their placements claim (backends/torch/tracer/check.py)
    ("loaded mlp from_local next rows bug", f"--model mlp --recipe {LOADED}tp_up_next_rows "
     "--dp 2 --tp 2 --hidden 8 --ffn 8", 1),
    ("loaded mlp from_local same rows bug", f"--model mlp --recipe {LOADED}tp_up_same_rows "
     "--dp 1 --tp 2 --hidden 8 --ffn 8", 1),
    ("loaded mlp fsdp swapped checkpoint bug", f"--model mlp --recipe "
     f"{LOADED}fsdp_swapped_checkpoint --dp 2 --tp 1 --hidden 8 --ffn 8", 1),
    # gradient norms as trainers compute them for clipping (tests/norm_clippers.py)
    ("clip tp rank 0 counts duplicates (Megatron) tp_sp dp2 tp2",
     f"--model llama --recipe tp_sp {CLIP}clip_tp_rank0", 0),
    ("clip tp rank 0 counts duplicates (Megatron) fsdp_tp dp2 tp2",
     f"--model llama --recipe fsdp_tp {CLIP}clip_tp_rank0", 0),
    ("clip two all-reduces tp_sp dp2 tp2", f"--model llama --recipe tp_sp {CLIP}clip_tp_two_reduces", 0),
    ("clip item tp_sp dp2 tp2", f"--model llama --recipe tp_sp {CLIP}clip_tp_item", 0),
    ("clip item bug not reduced tp_sp dp2 tp2",
     f"--model llama --recipe tp_sp {CLIP}clip_tp_item_not_reduced", 1),
    ("clip item branch tp_sp dp2 tp2 (refused)",
     f"--model llama --recipe tp_sp {CLIP}clip_tp_item_branch", 2),
    ("clip two all-reduces fsdp_tp dp2 tp2",
     f"--model llama --recipe fsdp_tp {CLIP}clip_tp_two_reduces", 0),
    ("clip accumulated from zero tp_sp dp1 tp2",
     f"--model llama --recipe tp_sp --dp 1 {CLIP}clip_tp_accumulated", 0),
    ("clip accumulated from zero fsdp_tp dp2 tp2",
     f"--model llama --recipe fsdp_tp {CLIP}clip_tp_accumulated", 0),
    ("clip stacked norms over the flattened dp x tp group fsdp_tp dp2 tp2",
     f"--model llama --recipe fsdp_tp {CLIP}clip_stacked_norms_flat_group", 0),
    ("clip bug duplicates counted per tp rank (NeMo-RL 3788) tp_sp",
     f"--model llama --recipe tp_sp {CLIP}clip_tp_counted_per_rank", 1),
    ("clip bug duplicates counted per tp rank (NeMo-RL 3788) fsdp_tp",
     f"--model llama --recipe fsdp_tp {CLIP}clip_tp_counted_per_rank", 1),
    ("clip bug square sum not all-reduced", f"--model llama --recipe tp_sp {CLIP}clip_tp_not_reduced", 1),
    ("clip bug dp replicas' squares summed over dp x tp",
     f"--model llama --recipe tp_sp {CLIP}clip_pow_sum_flat_group_unsharded", 1),
    # PyTorch's own tensor-parallel test model with its parallelize (tests/dtensor_transformer.py):
    # the position table sharded by rows, looked up at torch.arange positions
    *[(f"dtensor {model} {recipe} {mesh}", f"--model {DT}{model} --recipe {DT}{recipe} {mesh}", 0)
      for model, recipe, mesh in [
          ("transformer", "tp", "--dp 2 --tp 2"), ("transformer", "tp_sp", "--dp 2 --tp 2"),
          ("transformer_tied", "tp_sp", "--dp 2 --tp 2"),
          ("transformer", "tp_sp", "--dp 1 --tp 4 --seqlen 8"),
          ("transformer_tied", "tp", "--dp 1 --tp 4"), ("transformer", "fsdp_tp", "--dp 2 --tp 2"),
          ("transformer_tied", "fsdp_tp", "--dp 2 --tp 2")]],
    ("dtensor transformer bug gradients averaged over dp",
     f"--model {DT}transformer --recipe {DT}tp_sp_dp_averaged --dp 2 --tp 2", 1),
    # labels masked before the loss ignores them (tests/label_mask_models.py)
    ("labels masked_fill(labels == pad, -100) ddp dp2",
     f"--model {LM}masked_fill --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("labels torch.where(labels == pad, -100, labels) fsdp dp2",
     f"--model {LM}where --recipe {STOCK}fsdp --dp 2 --tp 1", 0),
    ("labels labels[labels == pad] = -100 fsdp_tp_mlp dp2 tp2",
     f"--model {LM}index_put --recipe {STOCK}fsdp_tp_mlp --dp 2 --tp 2", 0),
    ("labels masked_fill tp_mlp dp2 tp2", f"--model {LM}masked_fill --recipe {STOCK}tp_mlp", 0),
    ("labels masked_fill mean tp_mlp dp1 tp2",
     f"--model {LM}masked_fill_mean --recipe {STOCK}tp_mlp --dp 1 --tp 2", 0),
    ("labels masked_fill bug per-rank kept-label means summed over dp",
     f"--model {LM}masked_fill_mean --recipe {STOCK}ddp --dp 2 --tp 1", 1),
    ("labels read as numbers refused (naming the op and the ids)",
     f"--model {LM}doubled --recipe {STOCK}ddp --dp 2 --tp 1", 2),
    # log-probabilities read by the loss (tests/loss_parallel_models.py)
    ("log_softmax 3-D, flatten, nll_loss tp_sp_loss_parallel dp2 tp2",
     f"--model {LP}log_softmax_nll --recipe tp_sp_loss_parallel", 0),
    ("log_softmax 3-D, flatten, nll_loss tp_sp dp2 tp2", f"--model {LP}log_softmax_nll --recipe tp_sp", 0),
    ("log_softmax label smoothing, a second reader, tp_sp dp2 tp2",
     f"--model {LP}log_softmax_smoothed --recipe tp_sp", 0),
    ("log_softmax bug second reader under loss_parallel (pytorch 190746)",
     f"--model {LP}log_softmax_smoothed --recipe tp_sp_loss_parallel", 1),
    # plans applied to values they do not describe (tests/tp_plan_mistakes.py): findings
    ("mlp bug sequence-parallel plan on whole rows",
     f"--model mlp --recipe {TPM}sp_mlp_on_whole_rows --dp 1 --tp 2", 1),
    ("gpt2 tied head re-tied after the vocabulary plan",
     f"--model gpt2 --recipe {TPM}tied_head_retied --dp 2 --tp 2", 0),
    ("gpt2 bug tie broken by the vocabulary plan",
     f"--model gpt2 --recipe {TPM}tied_head_untied_by_tp --dp 2 --tp 2", 1),
    # torchtitan's models by family, its own parallelize, the tie made again (backends/torch/zoo/titan.py)
    ("titan qwen3 debugmodel tp2 (tied)", "--model titan:qwen3 --recipe titan:parallelize --dp 1 "
     "--tp 2 --vocab 2048 --batch 2", 0),
    ("titan qwen3 debugmodel dp2 tp2 (tied)", "--model titan:qwen3 --recipe titan:parallelize "
     "--dp 2 --tp 2 --vocab 2048 --batch 4", 0),
    ("titan llama3 by family tp2", "--model titan:llama3 --recipe titan:parallelize --dp 1 --tp 2 "
     "--vocab 2048 --batch 2", 0),
    ("titan qwen3 bug tie not made again after parallelize", "--model titan:qwen3 --recipe "
     f"{TPM}titan_tie_not_made_again --dp 1 --tp 2 --vocab 2048 --batch 2", 1),
    # given a small mixture (its default num_experts_per_tok is None), its routing recorded and
    # replayed; its TP plan's packed expert columns are strided shards (soundness 87); gloo same
    ("hf deepseek_v2 tp2 (top-k routing recorded, packed expert columns)",
     "--hf deepseek_v2 --dp 1 --tp 2", 0),
    # running sums, flips and zero padding of computed tensors (tests/scan_models.py)
    ("scan_tagger cumsum, flip, pad ddp dp2",
     f"--model tests.scan_models:scan_tagger --recipe {STOCK}ddp --dp 2 --tp 1", 0),
    ("hf qwen3_5_text dp2 tp2 (Gated DeltaNet's unit triangular solve: soundness 46)",
     "--hf qwen3_5_text --dp 2 --tp 2",
     0),
]

#: transformers families with a tensor-parallel plan, built through transformers' auto
#: mappings (backends/torch/zoo/hf.py; docs/torch-backend.md, "Any Hugging Face family")
HF_TP_FAMILIES = ("mistral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt_neox",
                  "granite", "starcoder2", "cohere", "glm", "helium", "smollm3", "phi", "olmo",
                  "cohere2", "glm4", "exaone4", "nemotron", "vaultgemma", "seed_oss")
#: families without one: data parallel only (FSDP2 through transformers, or DDP)
HF_DP_FAMILIES = ("gpt2", "opt")
CASES += [(f"hf {f} {mesh}", f"--hf {f} {MESHES[mesh]}", 0)
          for f in HF_TP_FAMILIES for mesh in ("dp2", "dp1 tp2", "dp2 tp2")]
CASES += [case for f in HF_DP_FAMILIES for case in (
    (f"hf {f} fsdp2 dp2", f"--hf {f} --dp 2 --tp 1", 0),
    (f"hf {f} ddp dp2", f"--hf {f} --recipe ddp --dp 2 --tp 1", 0),
    (f"hf {f} tp2 refused (no tensor-parallel plan)", f"--hf {f} --dp 1 --tp 2", 2))]
CASES += [
    ("hf stablelm fsdp2 dp2 (partial rotary)", "--hf stablelm --dp 2 --tp 1 --hidden 32 --heads 2", 0),
    ("hf mistral bug rowwise output partial",
     "--hf mistral --recipe tp_rowwise_not_reduced --dp 1 --tp 2", 1),
    ("hf gpt_neox bug rowwise output partial",
     "--hf gpt_neox --recipe tp_rowwise_not_reduced --dp 2 --tp 2", 1),
    ("hf gemma3_text bug norm grads not reduced",
     "--hf gemma3_text --recipe tp_norm_grads_not_reduced --dp 1 --tp 2", 1),
    ("hf gemma bug fsdp avg", "--hf gemma --recipe tp_fsdp_avg --dp 2 --tp 2", 1),
    ("hf opt bug ddp averaging a shared-out loss", "--hf opt --recipe ddp_avg --dp 2 --tp 1", 1),
    ("hf mllama refused (vision tower, its text model no causal-LM family)",
     "--hf mllama --dp 1 --tp 2", 2),
    # BLT's entropy patcher reads the patches' count from computed entropies
    # (.item()); with static one-byte patches it reaches aten.unfold of the ids
    ("hf blt refused (entropy patching: patch counts read from computed values)",
     "--hf blt --dp 2 --tp 1", 2),
    ("hf blt static patches refused (aten.unfold of the ids, not lowered)",
     "--model tests.blt_models:blt_static --recipe backends.torch.zoo.hf:ddp --dp 2 --tp 1", 2),
    ("hf falcon dp2 (its attention's constant-index lookup: soundness 39 f)", "--hf falcon --dp 2 --tp 1", 0),
]

#: top-k mixtures of experts, their routing recorded and replayed (docs/soundness.md, "Plans
#: traced from PyTorch", 36); wrong plans in harness/moe_bugs.py
MOE_BUGS = "harness.moe_bugs:"
#: torchtitan's DeepSeek-V3 debugmodel under its own parallelize_deepseekv3 (ep 1)
DEEPSEEK = ("--model backends.torch.titan:deepseek_v3_debugmodel --recipe "
            "backends.torch.titan:parallelize_deepseekv3 --vocab 2048")
#: the same with expert parallelism over the data-parallel ranks (ep = dp)
DEEPSEEK_EP_MODEL = "--model backends.torch.titan:deepseek_v3_debugmodel_ep"
DEEPSEEK_EP = (f"{DEEPSEEK_EP_MODEL} --recipe backends.torch.titan:parallelize_deepseekv3_ep "
               "--vocab 2048")
CASES += [
    ("moe mixtral dp2", "--hf mixtral --dp 2 --tp 1", 0),
    ("moe mixtral ddp dp2", "--hf mixtral --recipe ddp --dp 2 --tp 1", 0),
    ("moe mixtral dp2 batch 8 uneven routing", "--hf mixtral --dp 2 --tp 1 --batch 8 --seed 9", 0),
    ("moe qwen3_moe dp2", "--hf qwen3_moe --dp 2 --tp 1", 0),
    ("moe olmoe dp2", "--hf olmoe --dp 2 --tp 1", 0),
    ("moe glm4_moe dp2 (group-limited router: a group mask scattered at the groups chosen)",
     "--hf glm4_moe --dp 2 --tp 1", 0),
    ("moe glm4_moe bug token to another expert", f"--hf glm4_moe --recipe "
     f"{MOE_BUGS}token_to_other_expert --dp 2 --tp 1", 1),
    ("moe mixtral bug token to another expert", f"--hf mixtral --recipe {MOE_BUGS}token_to_other_expert "
     "--dp 2 --tp 1", 1),
    ("moe mixtral bug routed with another token's experts",
     f"--hf mixtral --recipe {MOE_BUGS}routed_to_other_token --dp 2 --tp 1", 1),
    ("moe qwen3_moe bug token to another expert", f"--hf qwen3_moe --recipe {MOE_BUGS}token_to_other_expert "
     "--dp 2 --tp 1", 1),
    ("moe olmoe bug routed with another token's experts",
     f"--hf olmoe --recipe {MOE_BUGS}routed_to_other_token --dp 2 --tp 1", 1),
    ("moe mixtral bug fsdp avg", "--hf mixtral --recipe tp_fsdp_avg --dp 2 --tp 1", 1),
    ("moe mixtral bug combine with another token's gate (the permuted weights stand in for the "
     "weights: FAIL at the permutation on rank 0)",
     f"--hf mixtral --recipe {MOE_BUGS}combine_other_gate --dp 2 --tp 1", 1),
    ("moe hf mixtral dp2 no-token expert (seed 5: expert 1's two tokens on rank 1 only; rank 0's "
     "loop runs it on no token, its masks zero by value: 88)",
     "--hf mixtral --dp 2 --tp 1 --seed 5", 0),
    ("moe hf mixtral dp2 no-token expert ddp", "--hf mixtral --recipe ddp --dp 2 --tp 1 --seed 5", 0),
    ("moe hf mixtral dp2 no-token expert bug token to another expert",
     f"--hf mixtral --recipe {MOE_BUGS}token_to_other_expert --dp 2 --tp 1 --seed 5", 1),
    ("moe hf mixtral dp2 no-token expert bug skip an expert with tokens (no empty iteration to "
     "fill in: the term is missing)",
     f"--hf mixtral --recipe {MOE_BUGS}skip_expert_with_tokens --dp 2 --tp 1 --seed 5", 1),
    ("moe hf mixtral dp2 no-token expert bug combine with another token's gate (rank 0 runs "
     "expert 1 on no token and weighs its first two tokens with each other's gates)",
     f"--hf mixtral --recipe {MOE_BUGS}combine_other_gate --dp 2 --tp 1 --seed 5", 1),
    ("moe hf mixtral dp2 no-token expert bug routed with another token's experts (rank 0's "
     "wrong mask of expert 2 equals expert 3's on rank 1's rows; matched again with expert 2's "
     "at the mul that reads it: FAIL at a mul of mlp.experts on rank 0, soundness 100; refused "
     "before; gloo differs)",
     f"--hf mixtral --recipe {MOE_BUGS}routed_to_other_token --dp 2 --tp 1 --seed 5", 1),
    ("moe hf mixtral dp2 no-token expert bug skip an expert with tokens, balanced routing",
     f"--hf mixtral --recipe {MOE_BUGS}skip_expert_with_tokens --dp 2 --tp 1", 1),
    ("moe hf mixtral ep2 (transformers' AllToAllEP: pairs dispatched, experts on the received rows, "
     "combined per token)", "--hf mixtral --dp 2 --tp 1 --ep 2", 0),
    ("moe hf mixtral ep2 skewed routing (batch 8, seed 9: 22, 25, 7, 10 tokens per expert)",
     "--hf mixtral --dp 2 --tp 1 --ep 2 --batch 8 --seed 9", 0),
    ("moe hf mixtral ep2 an expert with no token on a rank (seed 5: expert 1's two tokens from "
     "rank 1 only)", "--hf mixtral --dp 2 --tp 1 --ep 2 --seed 5", 0),
    ("moe hf mixtral tp2 packed (packed_colwise expert columns: a strided shard loaded as its two "
     "blocks, soundness 87; gloo same at rtol 1e-6)", "--hf mixtral --dp 1 --tp 2", 0),
    ("moe hf mixtral dp2 tp2 packed (FSDP2 rows over dp, the packed columns over tp)",
     "--hf mixtral --dp 2 --tp 2", 0),
    ("moe hf qwen3_moe dp2 tp2 packed", "--hf qwen3_moe --dp 2 --tp 2", 0),
    ("moe hf olmoe dp2 tp2 packed", "--hf olmoe --dp 2 --tp 2", 0),
    ("moe hf qwen3_moe tp2 packed", "--hf qwen3_moe --dp 1 --tp 2", 0),
    ("moe hf olmoe tp2 packed", "--hf olmoe --dp 1 --tp 2", 0),
    ("moe hf mixtral tp2 wrong colwise (the packed gate/up columns sharded colwise: rank 0 all "
     "of gate, rank 1 all of up; FAIL at the experts' chunk, gloo differs)",
     f"--hf mixtral --recipe {MOE_BUGS}packed_as_colwise --dp 1 --tp 2", 1),
    ("moe hf qwen3_moe tp2 wrong colwise",
     f"--hf qwen3_moe --recipe {MOE_BUGS}packed_as_colwise --dp 1 --tp 2", 1),
    ("moe hf qwen3_moe ep2", "--hf qwen3_moe --dp 2 --tp 1 --ep 2", 0),
    ("moe hf olmoe ep2", "--hf olmoe --dp 2 --tp 1 --ep 2", 0),
    ("moe hf deepseek_v3 ep2 (group-limited router, a shared expert)",
     "--hf deepseek_v3 --dp 2 --tp 1 --ep 2", 0),
    ("moe hf mixtral ep2 bug expert grads 2x (pytorch 160285: each rank's own mean, FSDP's "
     "default division, the experts' shard group of one rank)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_expert_grads_undivided --dp 2 --tp 1 --ep 2", 1),
    ("moe hf mixtral ep2 bug fsdp avg (every gradient's mean over its shard group: dense 1/2 x)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_fsdp_avg --dp 2 --tp 1 --ep 2", 1),
    ("moe hf mixtral ep2 bug token to another expert (FAIL at rank 0's pick of its pairs)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_token_to_other_expert --dp 2 --tp 1 --ep 2", 1),
    ("moe hf mixtral ep2 bug wrong split size (FAIL at rank 0's pick of its pairs)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_wrong_split --dp 2 --tp 1 --ep 2", 1),
    ("moe hf aria_text ep2 (its experts' mul reads a single-device mul's values in another "
     "order: claimed and proved, soundness 94; refused before; gloo same)",
     "--hf aria_text --dp 2 --tp 1 --ep 2", 0),
    ("moe hf jamba dp2 (one constant for two experts' equal masks on rank 0: copied for the "
     "second expert's reads and matched with its mask, soundness 100; refused before; gloo "
     "same, max error 3.3e-16)",
     "--hf jamba --dp 2 --tp 1", 0),
    ("moe hf mixtral ep2 bug routed to another token (FAIL at a mul of mlp.experts on rank 0, "
     "claimed to be the nearest single-device node: soundness 94; refused before)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_routed_to_other_token --dp 2 --tp 1 --ep 2", 1),
    ("moe hf mixtral ep2 bug combine with another token's gate (the gates' rows at the "
     "permutation stand in for the gates: FAIL at the lookup on rank 0)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_combine_other_gate --dp 2 --tp 1 --ep 2", 1),
    # transformers' EP with TP: the EP group the TP group (tp2 ep2: each rank dispatches its
    # chunk of the shared batch) or every rank (dp2 tp2 ep4: "ep" spans dp x tp; one expert
    # per rank); docs/soundness.md, "Plans traced from PyTorch", 99
    ("moe hf mixtral tp2 ep2 (each rank's chunk of the shared batch dispatched; gloo same)",
     "--hf mixtral --dp 1 --tp 2 --ep 2", 0),
    ("moe hf qwen3_moe tp2 ep2", "--hf qwen3_moe --dp 1 --tp 2 --ep 2", 0),
    ("moe hf mixtral dp2 tp2 ep4 (the ep dim over dp x tp, one expert per rank; gloo same)",
     "--hf mixtral --dp 2 --tp 2 --ep 4", 0),
    ("moe hf qwen3_moe dp2 tp2 ep4", "--hf qwen3_moe --dp 2 --tp 2 --ep 4", 0),
    ("moe hf mixtral tp2 ep2 bug token to another expert",
     f"--hf mixtral --recipe {MOE_BUGS}ep_token_to_other_expert --dp 1 --tp 2 --ep 2", 1),
    ("moe hf mixtral tp2 ep2 bug wrong split size",
     f"--hf mixtral --recipe {MOE_BUGS}ep_wrong_split --dp 1 --tp 2 --ep 2", 1),
    ("moe hf mixtral dp2 tp2 ep4 bug expert grads 2x (pytorch 160285)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_expert_grads_undivided --dp 2 --tp 2 --ep 4", 1),
    ("moe hf mixtral dp2 tp2 ep4 bug token to another expert (rank 0's wrong mask, an input of "
     "its own, matched per reader: FAIL at a mul of mlp.experts on rank 0, soundness 106; "
     "refused before; gloo differs)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_token_to_other_expert --dp 2 --tp 2 --ep 4", 1),
    ("moe hf mixtral dp2 tp2 ep4 bug wrong split size (FAIL at a mul of mlp.experts on rank 0, "
     "soundness 106; refused before; gloo differs)",
     f"--hf mixtral --recipe {MOE_BUGS}ep_wrong_split --dp 2 --tp 2 --ep 4", 1),
    # gpt_oss: expert biases, interleaved gate/up columns, a clamped "swiglu with limit",
    # attention sinks (docs/soundness.md, "Plans traced from PyTorch", 93)
    ("moe hf gpt_oss dp2", "--hf gpt_oss --dp 2 --tp 1", 0),
    ("moe hf gpt_oss ep2", "--hf gpt_oss --dp 2 --tp 1 --ep 2", 0),
    ("moe hf gpt_oss bug token to another expert",
     f"--hf gpt_oss --recipe {MOE_BUGS}token_to_other_expert --dp 2 --tp 1", 1),
    ("moe hf gpt_oss bug routed with another token's experts",
     f"--hf gpt_oss --recipe {MOE_BUGS}routed_to_other_token --dp 2 --tp 1", 1),
    ("moe hf gpt_oss bug combine with another token's gate",
     f"--hf gpt_oss --recipe {MOE_BUGS}combine_other_gate --dp 2 --tp 1", 1),
    ("moe hf gpt_oss ep2 bug token to another expert",
     f"--hf gpt_oss --recipe {MOE_BUGS}ep_token_to_other_expert --dp 2 --tp 1 --ep 2", 1),
    ("moe hf gpt_oss ep2 bug wrong split size",
     f"--hf gpt_oss --recipe {MOE_BUGS}ep_wrong_split --dp 2 --tp 1 --ep 2", 1),
    ("moe hf gpt_oss ep2 bug expert grads 2x (pytorch 160285)",
     f"--hf gpt_oss --recipe {MOE_BUGS}ep_expert_grads_undivided --dp 2 --tp 1 --ep 2", 1),
    # jetmoe: top-k experts in the MLP and in the attention (a mixture of attention
    # experts, rows put back at their sorted positions: item 36 c)
    ("moe hf jetmoe dp2 (attention experts too)", "--hf jetmoe --dp 2 --tp 1", 0),
    ("moe hf jetmoe bug attention experts combined with another pair's gate refused (a wrong "
     "plan: rank 0's combine sums the sorted pairs by a constant of its own no single-device "
     "node reads alike; no SUCCESS, a FAIL left to do)",
     f"--hf jetmoe --recipe {MOE_BUGS}gating_other_gate --dp 2 --tp 1", 2),
    ("moe mixtral tied router scores (two experts take every token, two none)",
     "--model backends.torch.hf_moe:tied_mixtral --recipe backends.torch.hf:tp_fsdp --dp 2 --tp 1", 0),
    ("moe mixtral aux loss per rank (the load-balancing loss of each rank's tokens, not the step's)",
     "--model backends.torch.hf_moe:mixtral --recipe backends.torch.hf:tp_fsdp --dp 2 --tp 1", 1),
    ("moe titan deepseek_v3 parallelize_deepseekv3 dp2", f"{DEEPSEEK} --dp 2 --tp 1", 0),
    ("moe titan deepseek_v3 bug routed with another token's experts",
     f"{DEEPSEEK.split(' --recipe')[0]} --recipe {MOE_BUGS}titan_routed_to_other_token --vocab 2048 "
     "--dp 2 --tp 1", 1),
    # its own tensor-parallel plan (a softmax backward at the piece DTensor cuts of the
    # router's output: docs/soundness.md, "Plans traced from PyTorch", 50 g)
    ("moe titan deepseek_v3 parallelize_deepseekv3 dp1 tp2", f"{DEEPSEEK} --dp 1 --tp 2", 0),
    ("moe titan deepseek_v3 parallelize_deepseekv3 dp2 tp2", f"{DEEPSEEK} --dp 2 --tp 2", 0),
    # expert parallelism: torchtitan's all-to-all token dispatcher, uneven splits
    # (docs/soundness.md, "Plans traced from PyTorch", 37)
    ("moe titan deepseek_v3 parallelize_deepseekv3 dp2 ep2", f"{DEEPSEEK_EP} --dp 2 --tp 1", 0),
    ("moe titan deepseek_v3 dp2 ep2 an expert that receives no token (batch 2, seed 1: expert 0 "
     "at router call 0)", f"{DEEPSEEK_EP} --dp 2 --tp 1 --batch 2 --seed 1", 0),
    ("moe titan deepseek_v3 ep2 bug expert grads 2x (pytorch 160285: FSDP's default division "
     "over the expert-data-parallel group, a per-rank mean loss)",
     f"{DEEPSEEK_EP_MODEL} --recipe {MOE_BUGS}titan_ep_expert_grads_undivided --vocab 2048 "
     "--dp 2 --tp 1", 1),
    # with TP: sequence-parallel token rows, the ep group the tp ranks of a dp block; the
    # single-device step in the ranks' order of the rows (docs/soundness.md, "Plans traced
    # from PyTorch", 89 and 98)
    ("moe titan deepseek_v3 dp2 ep2 tp2 (sequence-parallel token rows in the ranks' order)",
     f"{DEEPSEEK_EP} --dp 2 --tp 2", 0),
    # pytorch 160285's division is right here: the experts' shard group (efsdp = dp x tp / ep)
    # is the dp ranks, as the dense modules' (gloo: same)
    ("moe titan deepseek_v3 dp2 ep2 tp2 FSDP's default division and a per-rank mean loss "
     "(pytorch 160285's plan, right at this mesh)",
     f"{DEEPSEEK_EP_MODEL} --recipe {MOE_BUGS}titan_ep_expert_grads_undivided --vocab 2048 "
     "--dp 2 --tp 2", 0),
    ("moe titan deepseek_v3 dp2 ep2 tp2 bug combine with another token's gate (the hook's own "
     "flatten of the rank's rows on dp rank 0 only, its backward pair left out: FAIL at the "
     "routed experts' lookup on rank 0; gloo differs)",
     f"{DEEPSEEK_EP_MODEL} --recipe {MOE_BUGS}titan_ep_combine_other_gate --vocab 2048 "
     "--dp 2 --tp 2", 1),
    ("moe titan deepseek_v3 dp2 ep2 tp2 bug wrong split size",
     f"{DEEPSEEK_EP_MODEL} --recipe {MOE_BUGS}titan_ep_wrong_split --vocab 2048 --dp 2 --tp 2", 1),
    ("moe titan deepseek_v3 dp2 ep2 tp2 bug routed with another token's experts (FAIL at the "
     "routed experts' group mask on rank 1; gloo differs)",
     f"{DEEPSEEK_EP_MODEL} --recipe {MOE_BUGS}titan_ep_routed_to_other_token --vocab 2048 "
     "--dp 2 --tp 2", 1),
    ("moe titan deepseek_v3 ep2 clip by the norm over every expert (harness.moe_clippers)",
     f"{DEEPSEEK_EP} --dp 2 --tp 1 --clip 0.5 --clipper harness.moe_clippers:clip_ep", 0),
    ("moe titan deepseek_v3 ep2 bug clip norm not reduced across the ep ranks (NeMo-Automodel "
     "PR 3817)", f"{DEEPSEEK_EP} --dp 2 --tp 1 --clip 0.5 --clipper "
     "harness.moe_clippers:clip_ep_experts_not_reduced", 1),
    ("moe titan deepseek_v3 ep2 bug expert norms averaged over dp (DeepSpeed PR 8478)",
     f"{DEEPSEEK_EP} --dp 2 --tp 1 --clip 0.5 --clipper "
     "harness.moe_clippers:clip_ep_expert_norms_averaged", 1),
    ("moe titan deepseek_v3 ep2 bug wrong split size (a token's row sent to the next rank's "
     "expert)", f"{DEEPSEEK_EP_MODEL} --recipe {MOE_BUGS}titan_ep_wrong_split --vocab 2048 "
     "--dp 2 --tp 1", 1),
    ("moe titan deepseek_v3 ep2 bug combine with another token's gate (the permuted scores "
     "stand in for the flattened scores, read back in the scores' shape and flattened again: "
     "FAIL at the lookup on rank 0)", f"{DEEPSEEK_EP_MODEL} --recipe "
     f"{MOE_BUGS}titan_ep_combine_other_gate --vocab 2048 --dp 2 --tp 1", 1),
    ("moe titan deepseek_v3 ep2 bug routed with another token's experts",
     f"{DEEPSEEK_EP_MODEL} --recipe {MOE_BUGS}titan_ep_routed_to_other_token --vocab 2048 "
     "--dp 2 --tp 1", 1),
]

#: torchtitan's other MoE models by family (backends/torch/zoo/titan.py FAMILIES), each under
#: its family's own parallelize function (titan:parallelize, titan:parallelize_ep: ep = dp),
#: two blocks of the flavor's (docs/soundness.md, "Plans traced from PyTorch", 97)
TITAN_MOE = "--recipe titan:parallelize --vocab 2048 --layers 2"
TITAN_MOE_EP = "--recipe titan:parallelize_ep --vocab 2048 --layers 2"
CASES += [
    ("moe titan qwen3_moe dp2", f"--model titan:qwen3_moe {TITAN_MOE} --dp 2 --tp 1", 0),
    ("moe titan qwen3_moe tp2", f"--model titan:qwen3_moe {TITAN_MOE} --dp 1 --tp 2 --batch 2", 0),
    ("moe titan qwen3_moe dp2 ep2", f"--model titan:qwen3_moe_ep {TITAN_MOE_EP} --dp 2 --tp 1", 0),
    ("moe titan qwen3_moe bug routed with another token's experts",
     f"--model titan:qwen3_moe --recipe {MOE_BUGS}titan_routed_to_other_token --vocab 2048 "
     "--layers 2 --dp 2 --tp 1", 1),
    ("moe titan qwen3_moe ep2 bug expert grads 2x (pytorch 160285)",
     f"--model titan:qwen3_moe_ep --recipe {MOE_BUGS}titan_ep_expert_grads_undivided "
     "--vocab 2048 --layers 2 --dp 2 --tp 1", 1),
    ("moe titan kimi_k2_7 dp2", f"--model titan:kimi_k2_7 {TITAN_MOE} --dp 2 --tp 1", 0),
    ("moe titan kimi_k2_7 dp2 ep2", f"--model titan:kimi_k2_7_ep {TITAN_MOE_EP} --dp 2 --tp 1", 0),
    ("moe titan kimi_k2_7 bug routed with another token's experts",
     f"--model titan:kimi_k2_7 --recipe {MOE_BUGS}titan_routed_to_other_token --vocab 2048 "
     "--layers 2 --dp 2 --tp 1", 1),
    # its experts' biases picked per row (b[repeat_interleave(counts)]) and added to the grouped
    # product, its interleaved columns clamped (docs/soundness.md, "Plans traced from PyTorch", 104)
    ("moe titan gpt_oss dp2", f"--model titan:gpt_oss {TITAN_MOE} --dp 2 --tp 1", 0),
    ("moe titan gpt_oss dp2 ep2", f"--model titan:gpt_oss_ep {TITAN_MOE_EP} --dp 2 --tp 1", 0),
    ("moe titan gpt_oss bug routed with another token's experts",
     f"--model titan:gpt_oss --recipe {MOE_BUGS}titan_routed_to_other_token --vocab 2048 "
     "--layers 2 --dp 2 --tp 1", 1),
    ("moe titan gpt_oss ep2 bug expert grads 2x (pytorch 160285)",
     f"--model titan:gpt_oss_ep --recipe {MOE_BUGS}titan_ep_expert_grads_undivided "
     "--vocab 2048 --layers 2 --dp 2 --tp 1", 1),
    ("moe titan gpt_oss ep2 bug wrong split size",
     f"--model titan:gpt_oss_ep --recipe {MOE_BUGS}titan_ep_wrong_split "
     "--vocab 2048 --layers 2 --dp 2 --tp 1", 1),
    # its own TP plan: the combine's deterministic_scatter_add lowered as scatter_add, the
    # experts' down bias divided by tp (docs/soundness.md, "Plans traced from PyTorch", 112);
    # torchtitan 0.3.0's ScaledBiasRowwiseLinear leaves attention.wo.bias's gradient 1/tp on
    # every rank (gloo: differs, 0.5 x)
    ("moe titan gpt_oss tp2 attention.wo.bias gradient 1/tp (torchtitan 0.3.0's "
     "ScaledBiasRowwiseLinear)", "--model titan:gpt_oss --recipe titan:parallelize --vocab 2048 "
     "--dp 1 --tp 2 --batch 2", 1),
    # the same with that bias divided by tp in the forward only (ScaleBiasForward's rule, the
    # recipe backends/torch/zoo/titan_scaled_bias.py): the single-device step's bias / 1 is
    # no node (docs/soundness.md, "Plans traced from PyTorch", 119; gloo in float64: same)
    ("moe titan gpt_oss tp2 its rowwise bias divided in the forward only",
     "--model titan:gpt_oss --recipe backends.torch.zoo.titan_scaled_bias:parallelize "
     "--vocab 2048 --dp 1 --tp 2 --batch 2", 0),
    # the same at dp2 tp2: the experts' bias-gradient sums span the grouped GEMM's groups, not
    # the last expert a rank's tokens chose (docs/soundness.md, "Plans traced from PyTorch", 123)
    ("moe titan gpt_oss dp2 tp2 its rowwise bias divided in the forward only",
     "--model titan:gpt_oss --recipe backends.torch.zoo.titan_scaled_bias:parallelize "
     "--vocab 2048 --dp 2 --tp 2", 0),
    ("moe titan gpt_oss dp2 tp2 attention.wo.bias gradient 1/tp (torchtitan 0.3.0's "
     "ScaledBiasRowwiseLinear)", "--model titan:gpt_oss --recipe titan:parallelize --vocab 2048 "
     "--dp 2 --tp 2", 1),
    ("moe titan gpt_oss dp2 tp2 bug routed with another token's experts",
     f"--model titan:gpt_oss --recipe {MOE_BUGS}titan_scaled_bias_routed_to_other_token "
     "--vocab 2048 --dp 2 --tp 2", 1),
]

#: torchtitan's auxiliary-loss-free load balancing: its own optimizer pre-hook (the counts
#: all-reduced over "loss", the expert biases moved by their signs, the counts zeroed) on an
#: SGD step, every rank's biases and counts compared by value with the single-device step's
#: (docs/soundness.md, "Plans traced from PyTorch", 105); the wrong plans give the hook a
#: wrong "loss" mesh
BALANCE = "backends.torch.zoo.titan_balance:"
TITAN_BIAS = "--vocab 2048 --layers 2 --optimizer sgd"
CASES += [
    ("moe titan deepseek_v3 bias dp2 (torchtitan's load-balancing hook on the optimizer step)",
     f"--model {BALANCE}deepseek_v3 --recipe {BALANCE}parallelize {TITAN_BIAS} --dp 2 --tp 1", 0),
    ("moe titan deepseek_v3 bias dp2 ep2",
     f"--model {BALANCE}deepseek_v3_ep --recipe {BALANCE}parallelize_ep {TITAN_BIAS} --dp 2 "
     "--tp 1", 0),
    ("moe titan deepseek_v3 bias dp2 tp2",
     f"--model {BALANCE}deepseek_v3 --recipe {BALANCE}parallelize {TITAN_BIAS} --dp 2 --tp 2", 0),
    ("moe titan deepseek_v3 bias dp2 ep2 counts over ep (the data-parallel ranks at tp 1)",
     f"--model {BALANCE}deepseek_v3_ep --recipe {BALANCE}parallelize_ep_counts_over_ep "
     f"{TITAN_BIAS} --dp 2 --tp 1", 0),
    ("moe titan deepseek_v3 bias bug counts not all-reduced (each rank's bias from its tokens)",
     f"--model {BALANCE}deepseek_v3 --recipe {BALANCE}parallelize_counts_not_reduced "
     f"{TITAN_BIAS} --dp 2 --tp 1", 1),
    ("moe titan deepseek_v3 bias ep2 bug counts not all-reduced",
     f"--model {BALANCE}deepseek_v3_ep --recipe {BALANCE}parallelize_ep_counts_not_reduced "
     f"{TITAN_BIAS} --dp 2 --tp 1", 1),
    ("moe titan deepseek_v3 bias dp2 tp2 bug counts all-reduced over tp instead of dp",
     f"--model {BALANCE}deepseek_v3 --recipe {BALANCE}parallelize_counts_over_tp {TITAN_BIAS} "
     "--dp 2 --tp 2", 1),
    ("moe titan qwen3_moe bias dp2",
     f"--model {BALANCE}qwen3_moe --recipe {BALANCE}parallelize {TITAN_BIAS} --dp 2 --tp 1", 0),
    ("moe titan qwen3_moe bias dp2 ep2",
     f"--model {BALANCE}qwen3_moe_ep --recipe {BALANCE}parallelize_ep {TITAN_BIAS} --dp 2 "
     "--tp 1", 0),
    ("moe titan qwen3_moe bias bug counts not all-reduced",
     f"--model {BALANCE}qwen3_moe --recipe {BALANCE}parallelize_counts_not_reduced "
     f"{TITAN_BIAS} --dp 2 --tp 1", 1),
    # refused before the hook: SGD leaves the vision encoder's parameters, which the text
    # step never reads, as loaded (no gradient), and a parameter no step writes is refused
    ("moe titan kimi_k2_7 bias dp2 refused (its unread vision encoder's parameters not stepped)",
     f"--model {BALANCE}kimi_k2_7 --recipe {BALANCE}parallelize {TITAN_BIAS} --dp 2 --tp 1", 2),
    # transformers' load-balancing loss in its data-parallel form: the assignment counts
    # all-reduced over dp, both sums over the step's tokens (item 105 (e))
    ("moe mixtral aux loss over the step's tokens (counts all-reduced over dp)",
     "--model backends.torch.zoo.hf_moe_global:mixtral --recipe "
     "backends.torch.zoo.hf_moe_global:tp_fsdp --dp 2 --tp 1", 0),
    ("moe mixtral aux loss bug counts not all-reduced (each rank's own fractions)",
     "--model backends.torch.zoo.hf_moe_global:mixtral --recipe "
     "backends.torch.zoo.hf_moe_global:tp_fsdp_counts_not_reduced --dp 2 --tp 1", 1),
]

#: Megatron-Core's MoE layer (local spec, its all-to-all token dispatcher, top-2 of four
#: experts) in its GPTModel, parallelized and run by Megatron (docs/soundness.md, "Plans
#: traced from PyTorch", 47 and 48)
MEGATRON_MOE = "--model backends.torch.megatron:moe_gpt --recipe backends.torch.megatron:"
CASES += [
    ("moe megatron ep2 tp2 sp etp1 (the experts over the tensor-parallel ranks)",
     f"{MEGATRON_MOE}moe_tp_sp_ep2 --dp 1 --tp 2", 0),
    ("moe megatron ep2 tp2 sp skewed routing (seed 3: experts 0 and 1 take 27 of 32 rows, "
     "rank 0 sends expert 2 no token)", f"{MEGATRON_MOE}moe_tp_sp_ep2 --dp 1 --tp 2 --seed 3", 0),
    ("moe megatron ep2 tp2 sp an expert with no token from each rank (seed 5)",
     f"{MEGATRON_MOE}moe_tp_sp_ep2 --dp 1 --tp 2 --seed 5", 0),
    ("moe megatron ep2 tp2 sp bug rows sorted to the other local expert (rows added back at "
     "other tokens than they came from: soundness 103)",
     f"{MEGATRON_MOE}moe_tp_sp_ep2_sorted_wrong --dp 1 --tp 2", 1),
    ("moe megatron bug ep1 etp1 tp2 expert grads not reduced over the expert-data-parallel "
     "group (Megatron-LM PR 5916, as 0.16.1 ships it)", f"{MEGATRON_MOE}moe_tp_sp_etp1 --dp 1 --tp 2", 1),
    ("moe megatron ep1 etp1 tp2 with PR 5916's fix (experts marked allreduce=False)",
     f"{MEGATRON_MOE}moe_tp_sp_etp1_fixed --dp 1 --tp 2", 0),
    ("moe megatron dp2 ep2 (sequence-first token rows in the ranks' order: soundness 89)",
     f"{MEGATRON_MOE}moe_ep2 --dp 2 --tp 1", 0),
    ("moe megatron dp2 ep2 etp1", f"{MEGATRON_MOE}moe_ep2_etp1 --dp 2 --tp 1", 0),
    ("moe megatron dp2 tp2 sp ep2 etp1 (the [s, b] rows cut by both, in the ranks' order: "
     "soundness 103 (f))", f"{MEGATRON_MOE}moe_tp_sp_ep2 --dp 2 --tp 2 --seqlen 8 --batch 8", 0),
    ("moe megatron dp2 tp2 sp bug ep1 etp1 expert grads reduced over dp only (Megatron-LM PR "
     "5916, as 0.16.1 ships it)", f"{MEGATRON_MOE}moe_tp_sp_etp1 --dp 2 --tp 2 --seqlen 8 --batch 8",
     1),
    # Megatron's clipping (get_grad_norm_fp32 over the model-parallel group, the experts
    # counted once: their weights are tensor-parallel, never tp duplicates) on the MoE step
    ("moe megatron ep2 tp2 sp clip (Megatron's norm over the model-parallel group, experts "
     "counted)", f"{MEGATRON_MOE}moe_tp_sp_ep2 --dp 1 --tp 2 --clip 0.1 "
     "--clipper backends.torch.megatron:clip_grad_norm", 0),
    ("moe megatron dp2 ep2 bug experts reduced over dp (each rank's experts summed with its "
     "peer's)", f"{MEGATRON_MOE}moe_ep2_experts_reduced_over_dp --dp 2 --tp 1", 1),
    ("moe megatron dp2 ep2 bug rows sorted to the other local expert (rows added back at "
     "other tokens than they came from: soundness 103)",
     f"{MEGATRON_MOE}moe_ep2_sorted_wrong --dp 2 --tp 1", 1),
    # Megatron's own groups that are no one mesh axis, read from their members
    # (soundness 113): the expert-data-parallel group of all four ranks
    ("moe megatron dp2 tp2 sp ep1 etp1 with PR 5916's fix (the expert-data-parallel group "
     "is every rank: dp x tp, soundness 113)",
     f"{MEGATRON_MOE}moe_tp_sp_etp1_fixed --dp 2 --tp 2 --seqlen 8 --batch 8", 0),
    ("moe megatron dp2 tp2 sp bug rows sorted to the other local expert (the window at "
     "another rank's copies: soundness 113 (e))",
     f"{MEGATRON_MOE}moe_tp_sp_ep2_sorted_wrong --dp 2 --tp 2 --seqlen 8 --batch 8", 1),
    # Megatron's own optimizer for a MoE (a ChainedOptimizer of its dense and expert parts):
    # its parts' norms' truth values settled as an assumption (soundness 113 (f))
    ("moe megatron dp2 ep2 adamw (Megatron's ChainedOptimizer, a norm's truth value settled: "
     "soundness 113 (f))", f"{MEGATRON_MOE}moe_ep2 --dp 2 --tp 1 --optimizer adamw", 0),
    ("moe megatron dp2 tp2 sp ep2 etp1 adamw (Megatron's ChainedOptimizer)",
     f"{MEGATRON_MOE}moe_tp_sp_ep2 --dp 2 --tp 2 --seqlen 8 --batch 8 --optimizer adamw", 0),
    ("moe megatron ep2 tp2 sp adamw clip (Megatron's ChainedOptimizer after Megatron's "
     "clipping)", f"{MEGATRON_MOE}moe_tp_sp_ep2 --dp 1 --tp 2 --optimizer adamw --clip 0.1 "
     "--clipper backends.torch.megatron:clip_grad_norm", 0),
    ("moe megatron dp2 ep2 adamw bug experts reduced over dp",
     f"{MEGATRON_MOE}moe_ep2_experts_reduced_over_dp --dp 2 --tp 1 --optimizer adamw", 1),
    ("moe megatron dp2 ep2 bug clip norm over the model-parallel group (the other ep rank's "
     "experts left out of the norm)", f"{MEGATRON_MOE}moe_ep2 --dp 2 --tp 1 --clip 0.1 "
     "--clipper backends.torch.megatron:clip_grad_norm", 1),
    # the all-gather token dispatcher (gloo: same): refused, its gather of a token's rows
    # once per local expert it chose repeats a row (not yet lowered on this path)
    ("moe megatron ep2 tp2 sp allgather dispatcher refused (rows gathered at an index that "
     "repeats a row)", "--model backends.torch.zoo.megatron_dispatch:moe_gpt_allgather --recipe "
     "backends.torch.megatron:moe_tp_sp_ep2 --dp 1 --tp 2", 2),
]

#: the sequence split over a "cp" mesh dim (docs/soundness.md, "Plans traced from PyTorch",
#: the sequence split), on models that compute each position on its own; recipes in
#: tests/cp_split_recipes.py, gloo agrees on each (scripts/gloo_truth.py --mesh)
CP = "tests.cp_split_recipes:"
CP_SIZES = "--layers 1 --hidden 8 --seqlen 4 --vocab 10 --batch 2"
CP_POSITIONS = f"--model tests.cp_split_models:position_tagger {CP_SIZES}"
CP_TABLE = f"--model tests.cp_split_models:table_position_tagger {CP_SIZES}"
CP_RING = f"--model tests.cp_models:sdpa_tagger --heads 2 --recipe {CP}"
CP_GQA = f"--model tests.cp_models:sdpa_gqa_tagger --heads 4 --recipe {CP}"
CP_GQA_SIZES = f"{CP_SIZES} --hidden 16"
CASES += [
    ("cp split mlp cp2", f"--model mlp --recipe {CP}cp_sum --mesh cp=2 {CP_SIZES}", 0),
    ("cp split mlp cp4", f"--model mlp --recipe {CP}cp_sum --mesh cp=4 {CP_SIZES} --seqlen 8", 0),
    ("cp split mlp dp2 cp2", f"--model mlp --recipe {CP}cp_sum --mesh dp=2,cp=2 {CP_SIZES}", 0),
    ("cp split mlp cp2 tp2", f"--model mlp --recipe {CP}cp_tp --mesh cp=2,tp=2 {CP_SIZES}", 0),
    ("cp split mlp fsdp2 dp2 cp2",
     f"--model mlp --recipe {CP}cp_fsdp --mesh dp=2,cp=2 {CP_SIZES}", 0),
    ("cp split positions cp2", f"{CP_POSITIONS} --recipe {CP}cp_positions --mesh cp=2", 0),
    ("cp split bug gradients not reduced over cp",
     f"--model mlp --recipe {CP}cp_unreduced --mesh cp=2 {CP_SIZES}", 1),
    ("cp split bug loss averaged over cp and summed over dp (torchtitan 3280)",
     f"--model mlp --recipe {CP}cp_averaged --mesh dp=2,cp=2 {CP_SIZES}", 1),
    ("cp split bug fsdp2 shards not reduced over cp",
     f"--model mlp --recipe {CP}cp_fsdp_unreduced --mesh dp=2,cp=2 {CP_SIZES}", 1),
    ("cp split bug positions not shifted per cp rank",
     f"{CP_POSITIONS} --recipe {CP}cp_positions_unshifted --mesh cp=2", 1),
    ("cp split position table cut along the sequence dp2 cp2",
     f"{CP_TABLE} --recipe {CP}cp_table --mesh dp=2,cp=2", 0),
    ("cp split bug position table's chunk order wrong on one rank",
     f"{CP_TABLE} --recipe {CP}cp_table_other_chunk --mesh cp=2", 1),
    # PyTorch's own ring attention (context_parallel's SDPA dispatcher, through the
    # CPU shim), causal, forward and backward as they ship (docs/soundness.md,
    # "Plans traced from PyTorch", 53)
    ("cp ring allgather cp2", f"{CP_RING}ring_allgather --mesh cp=2 {CP_SIZES}", 0),
    ("cp ring alltoall cp2", f"{CP_RING}ring_alltoall --mesh cp=2 {CP_SIZES}", 0),
    ("cp ring allgather cp4", f"{CP_RING}ring_allgather --mesh cp=4 {CP_SIZES} --seqlen 8", 0),
    ("cp ring alltoall cp4", f"{CP_RING}ring_alltoall --mesh cp=4 {CP_SIZES} --seqlen 8", 0),
    ("cp ring allgather dp2 cp2", f"{CP_RING}ring_allgather --mesh dp=2,cp=2 {CP_SIZES}", 0),
    ("cp ring alltoall cp4 not causal",
     f"--model tests.cp_models:sdpa_encoder --heads 2 --recipe {CP}ring_alltoall --mesh cp=4 "
     f"{CP_SIZES} --seqlen 8", 0),
    ("cp ring bug a block merged with another block's lse",
     f"{CP_RING}ring_other_lse --mesh cp=2 {CP_SIZES}", 1),
    ("cp ring bug the merged lse without its shift (alltoall)",
     f"{CP_RING}ring_lse_unshifted --mesh cp=2 {CP_SIZES}", 1),
    # grouped-query attention (two query heads per key head, enable_gqa): the
    # ring's dk, dv as the gradients of the keys as held (docs/soundness.md,
    # "Plans traced from PyTorch", 107)
    ("cp ring gqa allgather cp2", f"{CP_GQA}ring_allgather --mesh cp=2 {CP_GQA_SIZES}", 0),
    ("cp ring gqa alltoall cp2", f"{CP_GQA}ring_alltoall --mesh cp=2 {CP_GQA_SIZES}", 0),
    ("cp ring gqa bug a block merged with another block's lse",
     f"{CP_GQA}ring_other_lse --mesh cp=2 {CP_GQA_SIZES}", 1),
    # PyTorch's head-tail load balancer: rank r holds chunks r and 2 cp - 1 - r
    # (docs/soundness.md, "Plans traced from PyTorch", 64-67)
    ("cp ring load-balanced allgather cp2",
     f"{CP_RING}ring_balanced --mesh cp=2 {CP_SIZES} --seqlen 8", 0),
    ("cp ring load-balanced alltoall cp2",
     f"{CP_RING}ring_balanced_alltoall --mesh cp=2 {CP_SIZES} --seqlen 8", 0),
    ("cp ring load-balanced allgather cp4",
     f"{CP_RING}ring_balanced --mesh cp=4 {CP_SIZES} --seqlen 8", 0),
    ("cp ring load-balanced alltoall cp4",
     f"{CP_RING}ring_balanced_alltoall --mesh cp=4 {CP_SIZES} --seqlen 8", 0),
    ("cp ring bug the load balancer's chunk order undone wrongly on one rank",
     f"{CP_RING}ring_balanced_wrong_order --mesh cp=2 {CP_SIZES} --seqlen 8", 1),
    # Megatron-LM PR 7498's mechanism on the main loss: the prompt's labels
    # ignored, so that cp rank 0 holds no target; the kept count all-reduced
    ("cp ring no target on rank 0 cp4 (kept labels counted over cp)",
     f"--model tests.cp_models:answer_tagger --heads 2 --recipe {CP}ring_answer --mesh cp=4 "
     f"{CP_SIZES} --seqlen 8", 0),
    ("cp ring bug no target on rank 0 cp4, each rank's loss its own mean (Megatron-LM 7498)",
     f"--model tests.cp_models:answer_tagger_rank_mean --heads 2 --recipe {CP}ring_answer "
     f"--mesh cp=4 {CP_SIZES} --seqlen 8", 1),
]

#: attention sinks under context parallelism (gpt-oss's per-head sink logits; prime-rl
#: PR 3397): the keys and values all-gathered over "cp", the eager sink attention of a
#: rank's query rows (docs/soundness.md, "Plans traced from PyTorch", 92); recipes in
#: tests/cp_sink_recipes.py
SINK = f"--model tests.cp_sink_models:sink_tagger --heads 2 {CP_SIZES} --recipe tests.cp_sink_recipes:"
SINK_RING = SINK.replace("sink_tagger", "sink_flash_tagger")
CASES += [
    ("cp allgather sinks cp2", f"{SINK}sink_allgather --mesh cp=2", 0),
    ("cp allgather sinks cp4", f"{SINK}sink_allgather --mesh cp=4 --seqlen 8", 0),
    ("cp allgather sinks dp2 cp2", f"{SINK}sink_allgather --mesh dp=2,cp=2", 0),
    # the rank's softmax runs over its keys where the single-device one runs over the
    # keys and the sink: claimed to be that softmax, found over other entries
    # (docs/soundness.md, "Plans traced from PyTorch", 101)
    ("cp allgather sinks bug sinks dropped under cp (prime-rl 3397)",
     f"{SINK}sink_allgather_dropped --mesh cp=2", 1),
    ("cp allgather sinks bug sinks dropped under cp4 (prime-rl 3397)",
     f"{SINK}sink_allgather_dropped --mesh cp=4 --seqlen 8", 1),
    # the rank's cat of its chunks of the gathered keys' scores, each with the sink,
    # joins the scores and the sink more often than the single-device cat
    # (docs/soundness.md, "Plans traced from PyTorch", 130)
    ("cp allgather sinks bug the sink entered once per gathered chunk",
     f"{SINK}sink_allgather_per_chunk --mesh cp=2", 1),
    ("cp ring sinks allgather cp2", f"{SINK_RING}sink_ring --mesh cp=2", 0),
    ("cp ring sinks alltoall cp2", f"{SINK_RING}sink_ring_alltoall --mesh cp=2", 0),
    ("cp ring sinks allgather cp4", f"{SINK_RING}sink_ring --mesh cp=4 --seqlen 8", 0),
    ("cp ring sinks allgather dp2 cp2", f"{SINK_RING}sink_ring --mesh dp=2,cp=2", 0),
    ("cp ring sinks bug sinks dropped under cp (prime-rl 3397)",
     f"{SINK_RING}sink_ring_dropped --mesh cp=2", 1),
    ("cp ring sinks bug the sink folded at every ring step (and once after)",
     f"{SINK_RING}sink_ring_every_step --mesh cp=2", 1),
    ("cp ring sinks bug the sink folded at every ring step only cp4",
     f"{SINK_RING}sink_ring_every_step_only --mesh cp=4 --seqlen 8", 1),
    ("cp ring sinks load-balanced allgather cp2",
     f"{SINK_RING}sink_ring_balanced --mesh cp=2 --seqlen 8", 0),
    ("cp ring sinks load-balanced allgather cp4",
     f"{SINK_RING}sink_ring_balanced --mesh cp=4 --seqlen 8", 0),
    # the backward's blocks read halves of the named result: matched past it
    # (docs/soundness.md, "Plans traced from PyTorch", 101)
    ("cp ring sinks bug load-balanced sinks dropped (prime-rl 3397)",
     f"{SINK_RING}sink_ring_balanced_dropped --mesh cp=2 --seqlen 8", 1),
]


#: a document mask under PyTorch's per-document head-tail load balancer: the batch laid
#: out in its order, the keys and values all-gathered over "cp", SDPA with the document
#: mask at the rank's positions (the step context_parallel's flex path computes;
#: docs/soundness.md, "Plans traced from PyTorch", 127); recipes in tests/cp_doc_recipes.py
DOC = ("--model tests.cp_doc_models:doc_tagger --heads 2 --layers 1 --hidden 8 --vocab 10 "
       "--batch 2 --recipe tests.cp_doc_recipes:")
CASES += [
    ("cp document mask per-document balancer cp2", f"{DOC}doc_allgather --mesh cp=2 --seqlen 16",
     0),
    ("cp document mask per-document balancer cp4", f"{DOC}doc_allgather --mesh cp=4 --seqlen 32",
     0),
    ("cp document mask per-document balancer dp2 cp2",
     f"{DOC}doc_allgather --mesh dp=2,cp=2 --seqlen 16", 0),
    ("cp document mask contiguous cp2", f"{DOC}doc_allgather_contiguous --mesh cp=2 --seqlen 16",
     0),
    ("cp document mask bug the mask not shifted per rank",
     f"{DOC}doc_mask_unshifted --mesh cp=2 --seqlen 16", 1),
    ("cp document mask bug the balancer's key order not undone on one rank",
     f"{DOC}doc_keys_unordered --mesh cp=2 --seqlen 16", 1),
]

#: Ulysses-style context parallelism (docs/soundness.md, "Plans traced from PyTorch",
#: all-to-alls of views): the sequence cut over "cp", all-to-alls to the heads and back as
#: DeepSpeed (all_to_all_single) and VeOmni (all_to_all of pieces) write them; models in
#: tests/cp_ulysses_models.py, recipes in tests/cp_ulysses_recipes.py; gloo agrees on each
ULY = "tests.cp_ulysses_recipes:"
ULY_SIZES = "--layers 1 --hidden 8 --heads 4 --seqlen 8 --vocab 10 --batch 2"
ULY_MODEL = f"--model tests.cp_ulysses_models:ulysses_tagger {ULY_SIZES}"
ULY_ONE_HEAD = "--layers 1 --hidden 8 --heads 2 --seqlen 8 --vocab 10 --batch 2 --mesh cp=2"
CP_MOE = "--vocab 2048 --layers 1 --seqlen 8 --batch 2 --mesh cp=2"
CP_MOE_DP = CP_MOE.replace("--batch 2 --mesh cp=2", "--batch 4 --mesh dp=2,cp=2")
CASES += [
    ("cp ulysses cp2 causal (DeepSpeed's all_to_all_single)",
     f"{ULY_MODEL} --recipe {ULY}ulysses --mesh cp=2", 0),
    ("cp ulysses cp4 causal", f"{ULY_MODEL} --recipe {ULY}ulysses --mesh cp=4", 0),
    ("cp ulysses cp2 all_to_all_single_autograd (the functional collective)",
     f"{ULY_MODEL} --recipe {ULY}ulysses_functional --mesh cp=2", 0),
    ("cp ulysses cp2 all_to_all of pieces (VeOmni's)",
     f"{ULY_MODEL} --recipe {ULY}ulysses_list --mesh cp=2", 0),
    ("cp ulysses cp2 [seq, batch, heads, dim]",
     f"--model tests.cp_ulysses_models:ulysses_tagger_sbhd {ULY_SIZES} --recipe {ULY}ulysses "
     "--mesh cp=2", 0),
    ("cp ulysses cp2 tp2", f"{ULY_MODEL} --recipe {ULY}ulysses_tp --mesh cp=2,tp=2", 0),
    ("cp ulysses fsdp2 dp2 cp2", f"{ULY_MODEL} --recipe {ULY}ulysses_fsdp --mesh dp=2,cp=2", 0),
    ("cp ulysses dp2 cp2 full attention",
     f"--model tests.cp_ulysses_models:ulysses_tagger_full {ULY_SIZES} --recipe {ULY}ulysses "
     "--mesh dp=2,cp=2", 0),
    # one head per rank (heads == cp): the rank's attention on [b, 1, s, d]
    ("cp ulysses cp2 one head per rank",
     f"--model tests.cp_ulysses_models:ulysses_tagger {ULY_ONE_HEAD} --recipe {ULY}ulysses", 0),
    ("cp ulysses bug cp2 one head per rank inverse all-to-all's head groups in the wrong order",
     f"--model tests.cp_ulysses_models:ulysses_tagger {ULY_ONE_HEAD} "
     f"--recipe {ULY}ulysses_wrong_order", 1),
    # with sinks the eager attention's fold of [b, 1, s, s] is refused (correct code: gloo same)
    ("cp ulysses cp2 one head per rank with sinks refused (the fold of a size-1 head dim)",
     f"--model tests.cp_ulysses_models:ulysses_sink_tagger {ULY_ONE_HEAD} "
     f"--recipe {ULY}ulysses_sinks", 2),
    ("cp ulysses bug heads and sequence swapped in the all-to-all's split",
     f"{ULY_MODEL} --recipe {ULY}ulysses_swapped --mesh cp=2", 1),
    ("cp ulysses bug inverse all-to-all's head groups in the wrong order",
     f"{ULY_MODEL} --recipe {ULY}ulysses_wrong_order --mesh cp=2", 1),
    ("cp ulysses bug inverse all_to_all of pieces in the wrong order",
     f"{ULY_MODEL} --recipe {ULY}ulysses_list_wrong_order --mesh cp=2", 1),
    ("cp ulysses bug loss averaged over cp and summed over dp (torchtitan 3280)",
     f"{ULY_MODEL} --recipe {ULY}ulysses_averaged --mesh dp=2,cp=2", 1),
    ("cp ulysses bug positions not shifted per cp rank",
     f"{ULY_MODEL} --recipe {ULY}ulysses_unshifted --mesh cp=2", 1),
    ("cp ulysses pp2 cp2 (GPipe, a Ulysses block per stage)",
     f"--model tests.cp_ulysses_models:ulysses_stack {ULY_SIZES.replace('--layers 1', '--layers 2')} "
     f"--recipe {ULY}ulysses_pp --mesh pp=2,cp=2", 0),
    ("cp ulysses bug pp2 cp2 positions not shifted per cp rank",
     f"--model tests.cp_ulysses_models:ulysses_stack {ULY_SIZES.replace('--layers 1', '--layers 2')} "
     f"--recipe {ULY}ulysses_pp_unshifted --mesh pp=2,cp=2", 1),
    # attention sinks under Ulysses: each rank the sinks of its head group, a split at its
    # cp index (docs/soundness.md, "Plans traced from PyTorch", 101)
    ("cp ulysses sinks cp2",
     f"--model tests.cp_ulysses_models:ulysses_sink_tagger {ULY_SIZES} --recipe {ULY}ulysses_sinks "
     "--mesh cp=2", 0),
    ("cp ulysses sinks dp2 cp2",
     f"--model tests.cp_ulysses_models:ulysses_sink_tagger {ULY_SIZES} --recipe {ULY}ulysses_sinks "
     "--mesh dp=2,cp=2", 0),
    ("cp ulysses sinks bug sinks dropped (prime-rl 3397)",
     f"--model tests.cp_ulysses_models:ulysses_sink_tagger {ULY_SIZES} "
     f"--recipe {ULY}ulysses_sinks_dropped --mesh cp=2", 1),
    # a split of the whole sinks at another index than the rank's cp index: claimed
    # as that piece (``split2`` at its index, docs/soundness.md, "Plans traced from
    # PyTorch", 130 (b)), refuted; gloo differs
    ("cp ulysses sinks bug every rank reads the first head group's sinks",
     f"--model tests.cp_ulysses_models:ulysses_sink_tagger {ULY_SIZES} "
     f"--recipe {ULY}ulysses_sinks_first_group --mesh cp=2", 1),
    ("cp ulysses sinks bug every rank reads the first head group's sinks dp2 cp2",
     f"--model tests.cp_ulysses_models:ulysses_sink_tagger {ULY_SIZES} "
     f"--recipe {ULY}ulysses_sinks_first_group --mesh dp=2,cp=2", 1),
    # torchtitan's own CP (backends/torch/zoo/titan.py, parallelize_cp): every rank traced
    # through the step, CP's ring on the CPU (cp_shim), the rotary table gathered at the
    # rank's positions read as its one row (docs/soundness.md, "Plans traced from PyTorch",
    # 55); gloo agrees on each (scripts/gloo_truth.py --rtol 1e-6: CP merges in float32)
    ("cp titan llama3 debugmodel cp2",
     "--model backends.torch.titan:llama3_debugmodel --recipe backends.torch.titan:parallelize_cp "
     "--vocab 2048 --seqlen 8 --batch 2 --mesh cp=2", 0),
    ("cp titan llama3 debugmodel dp2 cp2 (FSDP2 over dp x cp)",
     "--model backends.torch.titan:llama3_debugmodel --recipe backends.torch.titan:parallelize_cp "
     "--vocab 2048 --seqlen 8 --batch 4 --mesh dp=2,cp=2", 0),
    ("cp titan bug llama3 debugmodel cp2 positions of the next chunk",
     "--model backends.torch.titan:llama3_debugmodel "
     "--recipe backends.torch.titan:parallelize_cp_other_chunk "
     "--vocab 2048 --seqlen 8 --batch 2 --mesh cp=2", 1),
    # with tp beside cp torchtitan views the positions as a DTensor first
    # (``_maybe_wrap_positions``): still constants (item 82), so the table is
    # gathered at constant positions as at cp2; gloo agrees (--rtol 1e-6)
    ("cp titan llama3 debugmodel tp2 cp2",
     "--model backends.torch.titan:llama3_debugmodel --recipe backends.torch.titan:parallelize_cp "
     "--vocab 2048 --seqlen 8 --batch 2 --mesh cp=2,tp=2", 0),
    ("cp titan llama3 debugmodel dp2 tp2 cp2 (FSDP2 over dp x cp, 8 ranks)",
     "--model backends.torch.titan:llama3_debugmodel --recipe backends.torch.titan:parallelize_cp "
     "--vocab 2048 --seqlen 8 --batch 4 --mesh dp=2,cp=2,tp=2", 0),
    ("cp titan bug llama3 debugmodel tp2 cp2 positions of the next chunk",
     "--model backends.torch.titan:llama3_debugmodel "
     "--recipe backends.torch.titan:parallelize_cp_other_chunk "
     "--vocab 2048 --seqlen 8 --batch 2 --mesh cp=2,tp=2", 1),
    ("cp titan bug llama3 debugmodel tp2 cp2 positions not shifted per cp rank",
     "--model backends.torch.titan:llama3_debugmodel "
     "--recipe backends.torch.titan:parallelize_cp_unshifted "
     "--vocab 2048 --seqlen 8 --batch 2 --mesh cp=2,tp=2", 1),
    # Qwen3 MoE (grouped-query attention, routed experts) under torchtitan's CP,
    # its step given the data loader's positions (item 107): its token rows
    # (the batch, the rank's chunk of the positions) written in the ranks'
    # order (item 115; a false FAIL at the experts' count before); gloo same
    # at bfloat16's tolerance (its experts' grouped GEMM), as every titan MoE case
    ("cp titan qwen3_moe cp2",
     f"--model titan:qwen3_moe_positions --recipe titan:parallelize_cp {CP_MOE}", 0),
    # with torchtitan's load-balancing hook: the counts summed over its "loss" mesh
    # (dp x cp); a bug: not summed, each cp rank's bias moved by its own chunk's counts
    ("cp titan qwen3_moe cp2 bug routed to other token on the last cp rank",
     f"--model titan:qwen3_moe_positions --recipe harness.moe_bugs:titan_cp_routed_to_other_token "
     f"{CP_MOE}", 1),
    # dp 2 x cp 2 (each rank 2 rows x 4 positions): its routing constant of the rank's
    # (token, slot) pairs cut by dp x cp along dims past the batch (docs/soundness.md,
    # "Plans traced from PyTorch", 132); gloo same at bfloat16's tolerance, differs on
    # both bugs: the gradients averaged over cp as well (torchtitan 3280's loss
    # aggregated over two axes), the last cp rank's tokens routed to each other's experts
    ("cp titan qwen3_moe dp2 cp2",
     f"--model titan:qwen3_moe_positions --recipe titan:parallelize_cp {CP_MOE_DP}", 0),
    ("cp titan qwen3_moe dp2 cp2 bug gradients averaged over cp too (torchtitan 3280)",
     f"--model titan:qwen3_moe_positions --recipe harness.moe_bugs:titan_cp_grads_averaged_over_cp "
     f"{CP_MOE_DP}", 1),
    ("cp titan qwen3_moe dp2 cp2 bug routed to other token on the last cp rank",
     f"--model titan:qwen3_moe_positions --recipe harness.moe_bugs:titan_cp_routed_to_other_token "
     f"{CP_MOE_DP}", 1),
    ("cp titan qwen3_moe bias cp2",
     f"--model {BALANCE}qwen3_moe_positions --recipe {BALANCE}parallelize_cp "
     f"{CP_MOE} --optimizer sgd", 0),
    ("cp titan qwen3_moe bias cp2 bug counts not all-reduced over cp",
     f"--model {BALANCE}qwen3_moe_positions --recipe {BALANCE}parallelize_cp_counts_not_reduced "
     f"{CP_MOE} --optimizer sgd", 1),
]

def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def single_key(args: argparse.Namespace) -> tuple:
    """What the single-device trace depends on: the model and sizes, the
    optimizer, the clipping, and a clipper that runs on one device too
    (``one_device``: Megatron's)."""
    clipper = getattr(args, "clipper", None)
    one_device = clipper if clipper and getattr(load(clipper), "one_device", False) else None
    return (args.model, args.layers, args.hidden, args.heads, args.ffn, args.vocab, args.seqlen,
            args.batch, args.seed, args.optimizer, args.clip, one_device)


def run_case(argv: str, singles: dict) -> tuple[int, str]:
    """The exit code ``python -m backends.torch`` then ``main.py`` would give,
    and the first line of the reason when it is not 0."""
    try:
        args = resolve(backend_parser().parse_args(shlex.split(argv)))
    except LoweringError as e:
        return 2, str(e)
    key = single_key(args)
    try:
        (plan_s, plan_p), singles[key] = trace_and_build(args, singles.get(key))
    except WrongStep as e:
        return 1, str(e)
    except LoweringError as e:
        return 2, str(e)
    except LoadedValueMismatch as e:
        return 1, str(e)
    verdict = verify(plan_s, plan_p)
    if verdict.success:
        return 0, ""
    first = verdict.message.splitlines()[0] if verdict.message else ""
    if verdict.kind == "stage":  # a failing stage: its diagnosis in the model's names
        lead = diagnose(verdict, plan_s, plan_p)
        first = lead[0] if lead else first
    return (3 if verdict.kind == "internal" else 1), first


def shard_spec(text: str) -> tuple[int, int]:
    """``I/N`` of ``--shard``: the I-th of N shards, 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{text!r}: I must be in 0 .. N-1")
    return index, count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", action="append", default=[], help="run the cases whose name contains this")
    ap.add_argument("--exact", action="append", default=[],
                    help="run the case of exactly this name (with -k: either selects)")
    ap.add_argument("--shard", type=shard_spec, default=(0, 1), metavar="I/N",
                    help="of the selected cases, run every N-th from the I-th (0-based): "
                         "N processes with 0/N .. N-1/N run them all once")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    opts = ap.parse_args(argv)
    picked = opts.k or opts.exact
    cases = [c for c in CASES
             if not picked or c[0] in opts.exact or any(k in c[0] for k in opts.k)]
    index, count = opts.shard
    cases = cases[index::count]
    if opts.list:
        for name, args, expected in cases:
            print(f"{name:40s} exit {expected}  {args}")
        return 0
    warnings.filterwarnings("ignore")
    singles: dict = {}
    good = 0
    width = max((len(c[0]) for c in cases), default=10)
    for name, args, expected in cases:
        t0, c0 = time.perf_counter(), cpu_seconds()
        try:
            got, why = run_case(args, singles)
        except Exception as e:  # any failure is reported as no verdict, never as a verdict
            got, why = 3, f"{type(e).__name__}: {e}"
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        good += got == expected
        mark = "ok " if got == expected else "BAD"
        note = f"  {why}" if why and got != expected else ""
        print(f"{mark} {name:{width}s}  expected {expected}  got {got}  {wall:6.1f} s  "
              f"cpu {cpu:6.1f} s{note}", flush=True)
    print(f"torch suite: {good} of {len(cases)} as expected")
    return 0 if good == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
