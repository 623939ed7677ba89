"""Start the benchmark's rank processes as one job in its own process group, and own them.

Only the processes started here are ever signalled, through their process-group id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:  # run as a script from benchmarks/: the package is in the checkout above
    sys.path.insert(0, str(REPO))

from lightning_gaudi_ds.launch._proc import free_port  # noqa: E402


@dataclass
class JobResult:
    returncodes: list[Optional[int]]
    seconds: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def clean_env(extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_DEEPSPEED_CONFIG_PATH", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.update(extra or {})
    return env


def kill_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(1.0)


def run_ranks(args: Sequence[str], world: int, log_dir: Path, timeout: float,
              env: Optional[Mapping[str, str]] = None) -> JobResult:
    """Run ``args`` once per rank as one job: a small launcher process leads a new process group and
    starts the ranks inside it (RANK/LOCAL_RANK/WORLD_SIZE set); on time-out the group is killed."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--world", str(world), "--log-dir", str(log_dir), "--", *args]
    return run_one(cmd, log_dir / "launcher.log", timeout, env)


def _launch_ranks(args: Sequence[str], world: int, log_dir: Path) -> int:
    """Inside the job's process group: start the ranks, wait; if one fails, end the others (by pid)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               NODE_RANK="0")
    procs = []
    for rank in range(world):
        with open(log_dir / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(list(args), cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
    deadline: Optional[float] = None
    while any(p.poll() is None for p in procs):
        if deadline is None and any(p.returncode not in (None, 0) for p in procs):
            deadline = time.monotonic() + 60  # a rank failed: the peer gets a grace period, then ends
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    print(f"rank exit codes: {codes}", flush=True)
    return next((c for c in codes if c != 0), 0)


def run_one(args: Sequence[str], log: Path, timeout: float, env: Optional[Mapping[str, str]] = None) -> JobResult:
    """A single helper process (e.g. building DeepSpeed's CPU Adam) in its own process group."""
    with open(log, "wb") as f:
        p = subprocess.Popen(list(args), cwd=str(REPO), env=clean_env(env), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        start = time.monotonic()
        try:
            p.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(p.pid)
            p.wait()
    return JobResult([p.returncode], time.monotonic() - start, timed_out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="start WORLD ranks of a command (used by run_ranks)")
    from flags import positive_int

    parser.add_argument("--world", type=positive_int, required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    ns = parser.parse_args()
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    sys.exit(_launch_ranks(cmd, ns.world, Path(ns.log_dir)))
