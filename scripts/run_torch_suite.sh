#!/usr/bin/env bash
# Trace and verify every (model, recipe) case of scripts/torch_suite.py, correct
# and buggy: one line per case, then "torch suite: N of N as expected".
#
#   bash scripts/run_torch_suite.sh [-k SUBSTRING ...] [--exact NAME ...] [--shard I/N] [--list]
#   (PY may be set)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PY:-.venv/bin/python}" scripts/torch_suite.py "$@"
