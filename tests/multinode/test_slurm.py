"""SLURM for real: Debian's slurmctld, slurmd and munge as a two-node cluster on two namespace hosts
(tests/multinode/slurm.py), with jobs submitted as users do.

- One batch job (examples/slurm/train.sbatch: ``--nodes 2 --requeue --signal=USR1@180``, ``srun`` inside, here with
  ``--ntasks-per-node 1``) serves four
  checks: the strategy on every rank under Lightning's ``SLURMEnvironment``; SLURM's time-limit signal (USR1) ending
  in a crash-safe save and an auto-requeue; ``scancel --signal=TERM`` ending in a save, exit 75 and a requeue by the
  batch script; and the final fp32 weights of the thrice-started job equal an uninterrupted run's (data position
  included).
- ``lightning-gaudi-ds spawn`` inside ``salloc``: the allocation's nodes and tasks per node instead of a hostfile,
  under pdsh and mpirun; a hostfile given wins; a world size that contradicts the allocation is refused.
- n1 lost mid-job (its link down, every process on it killed): the job ends within SLURM's own bound.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multinode.slurm import CRED_EXPIRE, KILL_WAIT, SLURMD_TIMEOUT, Slurm
from tests.multinode.test_multinode import ARGV_JOB, COLLECTIVE, bound
from tests.procs import JOBS, REPO, LiveJob, job_env
from tests.test_restart import spawn_job

pytestmark = [pytest.mark.multinode, pytest.mark.multiprocess]

RESTART_JOB = ("--data", "--steps", "16", "--every", "4")  # one 16-step epoch, a save every 4 steps
PACE = 3.0  # s per step in the first start: SLURM's time-limit signal comes at its next check, <= 30 s later
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"  # docs/launching.md's batch script (--signal=USR1@180)
DONE = ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED")


def slurm_env(**extra: str) -> dict[str, str]:
    """What a user's shell exports to sbatch/salloc: this suite's environment, without a fixed rendezvous (under SLURM
    Lightning takes it from the node list and job id)."""
    env = job_env(extra)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def records(out: Path, attempt: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"attempt{attempt}-rank{r}.json").read_text()) for r in (0, 1)]


def wait_steps(out: Path, attempt: int, count: int, timeout: float, slurm: Slurm, job: int) -> None:
    """Until rank 0 of that start has run ``count`` training steps."""
    path, deadline = out / f"attempt{attempt}-rank0.json", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(json.loads(path.read_text())["steps"]) >= count:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"start {attempt}: not {count} steps within {timeout:.0f}s: {slurm.job(job)}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same fit without SLURM or interruption: torchrun, two ranks on this host."""
    out = tmp_path_factory.mktemp("uninterrupted")
    spawn_job(out, (), RESTART_JOB).check()
    return out


