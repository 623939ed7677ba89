"""DeepSpeed's C++ ops that are compiled on first use: stale build locks (``locks``), building ahead of time and
loading without hanging (``build``), and what each rank does before ``deepspeed.init_distributed`` (``startup``).

``lightning-gaudi-ds env --build-ops [OP ...]`` builds them now (scripts/setup.sh runs it).
"""

from lightning_gaudi_ds.jit_ops.build import CPU_ADAM, OPS, SHM_COMM, build_ops, load_op
from lightning_gaudi_ds.jit_ops.locks import BuildLockError, LockInfo, clear_stale_locks, inspect_lock, scan_locks
from lightning_gaudi_ds.jit_ops.startup import SHM_MODE_ENV, StartupOps, prepare_startup

__all__ = [
    "CPU_ADAM",
    "OPS",
    "SHM_COMM",
    "SHM_MODE_ENV",
    "BuildLockError",
    "LockInfo",
    "StartupOps",
    "build_ops",
    "clear_stale_locks",
    "inspect_lock",
    "load_op",
    "prepare_startup",
    "scan_locks",
]
