#!/usr/bin/env bash
# Materialized plans (every rank and microbatch in the file) verified by
# their checked symmetry (docs/soundness.md "Materialized plans"): the dp and
# nm points of the sweep, materialized, and one wrong replica at dp512 (wrong
# rows: a layout finding; another operator: a replica class of its own).
# The model is the sweep's llama3 (32 layers, hidden 128): node counts equal
# Llama3-8B's at the same parallelism (shape reduction makes the verifier's
# work independent of the hidden size). Each parallel plan is generated as a
# columnar file (gen_model --format npz: by array arithmetic above 3
# replicas) and verified from it; wall and CPU seconds and peak memory per
# step go to data/stats/symmetry.csv (scripts/run_point.py).
#
#   bash scripts/run_symmetry_bench.sh [POINT...]   # PY, TIMEOUT (1800), MEM_GB (16) may be set
#   POINT: dp8 dp64 dp512 nm2 nm32 wrong512 zero8 zero64 zero128 zero2_64 zero3_64
#   zero2_128 zero3_128 (default: all; the zero points are ZeRO-1, zeroK_N ZeRO-K at dp N,
#   whose columns gen_model expands from dp 2 and 4
#   (gen_model/replicate.py); hidden 128 splits into at most
#   128 shards; zero64 and zero128 are kept
#   in data/plans/points for a comparison run)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL="--model llama3 --layers 32 --heads 4 --kv_heads 2 --hidden 128 --vocab 1024 --seqlen 128"
CSV=data/stats/symmetry.csv

point() {  # name gbs par [run_point flags]
    nice "$PY" scripts/run_point.py --name "$1" --csv "$CSV" --gbs "$2" --model "$MODEL" \
        --par "$3" --npz --timeout "${TIMEOUT:-1800}" --mem_gb "${MEM_GB:-16}" "${@:4}"
}

wrong512() {  # replica 3 loads replica 2's rows, then runs another operator, in the dp512 plan
    local dir=data/plans/points/mat_dp512
    mkdir -p data/logs/points
    local sm pm
    sm=$(ls "$dir"/*_dp1_pp1_tp1_nm1_*.pkl) || { echo "wrong512 needs the dp512 point first"; return 1; }
    pm=$(ls "$dir"/*.npz | grep -v wrong.npz)
    for variant in rows op; do
        local flag=""
        [ "$variant" = op ] && flag="--op"
        /usr/bin/time -f "wrong512 $variant: mutate %e s wall, %U+%S s CPU, %M KiB peak" \
            nice "$PY" scripts/wrong_replica.py "$pm" "$dir/wrong.npz" --replica 3 $flag
        /usr/bin/time -f "wrong512 $variant: verify %e s wall, %U+%S s CPU, %M KiB peak" \
            nice "$PY" main.py --sm "$sm" --pm "$dir/wrong.npz" --no_cache_nodes \
            --no_cache_stages --stats_dir data/stats > "data/logs/points/wrong512_$variant.verify.log" 2>&1
        echo "wrong512 $variant: exit $? (1 expected): $(grep -m1 -o 'FAILED in its own cut: replica [0-9]* x [^(]*\|not equivalent.*' "data/logs/points/wrong512_$variant.verify.log")"
        tail -1 "data/logs/points/wrong512_$variant.verify.log"
    done
    rm -rf "$dir"
}

for p in "${@:-dp8 dp64 dp512 nm2 nm32 wrong512 zero8 zero64 zero128 zero2_64 zero3_64 zero2_128 zero3_128}"; do
    for q in $p; do
        case $q in
            dp8) point mat_dp8 8 "--dp 8" ;;
            dp64) point mat_dp64 64 "--dp 64" ;;
            dp512) point mat_dp512 512 "--dp 512" --keep ;;
            nm2) point mat_nm2 8 "--dp 2 --pp 2 --tp 2 --nm 2" ;;
            nm32) point mat_nm32 128 "--dp 2 --pp 2 --tp 2 --nm 32" ;;
            zero8) point mat_zero1_dp8 8 "--dp 8 --zero 1" ;;
            zero64) point mat_zero1_dp64 64 "--dp 64 --zero 1" --keep ;;
            zero128) point mat_zero1_dp128 128 "--dp 128 --zero 1" --keep ;;
            zero[23]_64|zero[23]_128)
                z=${q:4:1} n=${q#*_}
                point "mat_zero${z}_dp$n" "$n" "--dp $n --zero $z" --keep ;;
            wrong512) wrong512 ;;
            *) echo "unknown point $q" >&2; exit 2 ;;
        esac
    done
done
