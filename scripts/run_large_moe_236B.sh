#!/usr/bin/env bash
# DeepSeek-style 236B MoE at dp16 tp8 pp4 nm16 (paper §8.1): 60 layers (the first dense), 128 heads, hidden 5120, 160 routed experts top-6 of size 1536, dense ffn 12288, vocab 102400. The generator has one shared expert (the model has two) and grouped attention instead of multi-head latent attention.
# Generates the single-device and the parallel plan, verifies them
# (scripts/run_point.py: wall time and peak memory of each step, killed past
# TIMEOUT seconds or MEM_GB of resident memory), appends a row to
# data/stats/large.csv and main.py's Stats row to data/stats/stats.csv.
# docs/benchmarks.md holds the figures and what the generator cannot express.
# By default the parallel plan is folded (2 replicas and 2 microbatches shown,
# docs/soundness.md "Folded plans"); FOLD=0 generates every rank as a columnar
# file (gen_model --format npz, by array arithmetic) and verifies that.
#
#   bash scripts/run_large_moe_236B.sh      # PY, TIMEOUT (1800), MEM_GB (16) may be set
set -eu
fold=$([ "${FOLD:-1}" = 1 ] && echo " --fold" || true)  # folded plan (docs/soundness.md); FOLD=0: every rank
npz=$([ "${FOLD:-1}" = 1 ] || echo "--npz")  # a materialized plan goes through the columnar file
cd "$(dirname "$0")/.."
exec nice "${PY:-.venv/bin/python}" scripts/run_point.py --name moe_236B --csv data/stats/large.csv \
    --model "--model moe --layers 60 --first_dense 1 --heads 128 --kv_heads 128 --hidden 5120 --ffn 12288 --moe_ffn 1536 --experts 160 --topk 6 --vocab 102400 --seqlen 4096" \
    --par "--dp 16 --tp 8 --pp 4 --nm 16$fold" --gbs 256 \
    --timeout "${TIMEOUT:-1800}" --mem_gb "${MEM_GB:-16}" $npz "$@"
