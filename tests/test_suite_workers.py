"""The suite on pytest-xdist workers (tests/conftest.py): tests that share a module- or session-scoped fixture run on
one worker, so each such fixture is made once; the multi-node tier is handed out first. Checked on a small suite of
its own, run by real workers with this suite's conftest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.procs import REPO, run_job

SUITE = '''
import json, os, time
import pytest

def record(kind, name):
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps({"kind": kind, "name": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                            "at": time.time()}) + "\\n")

@pytest.fixture(scope="session")
def hosts():
    record("fixture", "hosts")
    return "hosts"

@pytest.fixture(scope="module")
def job():
    record("fixture", "job")
    return "job"

@pytest.fixture(scope="module")
def other_job(hosts):
    record("fixture", "other_job")
    return "other"

@pytest.mark.parametrize("i", range(4))
def test_uses_the_job(job, i):
    record("test", f"job{i}")
    time.sleep(0.2)

@pytest.mark.parametrize("i", range(3))
def test_uses_the_hosts(hosts, i):
    record("test", f"hosts{i}")
    time.sleep(0.2)

def test_uses_both_through_a_fixture(other_job):
    record("test", "other")

@pytest.mark.multinode
def test_on_the_hosts_first(hosts):
    record("test", "multinode")

@pytest.mark.parametrize("i", range(6))
def test_alone(tmp_path, i):
    record("test", f"alone{i}")
    time.sleep(0.2)
'''


@pytest.mark.multiprocess
def test_workers_make_each_shared_fixture_once_and_start_with_the_multinode_tier(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.conftest import *  # noqa: F401,F403  (its hooks and fixtures)\n")
    (suite / "test_shared.py").write_text(SUITE)
    record = tmp_path / "record.jsonl"
    done = run_job([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                    "--no-loadscope-reorder", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(suite),
                    str(suite)], timeout=300, cwd=suite, env={"RECORD": str(record), "PYTHONPATH": str(REPO),
                                                   "LGDS_SUITE_TIMES": None})  # not the outer suite's times
    assert done.returncode == 0 and "15 passed" in done.output, done.output[-3000:]
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    made = [r["name"] for r in rows if r["kind"] == "fixture"]
    assert sorted(made) == ["hosts", "job", "other_job"], made  # each once, on whichever worker
    worker = {r["name"]: r["worker"] for r in rows if r["kind"] == "test"}
    assert len({worker[f"job{i}"] for i in range(4)}) == 1
    hosts_group = {worker[f"hosts{i}"] for i in range(3)} | {worker["other"], worker["multinode"]}
    assert len(hosts_group) == 1, worker  # the session fixture, directly or through a module fixture
    assert len(set(worker.values())) == 2  # both workers ran tests
    first = min((r for r in rows if r["worker"] == worker["multinode"]), key=lambda r: r["at"])
    assert first["name"] == "hosts", rows  # the multi-node group was its worker's first work, not its last


def test_a_failed_jobs_message_shows_every_ranks_traceback_and_keeps_the_whole_output() -> None:
    """Two ranks' outputs interleave: rank 1's traceback can lie before a tail that is all rank 0's."""
    from tests.procs import JobResult

    output = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"job.py\", line 3\n"
              "[rank1]: RuntimeError: the cause\n" + "[rank0]: waiting\n" * 400)
    with pytest.raises(AssertionError) as failed:
        JobResult(1, output, 2.0, False).check()
    message = str(failed.value)
    assert "a traceback before the tail ---\n[rank1]: Traceback" in message and "RuntimeError: the cause" in message
    saved = Path(message.split("whole output in ", 1)[1].split(";", 1)[0])
    assert saved.read_text() == output
    saved.unlink()