@pytest.fixture(scope="module")
def preempted(slurm_cluster: Slurm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The batch job, started three times by SLURM: USR1 from its time limit in the first start, then
    ``scancel --signal=TERM`` in the second; the third runs to the end.

    The job is submitted with ``--time=10`` and the script's ``--signal=USR1@180``; once its fit runs, the test moves
    the time limit to 3 minutes, which makes the signal due at once. SLURM checks time limits every 30 s, so the
    signal arrives at its next check, as it would 180 s before a real limit (moving the limit spares the test the
    wait for a start-up whose length depends on the machine's load). While the requeued job waits, the limit goes back
    to 10 minutes."""
    slurm = slurm_cluster
    slurm.ensure_up()
    root = tmp_path_factory.mktemp("slurm_preempted")
    out = root / "out"
    log = root / "slurm.out"
    started = time.monotonic()
    # the documented batch script as it is, with 1 task per node (2 CPUs a node here) and a time limit of 10 min
    job = slurm.sbatch(SBATCH, "--ntasks-per-node=1", "--time=10", f"--output={log}",
                       args=[str(JOBS / "restart_job.py"), "--out", str(out), *RESTART_JOB, "--num_nodes", "2",
                             "--pace", f"0:{PACE}", "--pace", "1:1"],
                       env=slurm_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"), cwd=root)
    timings: dict[str, float] = {}
    try:
        wait_steps(out, 0, 2, 240, slurm, job)
        timings["first start: 2 steps"] = time.monotonic() - started
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=3")
        moved = time.monotonic()
        slurm.wait_job(job, ("PENDING", "REQUEUED", "RUNNING"), 120, count=1)
        timings["USR1 -> requeued"] = time.monotonic() - moved
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
        wait_steps(out, 1, 2, 240, slurm, job)
        timings["second start: 2 steps"] = time.monotonic() - moved
        slurm.run("scancel", "--signal=TERM", str(job))
        termed = time.monotonic()
        slurm.wait_job(job, ("PENDING", "REQUEUED", "RUNNING"), 120, count=2)
        timings["TERM -> requeued"] = time.monotonic() - termed
        info = slurm.wait_job(job, DONE, 300, count=2)
        timings["job"] = time.monotonic() - started
    finally:
        slurm.run("scancel", str(job), check=False)
    left = slurm.cluster.wait_clean(30)
    print(f"\nSLURM preemption job: {', '.join(f'{k} {v:.1f} s' for k, v in timings.items())}")
    return {"job": job, "out": out, "info": info, "log": log.read_text(errors="replace"), "left": left,
            "timings": timings, "slurmctld": slurm.log("slurmctld.log")}


def test_srun_runs_the_strategy_on_every_rank_under_slurm_environment(preempted: dict[str, Any]) -> None:
    """``srun`` started one task per node; Lightning took them for SLURM's (``SLURMEnvironment``: ranks, node list,
    port from the job id) and every rank trained with HPUDeepSpeedStrategy, the job ending cleanly."""
    assert preempted["info"]["JobState"] == "COMPLETED", (preempted["info"], preempted["log"][-4000:])
    for attempt in range(3):
        found = records(preempted["out"], attempt)
        assert [(r["host"], r["environment"], r["strategy"], r["world_size"], r["num_nodes"]) for r in found] == [
            (f"n{rank}", "SLURMEnvironment", "HPUDeepSpeedStrategy", 2, 2) for rank in (0, 1)], found
    assert not preempted["left"], f"processes left behind: {preempted['left']}"


def test_the_time_limit_signal_saves_and_requeues(preempted: dict[str, Any]) -> None:
    """``--signal=USR1@170``: every rank stops at one step boundary, the checkpoint is saved there (crash-safe),
    rank 0 requeues the job, and SLURM's second start (``SLURM_RESTART_COUNT=1``) resumes from it."""
    log = preempted["log"]
    first, second = records(preempted["out"], 0)[0], records(preempted["out"], 1)[0]
    saved = second["steps"][0]
    assert first["steps"] == list(range(saved)), (first["steps"], saved)  # nothing ran twice, nothing was lost
    assert f"SIGUSR1: saved {preempted['out'] / 'ckpt' / 'last.ckpt'} at step {saved}" in log, log[-4000:]
    assert "SIGUSR1 (SLURM auto-requeue): requeued SLURM job" in log, log[-4000:]
    assert second["resumed_from"] == str(preempted["out"] / "ckpt" / "last.ckpt")
    assert "Restart 1 of the job (SLURM_RESTART_COUNT=1): resuming from ckpt_path='last'." in log, log[-4000:]
    assert f"*** JOB {preempted['job']} ON n0 CANCELLED AT" in log and "DUE TO JOB REQUEUE ***" in log, log[-4000:]


def test_scancel_term_saves_exits_75_and_the_batch_script_requeues(preempted: dict[str, Any]) -> None:
    second, third = records(preempted["out"], 1)[0], records(preempted["out"], 2)[0]
    saved = third["steps"][0]
    assert second["steps"] == list(range(second["steps"][0], saved)), (second["steps"], saved)
    log = preempted["log"]
    assert f"SIGTERM: saved {preempted['out'] / 'ckpt' / 'last.ckpt'} at step {saved}; exiting with 75" in log
    assert "srun: error: n0: task 0: Exited with exit code 75" in log, log[-4000:]
    assert preempted["info"]["ExitCode"] == "0:0" and preempted["info"]["Restarts"] == "2", preempted["info"]
    assert third["done"] and third["global_step"] == 16 and third["steps"] == list(range(saved, 16))


def test_the_requeued_job_ends_with_the_uninterrupted_weights(preempted: dict[str, Any], uninterrupted: Path) -> None:
    """Three starts under SLURM, two preemptions mid-epoch: the final fp32 weights are the uninterrupted run's, and
    each start read the epoch's batches from where the checkpoint left it."""
    ran = json.loads((uninterrupted / "attempt0-rank0.json").read_text())["batches"]
    for attempt in range(3):
        got = records(preempted["out"], attempt)[0]
        assert got["batches"] == pytest.approx(ran[got["steps"][0]:got["steps"][0] + len(got["batches"])], rel=1e-9)
    expected, got = torch.load(uninterrupted / "weights.pt"), torch.load(preempted["out"] / "weights.pt")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def test_spawn_inside_an_allocation_uses_its_nodes(slurm: Slurm, tmp_path: Path) -> None:
    """``salloc --nodes 2 --ntasks-per-node 1``, then in it ``lightning-gaudi-ds spawn`` without a hostfile: pdsh and
    mpirun start one rank on each allocated node (``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``), and the ranks see
    no SLURM variable (they are not srun's tasks). A hostfile given wins; a contradicting world size is refused."""
    spawn = f"{sys.executable} -m lightning_gaudi_ds spawn --master_port 0"
    outs = {name: tmp_path / name for name in ("pdsh", "mpi", "hostfile")}
    for out in outs.values():
        out.mkdir()
    one = tmp_path / "one-host"
    one.write_text("n0 slots=1\n")
    steps = [f"{spawn} --use_deepspeed {ARGV_JOB} {outs['pdsh']} a 'b c'",
             f"{spawn} --use_mpi {ARGV_JOB} {outs['mpi']} a 'b c'",
             f"{spawn} --use_mpi --hostfile {one} {ARGV_JOB} {outs['hostfile']} a",
             f"{spawn} --use_deepspeed --world_size 4 {ARGV_JOB} {tmp_path} a; echo refused with $?"]
    job = LiveJob(slurm.argv(0, "salloc", "--nodes=2", "--ntasks-per-node=1", "bash", "-c", " && ".join(steps[:3])
                             + "; " + steps[3], cwd=tmp_path), env={**slurm_env(), **slurm.cluster.env()},
                  cwd=tmp_path)
    result = job.wait(240)
    left = slurm.cluster.wait_clean(15)
    print(f"\nspawn inside salloc (pdsh, mpirun, a hostfile, a refusal): {result.seconds:.1f} s")
    assert not result.timed_out and result.returncode == 0, result.output[-4000:]
    for name in ("pdsh", "mpi"):
        found = [json.loads((outs[name] / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert [(r["host"], r["world_size"], r["args"], r["slurm"]) for r in found] == [
            (f"n{r}", "2", ["a", "b c"], []) for r in (0, 1)], found
    assert "the SLURM allocation's hosts: n0 (1), n1 (1) from SLURM_JOB_NODELIST=n[0-1]" in result.output
    assert [p.name for p in outs["hostfile"].iterdir()] == ["rank0.json"]
    assert f"hostfile {one} given: the SLURM allocation (SLURM_JOB_NODELIST=n[0-1]" in result.output
    assert "world_size=4, but the SLURM allocation has 2 task(s)" in result.output
    assert "refused with 2" in result.output
    assert not left, f"processes left behind: {left}"


def test_a_lost_node_ends_the_job_within_slurms_bound(slurm: Slurm, tmp_path: Path) -> None:
    """n1 crashes mid-job (its link goes down, every process on it, slurmd included, is killed) while the ranks
    all-reduce with a 300 s process-group timeout: slurmctld finds n1 silent after ``SlurmdTimeout``, marks it DOWN
    and ends the job (``--no-requeue``), and n0's rank is gone within ``SlurmdTimeout`` (and its ping interval, a
    third of it) plus ``KillWait``, with the machine's pace."""
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nexport MASTER_ADDR=n0 MASTER_PORT=29500\n"
                      f"srun {sys.executable} -u {COLLECTIVE} --pg-timeout 300\n")
    log = tmp_path / "slurm.out"
    started = time.monotonic()
    job = slurm.sbatch(script, "--nodes=2", "--ntasks-per-node=1", "--no-requeue", f"--output={log}",
                       env=slurm_env(), cwd=tmp_path)
    deadline = time.monotonic() + 120
    while "rank 1 on n1: step 3" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, (slurm.job(job), log.read_text() if log.exists() else "")
        time.sleep(0.2)
    lost = time.monotonic()
    pace = lost - started
    try:
        slurm.cluster.hosts[1].link(False)
        for pid, _ in slurm.cluster.hosts[1].processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        info = slurm.wait_job(job, DONE, 120)
        ended = time.monotonic() - lost
        left = slurm.cluster.wait_clean(30)
        gone = time.monotonic() - lost
    finally:
        slurm.cluster.hosts[1].link(True)
    print(f"\nlost node under SLURM: the job {info['JobState']} after {ended:.1f} s, n0 clean after {gone:.1f} s")
    assert info["JobState"] in ("NODE_FAIL", "FAILED", "CANCELLED"), info
    assert not left, f"left behind: {left}"
    assert gone < bound(SLURMD_TIMEOUT * 4 / 3, KILL_WAIT, pace=pace), (pace, info, slurm.log("slurmctld.log")[-3000:])


assert CRED_EXPIRE < 30  # a requeued job must start again within the waits above
