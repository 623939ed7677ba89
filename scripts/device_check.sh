#!/usr/bin/env bash
# One command for a machine with NVIDIA GPUs: the example GPT for a few steps at ZeRO stages 1, 2 and 3 in bf16 on
# the CUDA path (nccl; DeepSpeed's device_rank = the GPU index), one JSON line per case, within about 5 minutes.
#   bash scripts/device_check.sh
#   DEVICE_CHECK_STAGES=3 DEVICE_CHECK_STEPS=20 bash scripts/device_check.sh
# Settings (environment): DEVICE_CHECK_STEPS (5), DEVICE_CHECK_STAGES ("1 2 3"), DEVICE_CHECK_DEVICES (auto: every
# visible GPU), DEVICE_CHECK_PRECISION (bf16-mixed), DEVICE_CHECK_TIMEOUT (seconds per case, 90),
# DEVICE_CHECK_ACCELERATOR (cuda; "cpu" runs the same cases on CPU processes over gloo), PYTHON (python).
# The full output of every case goes to $DEVICE_CHECK_LOG (device_check.log). Exit status: 0 when every case
# passed, 1 when one failed or timed out, 2 when there is no GPU to check.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python}
STEPS=${DEVICE_CHECK_STEPS:-5}
STAGES=${DEVICE_CHECK_STAGES:-"1 2 3"}
DEVICES=${DEVICE_CHECK_DEVICES:-auto}
PRECISION=${DEVICE_CHECK_PRECISION:-bf16-mixed}
TIMEOUT=${DEVICE_CHECK_TIMEOUT:-90}
ACCELERATOR=${DEVICE_CHECK_ACCELERATOR:-cuda}
LOG=${DEVICE_CHECK_LOG:-device_check.log}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$ACCELERATOR" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "device_check: no CUDA GPU is visible to $PY (torch.cuda.is_available() is False, torch" \
       "$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable'))." >&2
  echo "device_check: run this on a machine with NVIDIA GPUs and a CUDA build of torch;" \
       "DEVICE_CHECK_ACCELERATOR=cpu runs the same cases on CPU." >&2
  exit 2
fi

NAME=device_check RUNNER=scripts/device_check.py KILL_AFTER=10 CASE_SUFFIX="-$ACCELERATOR" STACK_WHAT="versions"
source scripts/check_cases.sh
