#!/usr/bin/env bash
# Issue 37's repeated-run check: the multi-node tier and the restart tests N times in a row (default 5), beside 2 busy
# processes (each `python -c 'while True: pass'`) as load on the 2-core machine; every run must pass.
#   bash scripts/repeat_under_load.sh [N] [LOGDIR]     one line per run in LOGDIR/summary.txt; exit 1 if any run failed
# The busy processes are this script's own children, ended by their pids when it ends.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
runs=${1:-5}
logs=${2:-$(mktemp -d)}
mkdir -p "$logs"
. scripts/setup.sh
python -c 'while True: pass' & busy1=$!
python -c 'while True: pass' & busy2=$!
trap 'kill "$busy1" "$busy2" 2>/dev/null' EXIT
failed=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  bash scripts/test.sh -n 2 --dist loadgroup tests/multinode tests/test_restart.py >"$logs/run$i.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || failed=1
  echo "run $i: rc=$rc $(( $(date +%s) - start )) s: $(tail -1 "$logs/run$i.log") (load $(cut -d' ' -f1-3 /proc/loadavg))" \
    | tee -a "$logs/summary.txt"
done
echo "logs: $logs"
exit "$failed"
