#!/usr/bin/env bash
# The whole parallelism grid through the differential numeric check.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/check_grid.py "$@"
