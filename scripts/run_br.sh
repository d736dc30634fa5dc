#!/usr/bin/env bash
# Bug reproduction (paper §8.3): the 14 buggy llama3 plans of docs/bugs.md.
#
# Generates the single-device plan, the correct parallel plan (dp2 pp2 tp2
# nm2) and the 14 bug plans llama3_br{N}_... under gen_model/mgeners/,
# verifies each against the single-device plan (log: data/logs/br{N}.log,
# the correct plan's: data/logs/br_clean.log), and checks that every bug
# plan exits 1 and the correct plan exits 0. Prints one line per plan: exit
# code and the first ❌ line of its log. Exit status 0 when all is as
# expected.
#
#   bash scripts/run_br.sh     # JOBS=2 plans at a time; PY, JOBS, LOGS may be set
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
JOBS=${JOBS:-2}
OUT=gen_model/mgeners
LOGS=${LOGS:-data/logs}
SIZE="--model llama3 --layers 32 --heads 32 --hidden 128 --seqlen 8192 --gbs 32 -o $OUT"
PAR="--dp 2 --pp 2 --tp 2 --nm 2"
TAIL=dp2_pp2_tp2_nm2_gbs32_ly32_h32_hi128_sq8192
SINGLE=$OUT/llama3_default_dp1_pp1_tp1_nm1_gbs32_ly32_h32_hi128_sq8192.pkl
BUGS=$(seq 1 14)

mkdir -p "$OUT" "$LOGS"
RC=$(mktemp -d)
trap 'rm -rf "$RC"' EXIT
start=$(date +%s.%N)

# one plan: generate it, verify it, keep the exit code ("clean" is the correct plan)
one() {
    local name=$1 variant log
    if [ "$name" = clean ]; then variant=default; else variant=br$name; fi
    log=$LOGS/br$name.log
    [ "$name" = clean ] && log=$LOGS/br_clean.log
    # shellcheck disable=SC2086
    if ! "$PY" -m gen_model $SIZE $PAR --variant "$variant" >"$log" 2>&1; then
        echo 3 >"$RC/$name"  # generation failed; the log says why
        return
    fi
    "$PY" main.py --sm "$SINGLE" --pm "$OUT/llama3_${variant}_$TAIL.pkl" \
        --max_vrf_proc 2 --no_cache_stages >"$log" 2>&1
    echo $? >"$RC/$name"
}
export -f one
export PY OUT LOGS TAIL SINGLE RC SIZE PAR

# shellcheck disable=SC2086
if ! "$PY" -m gen_model $SIZE >/dev/null; then
    echo "cannot generate the single-device plan" >&2
    exit 2
fi
printf '%s\n' clean $BUGS | xargs -P "$JOBS" -I{} bash -c 'one "$@"' _ {}

# the first ❌ line; for a counterexample also the single-device node of the
# failing stage and the (rank, microbatch) of the parallel tensors under 🚨
summary() {
    awk '
        /✅ SUCCESS/ && !first { first = $0 }
        /❌/ && !first { first = substr($0, 1, 200) }
        /^Node\(wtype=.s./ && !gs { gs = $0; sub(/.*op=/, "", gs); sub(/\)$/, "", gs); gsub(/\047|dir=|name=/, "", gs) }
        /⨁ Tensor\(wtype=.p./ { tp = $0; sub(/.*rank=/, "r", tp); sub(/, mb=/, "/mb", tp); sub(/,.*/, "", tp) }
        /🚨 ⬆️$/ && !(tp in seen) { seen[tp] = 1; bad = bad " " tp }
        END {
            printf "%s", first
            if (first ~ /plans differ \(sat\)/) printf " | Gs node: %s | 🚨 under%s", gs, bad
        }' "$1" 2>/dev/null
}

ok=1
printf '%-9s %-6s %s\n' plan exit "first ❌ line"
for name in clean $BUGS; do
    rc=$(cat "$RC/$name" 2>/dev/null || echo "?")
    if [ "$name" = clean ]; then
        log=$LOGS/br_clean.log want=0 label=clean
    else
        log=$LOGS/br$name.log want=1 label=br$name
    fi
    first=$(summary "$log")
    mark=""
    if [ "$rc" != "$want" ]; then mark="  <-- expected exit $want"; ok=0; fi
    printf '%-9s %-6s %s%s\n' "$label" "$rc" "$first" "$mark"
done
awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "total time: %.1f s\n", b - a }'
if [ $ok = 1 ]; then
    echo "all 14 bugs detected (exit 1); the correct plan verified (exit 0)"
    exit 0
fi
echo "some plan did not give the expected verdict (see the logs in $LOGS/)"
exit 1
