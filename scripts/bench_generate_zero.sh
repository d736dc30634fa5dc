#!/usr/bin/env bash
# Generation cost of materialized ZeRO plans (every rank in a columnar .npz):
# the sweep's llama3 (32 layers, hidden 128: Llama3-8B node counts) with
# --zero 1 and --zero 3 at dp 64 and dp 128, one gen_model process each under
# /usr/bin/time (wall, CPU, peak RSS), then the file's size. Run it from a
# checkout; CHECKOUT=DIR times another one (a commit before the array
# generator wrote ZeRO plans, say) with the same interpreter. Plans go to a
# temporary directory, removed at the end.
#
#   bash scripts/bench_generate_zero.sh    # PY, CHECKOUT may be set
set -euo pipefail
PY=${PY:-.venv/bin/python}
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute, the venv's link kept
cd "${CHECKOUT:-$(dirname "$0")/..}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for zero in 1 3; do
    for dp in 64 128; do
        /usr/bin/time -f "zero$zero dp$dp: %e s wall, %U+%S s CPU, %M KiB peak" nice "$PY" -m gen_model \
            --model llama3 --layers 32 --heads 4 --kv_heads 2 --hidden 128 --vocab 1024 --seqlen 128 \
            --gbs "$dp" --dp "$dp" --zero "$zero" --format npz -o "$out/z${zero}_dp$dp" 2>&1 | grep -v '^wrote .*json'
        echo "zero$zero dp$dp: file $(stat -c %s "$out/z${zero}_dp$dp"/*.npz) bytes"
    done
done
