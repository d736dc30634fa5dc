#!/usr/bin/env bash
# An expert-parallel materialized plan (every rank and microbatch in the file)
# verified in full before this checkout proved EP plans by symmetry, and by
# its checked symmetry after (docs/soundness.md "Expert parallelism: the ep
# ranks inside a block"). The model has DeepSeek-16B's shapes (hidden 2048,
# 16 heads, 64 routed experts top-6 of size 1408, one shared expert, dense
# ffn 10944, vocab 102400, seqlen 4096) on LAYERS layers (default 4: the
# first dense, the others MoE), at dp DP with ep EP and NM microbatches, one
# row per rank and microbatch.
#
#   BEFORE=/path/to/other/checkout bash scripts/run_ep_bench.sh
#   # PY, LAYERS (4), DP (32), EP (4), NM (2), OUT (data/plans/ep_bench) may be set
#
# Prints, for each checkout, wall and CPU seconds and peak resident memory
# (GNU time: the largest process) and its symmetry line; main.py's Stats rows
# go to OUT/stats_before and OUT/stats_after, not into either checkout.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LAYERS=${LAYERS:-4} DP=${DP:-32} EP=${EP:-4} NM=${NM:-2}
OUT=${OUT:-data/plans/ep_bench}
MODEL="--model moe --layers $LAYERS --first_dense 1 --heads 16 --kv_heads 16 --hidden 2048
       --ffn 10944 --moe_ffn 1408 --experts 64 --topk 6 --vocab 102400 --seqlen 4096"
GBS=$((DP * NM))
mkdir -p "$OUT"
if ! ls "$OUT"/*_dp1_pp1_tp1_nm1_*.pkl > /dev/null 2>&1; then
    # shellcheck disable=SC2086
    /usr/bin/time -f "generate single: %e s wall, %U+%S s CPU, %M KiB peak" \
        nice "$PY" -m gen_model $MODEL --gbs "$GBS" -o "$OUT"
fi
if ! ls "$OUT"/*.npz > /dev/null 2>&1; then
    # shellcheck disable=SC2086
    /usr/bin/time -f "generate parallel: %e s wall, %U+%S s CPU, %M KiB peak" \
        nice "$PY" -m gen_model $MODEL --gbs "$GBS" --dp "$DP" --ep "$EP" --nm "$NM" \
        --format npz -o "$OUT"
fi
sm=$(realpath "$(ls "$OUT"/*_dp1_pp1_tp1_nm1_*.pkl)")
pm=$(realpath "$(ls "$OUT"/*.npz)")
for side in ${BEFORE:+before} after; do
    dir=$PWD
    [ "$side" = before ] && dir=$BEFORE
    log=$(realpath "$OUT")/verify_$side.log
    ( cd "$dir" && /usr/bin/time -f "verify $side: %e s wall, %U+%S s CPU, %M KiB peak" \
        nice "$PY" main.py --sm "$sm" --pm "$pm" --no_cache_nodes --no_cache_stages \
        --stats_dir "$(realpath "$OUT")/stats_$side" > "$log" 2>&1 ) || true
    tail -1 "$log"
    echo "verify $side: $(grep -m1 -i 'symmetry\|verified in full' "$log" || true)"
done
