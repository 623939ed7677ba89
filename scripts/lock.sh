#!/usr/bin/env bash
# Refresh the hash-locked set-up (requirements/lock*.txt) after changing pyproject.toml's requirements or
# requirements/pins.in: bash scripts/lock.sh
# pip-tools resolves the package's dependencies with every extra the dev/test/CI set-up installs, plus the pins, and
# records each file's sha256; scripts/setup.sh installs from the lock with --require-hashes and refuses a lock made
# from other requirements than today's (requirements/lockcheck.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/pip" install -q "pip-tools>=7.4,<8" 2>&1 | { grep -v '^WARNING: Location' || true; }
lock() {  # lock FILE [extra pin]
  local out=$1 pins=requirements/pins.in extra
  if [ $# -gt 1 ]; then extra=$(mktemp); printf '%s\n' "$2" > "$extra"; pins="$pins $extra"; fi
  # pip-compile keeps the versions of the file it writes to: starting from the current lock, a new requirement adds
  # its packages and leaves every other pin as it is (LOCK_UPGRADE=1: resolve everything afresh)
  if [ -f "$out" ] && [ "${LOCK_UPGRADE:-0}" != "1" ]; then cp "$out" "$out.new"; fi
  # shellcheck disable=SC2086
  "$tools/bin/pip-compile" -q --generate-hashes --strip-extras --no-header --no-emit-index-url --no-emit-find-links \
    --unsafe-package lightning-gaudi-ds --extra test --extra examples --extra dev -o "$out.new" pyproject.toml $pins
  { python3 requirements/lockcheck.py --header "bash scripts/lock.sh" "${2:-}"; cat "$out.new"; } > "$out"
  rm -f "$out.new"
}
lock requirements/lock.txt
lock requirements/lock-deepspeed-0.16.1.txt "deepspeed==0.16.1"  # the second CI tier (test.sh --deepspeed 0.16.1)
echo "wrote requirements/lock.txt and requirements/lock-deepspeed-0.16.1.txt"
