#!/usr/bin/env bash
# First run on a Gaudi machine, in one command: the software stack and the execution mode, then the example GPT
# for a few steps at ZeRO stages 1, 2 and 3 in bf16 on every visible card, one JSON line per case.
#   bash scripts/hpu_check.sh                      # inside Habana's PyTorch container
#   PT_HPU_LAZY_MODE=1 bash scripts/hpu_check.sh   # the legacy lazy mode instead of eager + torch.compile
# Settings (environment): HPU_CHECK_STEPS (5), HPU_CHECK_STAGES ("1 2 3"), HPU_CHECK_DEVICES (auto),
# HPU_CHECK_PRECISION (bf16-mixed), HPU_CHECK_TIMEOUT (seconds per case, 900: the first step compiles graphs),
# HPU_CHECK_ACCELERATOR (hpu; "cpu" runs the same cases without a Gaudi), PYTHON (python). The full output of
# every case goes to $HPU_CHECK_LOG (hpu_check.log). Exit status: 0 when every case trained its steps with finite
# losses, 1 when one failed or timed out, 2 when the Gaudi stack is missing.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python}
STEPS=${HPU_CHECK_STEPS:-5}
STAGES=${HPU_CHECK_STAGES:-"1 2 3"}
DEVICES=${HPU_CHECK_DEVICES:-auto}
PRECISION=${HPU_CHECK_PRECISION:-bf16-mixed}
ACCELERATOR=${HPU_CHECK_ACCELERATOR:-hpu}
TIMEOUT=${HPU_CHECK_TIMEOUT:-900}
LOG=${HPU_CHECK_LOG:-hpu_check.log}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$ACCELERATOR" = hpu ] && ! "$PY" -c \
    "import importlib.util, sys; sys.exit(importlib.util.find_spec('habana_frameworks') is None)" 2>/dev/null; then
  echo "hpu_check: the Intel Gaudi software stack (Python package habana_frameworks) is not installed for $PY." >&2
  echo "hpu_check: run this inside Habana's PyTorch container on a Gaudi machine; HPU_CHECK_ACCELERATOR=cpu runs" >&2
  echo "hpu_check: the same cases on CPU." >&2
  exit 2
fi
# habana_frameworks picks eager or lazy at its first import; unset means eager in current releases. Fixed here so
# that every rank imports it in the same mode, and printed so the log says which one ran.
export PT_HPU_LAZY_MODE=${PT_HPU_LAZY_MODE:-0}

NAME=hpu_check RUNNER=scripts/hpu_check.py KILL_AFTER=30 CASE_SUFFIX="" STACK_WHAT="the stack"
before_stack() {
  echo "== software stack" | tee -a "$LOG" >&2
  "$PY" -m lightning_gaudi_ds env >>"$LOG" 2>&1 || echo "hpu_check: 'python -m lightning_gaudi_ds env' failed (see $LOG)" >&2
}
source scripts/check_cases.sh
