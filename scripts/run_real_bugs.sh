#!/usr/bin/env bash
# Bugs that shipped in training frameworks, injected into plans that otherwise
# verify (docs/real-bugs.md): every clean plan exits 0, every injected one 1.
#
#   bash scripts/run_real_bugs.sh [KEY ...]     # PY may be set
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PY:-.venv/bin/python}" scripts/real_bugs.py "$@"
