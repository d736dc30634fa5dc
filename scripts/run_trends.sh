#!/usr/bin/env bash
# The scalability sweep (paper §8.2): about 36 runs around Llama3-8B's shapes
# (32 layers, 32 heads, 8 KV heads, hidden 4096, ffn 14336, vocab 128256,
# seqlen 8192) at dp2 tp2 pp2 nm2, varying one factor at a time: layers, dp,
# tp, pp, nm, hidden size and sequence length. Each point runs
# scripts/run_point.py (generate, verify, wall time and peak memory of each
# step) and appends a row to data/stats/trends.csv; scripts/draw.py plots
# them to data/figs/. gbs is dp * nm (one sample per replica and microbatch).
#
#   bash scripts/run_trends.sh [FACTOR ...]   # e.g. "dp nm"; default: all
#   PY, TIMEOUT (600 per step), MEM_GB (8), CSV may be set. By default every
#   point is materialized (every rank and microbatch, written as a columnar
#   file by gen_model --format npz and proved by its checked symmetry);
#   FOLD=1 generates folded plans instead (2 replicas and 2 microbatches
#   shown, the rest assumed: docs/soundness.md "Folded plans")
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CSV=${CSV:-data/stats/trends.csv}
FACTORS=${*:-layers dp tp pp nm hidden seqlen}

point() {  # factor value layers hidden seqlen dp tp pp nm
    local factor=$1 value=$2 ly=$3 hi=$4 sq=$5 dp=$6 tp=$7 pp=$8 nm=$9 fold="" npz=--npz
    if [ "${FOLD:-0}" = 1 ]; then
        npz=""
        if [ $((dp * nm)) -gt 1 ]; then fold=" --fold"; fi
    fi
    nice "$PY" scripts/run_point.py --name "trend_${factor}_${value}" --csv "$CSV" \
        --factor "$factor" --value "$value" --gbs $((dp * nm)) \
        --model "--model llama3 --layers $ly --heads 32 --kv_heads 8 --hidden $hi --ffn $((hi * 7 / 2)) --vocab 128256 --seqlen $sq" \
        --par "--dp $dp --tp $tp --pp $pp --nm $nm$fold" \
        --timeout "${TIMEOUT:-600}" --mem_gb "${MEM_GB:-8}" $npz
}

for factor in $FACTORS; do
    case $factor in
        layers) for v in 4 8 16 32 64; do point layers "$v" "$v" 4096 8192 2 2 2 2; done ;;
        dp) for v in 1 2 4 8 16 32 64 128 256 512; do point dp "$v" 32 4096 8192 "$v" 2 2 2; done ;;
        tp) for v in 1 2 4 8; do point tp "$v" 32 4096 8192 2 "$v" 2 2; done ;;
        pp) for v in 1 2 4 8; do point pp "$v" 32 4096 8192 2 2 "$v" 2; done ;;
        nm) for v in 1 2 4 8 16 32; do point nm "$v" 32 4096 8192 2 2 2 "$v"; done ;;
        hidden) for v in 1024 2048 4096 8192 16384; do point hidden "$v" 32 "$v" 8192 2 2 2 2; done ;;
        seqlen) for v in 128 512 2048 8192 32768; do point seqlen "$v" 32 4096 "$v" 2 2 2 2; done ;;
        *) echo "unknown factor $factor (layers dp tp pp nm hidden seqlen)" >&2; exit 2 ;;
    esac
done
