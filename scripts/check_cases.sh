# The loop shared by scripts/device_check.sh and scripts/hpu_check.sh, sourced after they set: NAME (the command's
# name in messages), RUNNER (its Python case runner), PY, STEPS, STAGES, DEVICES, PRECISION, ACCELERATOR, TIMEOUT,
# KILL_AFTER (seconds between TERM and KILL), LOG, CASE_SUFFIX (appended to each case name), STACK_WHAT (what the
# --stack line reports, for the error), and optionally a function before_stack. One JSON line per case on stdout;
# exits 0 when every case passed, 1 when one failed or timed out.
: >"$LOG"
if declare -F before_stack >/dev/null; then before_stack; fi
"$PY" "$RUNNER" --stack 2>>"$LOG" | grep '^{' || { echo "$NAME: could not read $STACK_WHAT (see $LOG)" >&2; exit 1; }

status=0
for stage in $STAGES; do
  case="zero$stage-$PRECISION$CASE_SUFFIX"
  echo "== $case, $STEPS steps" >>"$LOG"
  # timeout runs a case in its own process group and signals the whole group: every rank Lightning started, too.
  out=$(timeout --signal=TERM --kill-after="$KILL_AFTER" "$TIMEOUT" "$PY" "$RUNNER" --stage "$stage" \
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
  [ "$rc" -eq 0 ] || { status=1; echo "$NAME: $case failed (exit status $rc; see $LOG)" >&2; }
done
exit $status
