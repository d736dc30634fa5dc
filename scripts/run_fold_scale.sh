#!/usr/bin/env bash
# Issue 9's targets for folded plans: verification at dp512 against dp8, and
# nm32 against nm2, of one model (llama3, 32 layers, hidden 128, seqlen 128,
# vocab 1024), each folded (2 replicas and 2 microbatches shown,
# docs/soundness.md "Folded plans") and, for dp8 and nm2, unfolded too.
# Rows go to data/stats/fold.csv (scripts/run_point.py).
#
#   bash scripts/run_fold_scale.sh      # PY, TIMEOUT (900), MEM_GB (8) may be set
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL="--model llama3 --layers 32 --heads 4 --kv_heads 2 --hidden 128 --vocab 1024 --seqlen 128"

point() {  # name gbs par
    nice "$PY" scripts/run_point.py --name "$1" --csv data/stats/fold.csv --gbs "$2" \
        --model "$MODEL" --par "$3" --timeout "${TIMEOUT:-900}" --mem_gb "${MEM_GB:-8}"
}

point fold_dp8 8 "--dp 8 --fold"
point fold_dp512 512 "--dp 512 --fold"
point fold_nm2 8 "--dp 2 --pp 2 --tp 2 --nm 2 --fold"
point fold_nm32 128 "--dp 2 --pp 2 --tp 2 --nm 32 --fold"
point unfolded_dp8 8 "--dp 8"
point unfolded_nm2 8 "--dp 2 --pp 2 --tp 2 --nm 2"
