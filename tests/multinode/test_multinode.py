"""Multi-node for real: two hosts (network namespaces with their own sshd, hostname and pid namespace, sharing the
filesystem; tests/multinode/cluster.py), HPUDeepSpeedStrategy(stage=3) on CPU across them under every launcher,
arguments that reach remote ranks byte for byte, and the faults: a killed node, a partitioned link, a node that never
starts. After every test nothing of the job may be left on either host."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.multinode.cluster import Cluster
from tests.procs import JOBS, JobResult, LiveJob, free_port

pytestmark = [pytest.mark.multinode, pytest.mark.multiprocess]

HERE = Path(__file__).resolve().parent
ARGV_JOB = str(HERE / "argv_job.py")
TRAIN = str(JOBS / "train_job.py")
JOB_TIMEOUT_S = 300
LOSSES: dict[str, list[list[float]]] = {}  # launcher -> per-rank losses, compared across launchers
TIMINGS: dict[str, float] = {}


def spawn(cluster: Cluster, host: int, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> LiveJob:
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


def train_args(out: Path, *extra: str) -> list[str]:
    return [TRAIN, "--out", str(out), "--max-steps", "3", "--no-eval", "--stage", "3", "--width", "32",
            "--devices", "1", "--num-nodes", "2", *extra]


def ranks(out: Path, world: int = 2) -> list[dict]:
    found = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in found] == list(range(world)), found
    return found


@pytest.mark.parametrize("launcher", ["pdsh", "mpirun", "torchrun"])
def test_train_across_two_hosts(clean: Cluster, tmp_path: Path, launcher: str) -> None:
    out = tmp_path / "out"
    hostfile = str(clean.hostfile(1))
    if launcher == "torchrun":
        port = str(free_port())
        jobs = [spawn(clean, i, "--hostfile", hostfile, "--node_rank", str(i), "--master_addr", "n0",
                      "--master_port", port, *train_args(out)) for i in (0, 1)]
    else:
        flag = "--use_deepspeed" if launcher == "pdsh" else "--use_mpi"
        jobs = [spawn(clean, 0, "--hostfile", hostfile, flag, "--master_port", "0", *train_args(out))]
    results = finish(clean, *jobs)
    for result in results:
        assert result.returncode == 0, result.output[-4000:]
    found = ranks(out)
    assert [(r["host"], r["node_rank"], r["world_size"], r["global_step"]) for r in found] == [
        ("n0", 0, 2, 3), ("n1", 1, 2, 3)]
    assert all(r["zero_stage"] == 3 for r in found)
    LOSSES[launcher] = [r["step_losses"] for r in found]
    TIMINGS[launcher] = max(r.seconds for r in results)
    print(f"\n{launcher} 2x1: {TIMINGS[launcher]:.1f} s")
    if len(LOSSES) > 1:
        first = next(iter(LOSSES.values()))
        assert LOSSES[launcher] == first, LOSSES  # bit for bit: same ranks, same data, same collectives


INJECTION = [
    "x'; touch PWNED; '",
    'a"b',
    "$(touch PWNED)",
    "`touch PWNED`",
    "two words",
    "line\nbreak",
    "back\\slash",
    "",
    "--flag=$HOME",
    "*",
]


@pytest.mark.parametrize("flag", ["--use_deepspeed", "--use_mpi"])
def test_arguments_reach_remote_ranks_byte_for_byte(clean: Cluster, tmp_path: Path, flag: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cwd = tmp_path / "cwd"  # where a `touch PWNED` would land, on either host (the remote shell cds there too)
    cwd.mkdir()
    job = spawn(clean, 0, "--hostfile", str(clean.hostfile(1)), flag, "--master_port", "0", ARGV_JOB, str(out),
                *INJECTION, env={"LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT": "77"}, cwd=cwd)
    [result] = finish(clean, job, timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    found = ranks(out)
    assert [r["host"] for r in found] == ["n0", "n1"]
    for r in found:
        assert r["args"] == INJECTION, r["args"]
    assert not list(cwd.iterdir()) and not (Path.home() / "PWNED").exists(), "an argument ran as a command"
    # the same settings on every rank, on both hosts
    envs = [r["env"] for r in found]
    assert envs[0] == envs[1], envs
    env = envs[0]
    assert env["LIGHTNING_GAUDI_DS_RUN_ID"] and env["LIGHTNING_GAUDI_DS_STOP_TIMEOUT"] == "10.0"
    assert env["LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT"] == "77" and env["LIGHTNING_GAUDI_DS_LINK_TIMEOUT"] == "60"
    run_dir = Path(env["LIGHTNING_GAUDI_DS_RUN_DIR"])
    assert run_dir.parent == cwd and not run_dir.exists(), "the run directory is on the shared cwd, removed at the end"
    modes = found[0]["modes"]
    assert modes["."] == 0o700 and modes["argv.json"] == 0o600, modes
    if flag == "--use_deepspeed":
        assert env["OMPI_MCA_ess_singleton_isolated"] == "1"
        assert modes["deepspeed_env"] == 0o600, modes
