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

: >"$LOG"
"$PY" scripts/device_check.py --stack 2>>"$LOG" | grep '^{' || { echo "device_check: could not read versions (see $LOG)" >&2; exit 1; }
status=0
for stage in $STAGES; do
  case="zero$stage-$PRECISION-$ACCELERATOR"
  echo "== $case, $STEPS steps" >>"$LOG"
  # timeout runs a case in its own process group and signals the whole group: every rank Lightning started, too.
  out=$(timeout --signal=TERM --kill-after=10 "$TIMEOUT" "$PY" scripts/device_check.py --stage "$stage" \
        --steps "$STEPS" --devices "$DEVICES" --precision "$PRECISION" --accelerator "$ACCELERATOR" 2>>"$LOG")
  rc=$?
  echo "$out" >>"$LOG"
  line=$(printf '%s\n' "$out" | grep '^{"case"' | tail -1)
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    line="{\"case\": \"$case\", \"stage\": $stage, \"ok\": false, \"error\": \"timed out after ${TIMEOUT}s\"}"
  elif [ -z "$line" ]; then
    line="{\"case\": \"$case\", \"stage\": $stage, \"ok\": false, \"error\": \"exit status $rc without a result line\"}"
  fi
  echo "$line"
  [ "$rc" -eq 0 ] || { status=1; echo "device_check: $case failed (exit status $rc; see $LOG)" >&2; }
done
exit $status
