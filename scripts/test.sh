#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m pytest -q --durations=15 "$@"
