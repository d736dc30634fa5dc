#!/usr/bin/env bash
# Llama3-8B at dp512 (paper §8.1): 32 layers, 32 heads, 8 KV heads, hidden 4096, ffn 14336, vocab 128256.
# Generates the single-device and the parallel plan, verifies them
# (scripts/run_point.py: wall time and peak memory of each step, killed past
# TIMEOUT seconds or MEM_GB of resident memory), appends a row to
# data/stats/large.csv and main.py's Stats row to data/stats/stats.csv.
# docs/benchmarks.md holds the figures and what the generator cannot express.
# By default the parallel plan is folded (2 replicas and 2 microbatches shown,
# docs/soundness.md "Folded plans"); FOLD=0 generates every rank as a columnar
# file (gen_model --format npz, by array arithmetic) and verifies that.
#
#   bash scripts/run_large_llama3_8B.sh      # PY, TIMEOUT (1800), MEM_GB (16) may be set
set -eu
fold=$([ "${FOLD:-1}" = 1 ] && echo " --fold" || true)  # folded plan (docs/soundness.md); FOLD=0: every rank
npz=$([ "${FOLD:-1}" = 1 ] || echo "--npz")  # a materialized plan goes through the columnar file
cd "$(dirname "$0")/.."
exec nice "${PY:-.venv/bin/python}" scripts/run_point.py --name llama3_8B --csv data/stats/large.csv \
    --model "--model llama3 --layers 32 --heads 32 --kv_heads 8 --hidden 4096 --ffn 14336 --vocab 128256 --seqlen 8192" \
    --par "--dp 512$fold" --gbs 512 \
    --timeout "${TIMEOUT:-1800}" --mem_gb "${MEM_GB:-16}" $npz "$@"
