"""Start real processes for tests, and own them: each job in its own process group, killed on time-out.

Only processes started here are ever signalled, by their process-group id.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).resolve().parent / "jobs"


@dataclass
class JobResult:
    returncode: int
    output: str
    seconds: float
    timed_out: bool

    def check(self) -> "JobResult":
        assert not self.timed_out, f"job timed out after {self.seconds:.0f}s; output tail:\n{self.output[-4000:]}"
        assert self.returncode == 0, f"job failed (rc={self.returncode}); output tail:\n{self.output[-4000:]}"
        return self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_DEEPSPEED_CONFIG_PATH"):
        env.pop(key, None)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    env.update(extra or {})
    return env


def run_job(
    args: Sequence[str],
    timeout: float = 300,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[Path] = None,
) -> JobResult:
    """Run ``args`` in a new session; on time-out kill the whole process group (and only it)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        list(args),
        cwd=str(cwd or REPO),
        env=job_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        output, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
            proc.wait()
        try:  # ranks the job started and left behind share its process group: end them too
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return JobResult(proc.returncode, output or "", time.monotonic() - start, timed_out)


def kill_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(1.0)


def run_train_job(out: Path, *job_args: str, timeout: float = 300, env: Optional[Mapping[str, str]] = None) -> list[dict]:
    """Run tests/jobs/train_job.py (Lightning's own launcher starts the other ranks); return per-rank results."""
    run_job([sys.executable, str(JOBS / "train_job.py"), "--out", str(out), *job_args], timeout, env).check()
    files = sorted(out.glob("rank*.json"))
    assert files, f"no results written under {out}"
    return [json.loads(f.read_text()) for f in files]
