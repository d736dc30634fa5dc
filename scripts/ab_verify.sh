#!/usr/bin/env bash
# Verification time of one plan pair at two commits, runs alternated so both
# see the same machine load: CPU (user) and wall seconds of each run.
#
#   bash scripts/ab_verify.sh [OLD_REV] [RUNS]     # default ac11374, 3 runs each
#
# Each side (OLD_REV in a temporary git worktree, and this checkout)
# generates the bug-suite base pair (llama3 ly32 h32 hi128 sq8192 gbs32, and
# dp2 pp2 tp2 nm2) with its own generator, since plan files and the model's
# loss may differ between commits, then verifies it with its own main.py,
# --max_vrf_proc 1, no caches. Needs /usr/bin/time.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:-ac11374}
RUNS=${2:-3}
PY=$PWD/.venv/bin/python
WORK=$(mktemp -d)
trap 'git worktree remove --force "$WORK/old" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add -q --detach "$WORK/old" "$OLD"
SIZE="--model llama3 --layers 32 --heads 32 --hidden 128 --seqlen 8192 --gbs 32"
for side in old new; do
    dir=$PWD
    [ "$side" = old ] && dir=$WORK/old
    # shellcheck disable=SC2086
    (cd "$dir" && "$PY" -m gen_model $SIZE -o "$WORK/$side" >/dev/null \
        && "$PY" -m gen_model $SIZE --dp 2 --pp 2 --tp 2 --nm 2 -o "$WORK/$side" >/dev/null)
done
for i in $(seq "$RUNS"); do
    for side in old new; do
        dir=$PWD
        [ "$side" = old ] && dir=$WORK/old
        sm=$(ls "$WORK/$side"/*_dp1_pp1_tp1_nm1_*.pkl)
        pm=$(ls "$WORK/$side"/*_dp2_pp2_tp2_nm2_*.pkl)
        (cd "$dir" && /usr/bin/time -f "$side run $i: user %U s, wall %e s, exit %x" "$PY" main.py \
            --sm "$sm" --pm "$pm" --max_vrf_proc 1 --no_cache_nodes --no_cache_stages \
            --stats_dir "$WORK/stats" --log_dir "$WORK/logs" 2>&1 >/dev/null | tail -n 1)
    done
done
