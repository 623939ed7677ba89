#!/usr/bin/env bash
# The README's main command: set up (if needed), then train the example GPT on Pride and Prejudice with the
# default recipe: 2 processes (CPU here, GPUs where present; on Gaudi add --trainer.accelerator hpu), ZeRO-2, bf16.
#   bash scripts/train.sh                                   # a few minutes on a 2-core machine
#   bash scripts/train.sh --config examples/configs/zero3_bf16.yaml --trainer.max_steps 100
# Extra arguments go to `examples/train_lm.py fit` (a later --config adds to / overrides the default one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
exec python examples/train_lm.py fit --config examples/configs/zero2_bf16.yaml "$@"