STORE_JOB = '''
import os
from datetime import timedelta
import torch.distributed as dist

# The attempt on the held port fails at once on rank 0; rank 1 then waits for the store only 2 s, not a minute.
lost = os.environ["MASTER_PORT"] == os.environ["HELD_PORT"]
dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                        timeout=timedelta(seconds=2 if lost else 120))
dist.barrier()
print(f"rank {dist.get_rank()} met on port {os.environ['MASTER_PORT']}", flush=True)
dist.destroy_process_group()
'''


@pytest.mark.multiprocess
def test_a_job_whose_store_lost_the_harness_port_runs_again_on_another(tmp_path: Path, monkeypatch) -> None:
    """The harness picks MASTER_PORT and rank 0 binds it seconds later; a port taken in between (EADDRINUSE, as a
    busy CI machine once did) makes the job run again on another port, not fail the test."""
    import socket
    import warnings

    import tests.procs as procs

    with socket.socket() as held:
        held.bind(("", 0))  # bound, not listening: rank 1's store client is refused (and retries for 2 s)
        taken = held.getsockname()[1]
        picks, real_pick = iter([taken]), procs.free_port
        monkeypatch.setattr(procs, "free_port", lambda: next(picks, None) or real_pick())
        script = tmp_path / "store_job.py"
        script.write_text(STORE_JOB)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = procs.run_job([sys.executable, str(script)], timeout=120, ranks=2,
                                   env={"HELD_PORT": str(taken)})
    result.check()
    met = [line.rsplit(" ", 1)[1] for line in result.output.splitlines() if " met on port " in line]
    assert len(met) == 2 and len(set(met)) == 1 and met[0] != str(taken), result.output  # both ranks, a new port
    assert [str(w.message) for w in seen if f"port {taken} taken" in str(w.message)], [str(w.message) for w in seen]


def test_only_rank_0s_store_losing_the_harness_port_counts_as_a_lost_port() -> None:
    from tests.procs import JobResult, store_port_taken

    lost = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address."
            " port: 22395, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n")
    assert store_port_taken(JobResult(1, lost, 2.0, False), 22395)
    assert not store_port_taken(JobResult(1, lost, 2.0, False), 22396)  # another port: the test's own
    assert not store_port_taken(JobResult(1, lost, 300.0, True), 22395)  # timed out: a failure to report
    assert not store_port_taken(JobResult(1, "RuntimeError: loss is nan\n", 2.0, False), 22395)


MPI_PROBE = '''
import os
from mpi4py import MPI  # as Lightning's MPIEnvironment.detect() does in every rank

assert MPI.COMM_WORLD.Get_size() == 1
base = os.environ["OMPI_MCA_orte_tmpdir_base"]
print(f"rank {os.environ.get('LOCAL_RANK')} base {base} {sorted(os.listdir(base))}", flush=True)
'''


@pytest.mark.multiprocess
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_each_job_and_each_warm_rank_has_its_own_open_mpi_session_base(tmp_path: Path, warm: bool) -> None:
    """Isolated singletons share a job id, so a session directory: one job's rank ending removed the tree while the
    other worker's rank made it, and MPI_Init aborted (once in 15 runs of the suite). Jobs, and warm ranks within a
    job, get a base each, inside this process's."""
    pytest.importorskip("mpi4py")
    import os

    probe = tmp_path / "probe.py"
    probe.write_text(MPI_PROBE)
    ours = os.environ["OMPI_MCA_orte_tmpdir_base"]
    first, second = (run_job([sys.executable, str(probe)], timeout=120, ranks=2 if warm else None).check()
                     for _ in range(2))
    lines = [line.split() for job in (first, second) for line in job.output.splitlines() if " base " in line]
    bases = [Path(words[3]) for words in lines]
    assert all("'ompi." in " ".join(words[4:]) for words in lines), lines  # Open MPI's tree is in that base
    jobs = {base.parent if warm else base for base in bases}
    assert len(jobs) == 2 and all(job.parent == Path(ours) for job in jobs), bases
    if warm:
        assert len(set(bases)) == 4 and {base.name for base in bases} == {"rank0", "rank1"}
