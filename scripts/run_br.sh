#!/usr/bin/env bash
# Bug reproduction (paper §8.3): the 14 buggy llama3 plans of docs/bugs.md
# and the correct plan, made and verified in one process forked in JOBS
# (scripts/run_br.py says how). Prints one line per plan; exit 0 when every
# bug plan exits 1 and the correct plan exits 0.
#
#   bash scripts/run_br.sh     # PY, JOBS (default 2), LOGS (default data/logs) may be set
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" scripts/run_br.py --jobs "${JOBS:-2}" --logs "${LOGS:-data/logs}" "$@"
