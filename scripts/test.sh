#!/usr/bin/env bash
# Set up (if needed) and run the tests: bash scripts/test.sh [--lint] [pytest args]
#   bash scripts/test.sh                          the whole suite
#   bash scripts/test.sh -m "not multiprocess"    the unit tier: about a minute, starts no process
#   --lint first checks the package with ruff and mypy (the dev extra; .ci/run does this)
#   bash scripts/test.sh --deepspeed 0.16.1       the DeepSpeed 0.16.1 tier (Habana's fork's base) in its own venv:
#                                                 the unit tier and the process tests marked fork_tier
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tier=()
if [ "${1:-}" = "--deepspeed" ]; then
  export LIGHTNING_GAUDI_DS_DEEPSPEED="$2"
  shift 2
  tier=(-m "not multiprocess or fork_tier")
fi
. scripts/setup.sh
if [ "${1:-}" = "--lint" ]; then
  shift
  # ruff and mypy (the dev extra) come with the lock
  ruff check lightning_gaudi_ds
  mypy  # files and strictness: [tool.mypy] in pyproject.toml
fi
python -m pytest -q --durations=15 "${tier[@]}" "$@"
