#!/usr/bin/env bash
# DeepSeek-V3-style 671B MoE at dp32 tp8 pp8 nm16 (paper §8.1): 61 layers (3 dense), 128 heads, hidden 7168, 256 routed experts top-8 of size 2048, one shared, dense ffn 18432, vocab 129280. Multi-head latent attention is expressed as grouped attention with 128 KV heads.
# Generates the single-device and the parallel plan, verifies them
# (scripts/run_point.py: wall time and peak memory of each step, killed past
# TIMEOUT seconds or MEM_GB of resident memory), appends a row to
# data/stats/large.csv and main.py's Stats row to data/stats/stats.csv.
# docs/benchmarks.md holds the figures and what the generator cannot express.
# By default the parallel plan is folded (2 replicas and 2 microbatches shown,
# docs/soundness.md "Folded plans"); FOLD=0 generates every rank as a columnar
# file (gen_model --format npz, by array arithmetic) and verifies that.
#
#   bash scripts/run_large_moe_671B.sh      # PY, TIMEOUT (1800), MEM_GB (16) may be set
set -eu
fold=$([ "${FOLD:-1}" = 1 ] && echo " --fold" || true)  # folded plan (docs/soundness.md); FOLD=0: every rank
npz=$([ "${FOLD:-1}" = 1 ] || echo "--npz")  # a materialized plan goes through the columnar file
cd "$(dirname "$0")/.."
exec nice "${PY:-.venv/bin/python}" scripts/run_point.py --name moe_671B --csv data/stats/large.csv \
    --model "--model moe --layers 61 --first_dense 3 --heads 128 --kv_heads 128 --hidden 7168 --ffn 18432 --moe_ffn 2048 --experts 256 --topk 8 --vocab 129280 --seqlen 4096" \
    --par "--dp 32 --tp 8 --pp 8 --nm 16$fold" --gbs 512 \
    --timeout "${TIMEOUT:-1800}" --mem_gb "${MEM_GB:-16}" $npz "$@"
