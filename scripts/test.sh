#!/usr/bin/env bash
# Set up (if needed) and run the tests: bash scripts/test.sh [--lint] [pytest args]
#   bash scripts/test.sh                          the whole suite
#   bash scripts/test.sh -m "not multiprocess"    the unit tier: about a minute, starts no process
#   --lint first checks the package with ruff and mypy (the dev extra; .ci/run does this)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
if [ "${1:-}" = "--lint" ]; then
  shift
  pipq -e ".[dev]"
  ruff check lightning_gaudi_ds
  mypy  # files and strictness: [tool.mypy] in pyproject.toml
fi
python -m pytest -q --durations=15 "$@"
