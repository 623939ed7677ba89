"""Real launches of 2 CPU ranks training with HPUDeepSpeedStrategy through every launcher path, two simulated
nodes, and the failure cases: a rank that exits, raises or is killed, and SIGINT/SIGTERM to the runner. Each
job is checked for leftover processes in the process table (every process of a job carries a test mark)."""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from lightning_gaudi_ds.launch.plan import SHIM
from tests.procs import JOBS, JobResult, LiveJob, free_port

pytestmark = pytest.mark.multiprocess

SPAWN = [sys.executable, "-m", "lightning_gaudi_ds", "spawn"]
CONSOLE_SCRIPT = str(Path(sys.executable).with_name("lightning-gaudi-ds"))
TRAIN = str(JOBS / "train_job.py")
BOUND_S = 30.0  # every rank must be gone this long after a failure or a signal (well above a ~10 s stop)
JOB_TIMEOUT_S = 600


def train_args(out: Path, *extra: str) -> list[str]:
    return [TRAIN, "--out", str(out), "--max-steps", "2", "--no-eval", *extra]


def results(out: Path) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    assert files, f"no results under {out}"
    return [json.loads(f.read_text()) for f in files]


def finish(job: LiveJob, timeout: float = JOB_TIMEOUT_S) -> JobResult:
    """Wait for the job, then require that none of its processes is left in the process table."""
    result = job.wait(timeout)
    deadline = time.monotonic() + 3.0
    left = job.leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = job.leftovers()
    if left:
        described = []
        for p in left:
            try:
                described.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
            except Exception:
                described.append(str(p.pid))
        job.kill()
        pytest.fail("processes left behind by the job:\n" + "\n".join(described) + f"\n{result.output[-3000:]}")
    assert not result.timed_out, f"job timed out after {result.seconds:.0f}s:\n{result.output[-4000:]}"
    return result


def stop_line(result: JobResult) -> str:
    """The runner's account of how it stopped the job."""
    lines = [line for line in result.output.splitlines() if line.startswith("lightning-gaudi-ds: stopped")]
    return lines[-1] if lines else "(the launcher stopped the job by itself)"


def check_two_ranks(out: Path, environment: str, reference: list[float]) -> list[dict]:
    ranks = results(out)
    assert [r["rank"] for r in ranks] == [0, 1], "the strategy must not start processes of its own"
    for r in ranks:
        assert (r["world_size"], r["strategy"], r["global_step"]) == (2, "HPUDeepSpeedStrategy", 2)
        assert r["cluster_environment"] == environment
    assert ranks[0]["step_losses"] == pytest.approx(reference, abs=1e-6)
    return ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Lightning's own launcher (world size 1 = plain python; the script asks for devices=2): rank 0's losses."""
    out = tmp_path_factory.mktemp("lightning_own")
    job = LiveJob([*SPAWN, "--master_port", "0", *train_args(out)])
    result = finish(job)
    assert result.returncode == 0, result.output[-4000:]
    assert "python, world size 1" in result.output
    ranks = results(out)
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["cluster_environment"] == "LightningEnvironment"
    print(f"\nLightning's own launcher: {result.seconds:.1f} s")
    return ranks[0]["step_losses"]


def test_lightning_own_launcher(reference: list[float]) -> None:
    assert len(reference) == 2


def test_deepspeed_launcher(tmp_path: Path, reference: list[float]) -> None:
    job = LiveJob([CONSOLE_SCRIPT, "spawn", "--world_size", "2", "--use_deepspeed", "--master_port", "0",
                   *train_args(tmp_path)])
    result = finish(job)
    assert result.returncode == 0, result.output[-4000:]
    assert "deepspeed.launcher.runner" in result.output
    check_two_ranks(tmp_path, "DeepSpeedLauncherEnvironment", reference)
    print(f"\nDeepSpeed launcher: {result.seconds:.1f} s")


def test_torchrun_with_busy_master_port(tmp_path: Path, reference: list[float]) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = LiveJob([*SPAWN, "--world_size", "2", "--master_port", str(port), *train_args(tmp_path)])
        result = finish(job)
    assert result.returncode == 0, result.output[-4000:]
    assert f"master port {port} is in use on this host; using free port" in result.output
    check_two_ranks(tmp_path, "TorchElasticEnvironment", reference)
    print(f"\ntorchrun: {result.seconds:.1f} s")


def test_mpirun(tmp_path: Path, reference: list[float]) -> None:
    # Not skipped without mpirun: scripts/setup.sh installs Open MPI and mpi4py, so a missing one is a failure.
    job = LiveJob([*SPAWN, "--world_size", "2", "--use_mpi", "--master_port", "0", *train_args(tmp_path)])
    result = finish(job)
    assert result.returncode == 0, result.output[-4000:]
    check_two_ranks(tmp_path, "MPIEnvironment", reference)
    print(f"\nmpirun: {result.seconds:.1f} s")


@pytest.mark.parametrize(("flags", "environment"), [([], "TorchElasticEnvironment"),
                                                     (["--use_deepspeed"], "DeepSpeedLauncherEnvironment")],
                         ids=["torchrun", "deepspeed"])
def test_two_simulated_nodes(tmp_path: Path, reference: list[float], flags: list[str], environment: str) -> None:
    """Two launchers on 127.0.0.1 as node 0 and node 1 (one rank each) reach the losses of 2 local processes."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = str(free_port())
    out = tmp_path / "out"
    jobs = [
        LiveJob([*SPAWN, *flags, "--hostfile", str(hostfile), "--node_rank", str(node), "--master_addr", "127.0.0.1",
                 "--master_port", port, *train_args(out, "--devices", "1", "--num-nodes", "2")])
        for node in (0, 1)
    ]
    outputs = [finish(job) for job in jobs]
    for node, result in enumerate(outputs):
        assert result.returncode == 0, f"node {node}:\n{result.output[-4000:]}"
    ranks = check_two_ranks(out, environment, reference)
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (1, 0)]
    assert ranks[1]["step_losses"] != ranks[0]["step_losses"]  # each node trained on its own shard
    print(f"\ntwo simulated nodes ({environment}): {max(r.seconds for r in outputs):.1f} s")


