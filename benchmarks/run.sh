#!/usr/bin/env bash
# Set up (scripts/setup.sh, plus the `bench` extra: matplotlib) and run every benchmark of benchmarks/README.md.
#   bash benchmarks/run.sh            # full run, ~15-20 min on 2 CPU cores: benchmarks/results/ + README table
#   bash benchmarks/run.sh --quick    # small models, few steps: benchmarks/results/quick/
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
python -m pip install -q -e ".[test,bench]" 2>&1 | { grep -v '^WARNING: Location' || true; }
python benchmarks/run_all.py "$@"
