"""Jobs started on the multi-node tier's hosts (tests/multinode/cluster.py), and the check that nothing of them is left
on either host: shared by the tests and by the benchmarks that use the two hosts (benchmarks/wire.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.multinode.cluster import Cluster
from tests.procs import JobResult, LiveJob

JOB_TIMEOUT_S = 300


def spawn(cluster: Cluster, host: int, *args: str, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> LiveJob:
    """``lightning-gaudi-ds spawn ARGS`` started on host ``host``."""
    argv = [*cluster.hosts[host].enter(cwd or cluster.root), sys.executable, "-m", "lightning_gaudi_ds", "spawn", *args]
    return LiveJob(argv, env={**cluster.env(), **(env or {})}, cwd=cwd or cluster.root)


def finish(cluster: Cluster, *jobs: LiveJob, timeout: float = JOB_TIMEOUT_S, settle: float = 15.0) -> list[JobResult]:
    """Wait for the jobs, then require that no process is left on either host (but the sshd listeners)."""
    results = [job.wait(timeout) for job in jobs]
    left = cluster.wait_clean(settle)
    for result in results:
        assert not result.timed_out, f"job timed out after {result.seconds:.0f}s:\n{result.output[-4000:]}"
    assert not left, f"processes left behind: {left}\n{results[0].output[-3000:]}"
    return results