def test_world_size_mismatch_fails_before_training(tmp_path: Path) -> None:
    job = LiveJob([*SPAWN, "--world_size", "2", "--master_port", "0", *train_args(tmp_path, "--devices", "1")])
    result = finish(job)
    assert result.returncode != 0
    assert "torchrun started 2 processes in all, but `Trainer(devices=1, num_nodes=1)` makes 1" in result.output
    assert "rank " in result.output and "failed" in result.output
    assert not list(tmp_path.glob("rank*.json")) and "injecting" not in result.output


def _rank_process(job: LiveJob, key: str, value: str):
    """The training process (not the shim) of the rank whose environment has key=value."""
    def match(p) -> bool:
        cmd = " ".join(p.cmdline())
        return "train_job.py" in cmd and SHIM not in cmd and p.environ().get(key) == value
    found = job.leftovers(match)
    assert len(found) == 1, f"expected one process with {key}={value}, found {found}"
    return found[0]


FAILURES = {
    # id: (launcher flags, fault, how the rank dies, the rank the runner names, exit code)
    "torchrun-exit": (["--world_size", "2"], "1:1:exit", None, 1, 3),
    "deepspeed-killed": (["--world_size", "2", "--use_deepspeed"], "1:1:hang", ("RANK", "1"), 1, 137),
    "mpirun-raises": (["--world_size", "2", "--use_mpi"], "1:1:raise", None, 1, 1),
    "lightning-killed": ([], "1:1:hang", ("LOCAL_RANK", "1"), 0, None),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_rank_failure_stops_every_rank(tmp_path: Path, case: str) -> None:
    flags, fault, kill_by_env, named_rank, code = FAILURES[case]
    args = [*SPAWN, *flags, "--master_port", "0", *train_args(tmp_path, "--max-steps", "3", "--fault", fault)]
    if case == "torchrun-exit":  # the Python API: run() returns the first non-zero exit code
        api = ("import sys; from lightning_gaudi_ds import DistributedRunner; "
               f"sys.exit(DistributedRunner([{shlex.join(args[len(SPAWN) + 4:])!r}], world_size=2, master_port=0).run())")
        args = [sys.executable, "-c", api]
    job = LiveJob(args)
    mode = fault.rsplit(":", 1)[1]
    failed_at = job.wait_for(f"rank 1: injecting fault '{mode}'", timeout=JOB_TIMEOUT_S)
    if kill_by_env is not None:
        victim = _rank_process(job, *kill_by_env)
        failed_at = time.monotonic()
        victim.kill()
    result = finish(job, timeout=120)
    stopped_after = time.monotonic() - failed_at
    print(f"\n{case}: every process gone {stopped_after:.1f} s after the rank died; {stop_line(result)}")
    assert stopped_after < BOUND_S, result.output[-4000:]
    assert result.returncode != 0, result.output[-4000:]
    if code is not None:
        assert result.returncode == code, result.output[-4000:]
    assert f"lightning-gaudi-ds: rank {named_rank} failed:" in result.output, result.output[-4000:]
    assert "lines of rank" in result.output  # its last output is shown
    if kill_by_env is None:
        shown = result.output.split("lines of rank", 1)[1]
        assert ("injected fault on rank 1" if mode == "raise" else f"injecting fault '{mode}'") in shown
    elif case == "deepspeed-killed":
        assert "rank 1 failed: exited with signal SIGKILL" in result.output


@pytest.mark.parametrize(("sig", "flags"), [(signal.SIGTERM, ["--use_deepspeed"]), (signal.SIGINT, [])],
                         ids=["SIGTERM-deepspeed", "SIGINT-torchrun"])
def test_signal_to_runner_stops_every_rank(tmp_path: Path, sig: signal.Signals, flags: list[str]) -> None:
    """Both ranks sit in a step that ignores SIGTERM (Lightning's handler only takes note): SIGKILL must follow."""
    job = LiveJob([*SPAWN, "--world_size", "2", *flags, "--master_port", "0", "--stop_timeout", "5",
                   *train_args(tmp_path, "--fault=-1:1:hang")])
    job.wait_for("injecting fault 'hang'", count=2, timeout=JOB_TIMEOUT_S)
    sent = time.monotonic()
    job.send_signal(sig)
    result = finish(job, timeout=120)
    stopped_after = time.monotonic() - sent
    print(f"\n{sig.name}: every process gone {stopped_after:.1f} s after the signal; {stop_line(result)}")
    assert stopped_after < BOUND_S
    assert result.returncode == 128 + sig, result.output[-4000:]
    assert f"received {sig.name}: stopping every rank" in result.output
    killed = re.search(r"\((\d+) needed SIGKILL after 5 s\)", result.output)
    assert killed and int(killed.group(1)) >= 1, result.output[-3000:]  # the ranks ignored SIGTERM, as intended
