"""A rank of the multi-node tier's argument and settings checks: writes ``<out>/rank<R>.json`` with exactly the
arguments it was given, its host and the project's settings it sees. Standard library only (fast)."""

import json
import os
import socket
import stat
import sys
from pathlib import Path

KEYS = ("LIGHTNING_GAUDI_DS_RUN_DIR", "LIGHTNING_GAUDI_DS_RUN_ID", "LIGHTNING_GAUDI_DS_STOP_TIMEOUT",
        "LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT", "LIGHTNING_GAUDI_DS_LINK_TIMEOUT", "OMPI_MCA_ess_singleton_isolated",
        "PT_HPU_LAZY_MODE", "DS_ENV_FILE")

out, args = Path(sys.argv[1]), sys.argv[2:]
rank = int(os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
run_dir = os.environ.get("LIGHTNING_GAUDI_DS_RUN_DIR")
modes = {}
if run_dir:
    for path in [Path(run_dir), *Path(run_dir).iterdir()]:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:  # another rank's record (rankN.tmp), renamed into place between listing and stat
            continue
        modes[path.name if path != Path(run_dir) else "."] = stat.S_IMODE(mode)
record = {"rank": rank, "host": socket.gethostname(), "args": args, "env": {k: os.environ.get(k) for k in KEYS},
          "modes": modes, "world_size": os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE"),
          "slurm": sorted(k for k in os.environ if k.startswith("SLURM_"))}
(out / f"rank{rank}.json").write_text(json.dumps(record))
print(f"rank {rank} on {record['host']}: {len(args)} args", flush=True)
