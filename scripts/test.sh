#!/usr/bin/env bash
# Set up (if needed) and run the tests: bash scripts/test.sh [--lint] [pytest args]
#   bash scripts/test.sh                          the whole suite, on LGDS_TEST_WORKERS (default 2) pytest-xdist
#                                                 workers: much of a process test waits (grace periods, time-outs,
#                                                 SLURM's scheduler) rather than computes; tests sharing a module- or
#                                                 session-scoped fixture run on one worker (tests/conftest.py)
#   bash scripts/test.sh -m "not multiprocess"    the unit tier, in this process: starts no process
#   bash scripts/test.sh tests/test_restart.py    any pytest arguments are passed on, run in one process;
#                                                 add -n 2 to spread them over workers too
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
workers=()
if [ $# -eq 0 ] && [ "${LGDS_TEST_WORKERS:-2}" != "0" ]; then
  # --dist loadgroup keeps each xdist_group on one worker; without reordering, the longest work goes first
  workers=(-n "${LGDS_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder)
fi
# The suite caches bytecode (the package's, the tests' as pytest rewrites them, the libraries' modules that set-up's
# import did not reach), under __pycache__ (git-ignored), even
# where PYTHONDONTWRITEBYTECODE is set (as on the machine this was written on): otherwise each of the suite's few
# hundred processes compiles the package's sources again, and each run rewrites every test module's asserts.
unset PYTHONDONTWRITEBYTECODE
# DeepSpeed's op builds go through ccache where set-up installed it, with set-up's cache (tests/test_startup.py builds
# an op again: a cache hit of the set-up's build)
export CCACHE_DIR="${CCACHE_DIR:-$VIRTUAL_ENV/ccache}" CCACHE_NOHASHDIR=1  # as setup.sh's op build
python -m pytest -q --durations=15 "${workers[@]}" "${tier[@]}" "$@"
