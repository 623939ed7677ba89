"""A SLURM allocation as the hosts of ``lightning-gaudi-ds spawn`` (lightning_gaudi_ds/launch/slurm.py): the hostlist
expanded as ``scontrol show hostnames`` does, the tasks per node, the conflicts refused before anything starts, a
hostfile winning, the ranks' environment without SLURM's variables, and a requeued job counted as a restart. The
cluster itself runs in the multi-node tier (tests/multinode/test_slurm.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lightning_gaudi_ds import errors
from lightning_gaudi_ds.checkpoint import resume
from lightning_gaudi_ds.launch import DistributedRunner, plan, slurm
from lightning_gaudi_ds.launch.slurm import AllocationError, expand_hostlist, expand_tasks_per_node

# what `scontrol show hostnames` printed for each (SLURM 22.05, in the multi-node tier's cluster)
HOSTLISTS = {
    "n[0-1]": "n0 n1",
    "n[01-10]": "n01 n02 n03 n04 n05 n06 n07 n08 n09 n10",
    "n[1-10],x": "n1 n2 n3 n4 n5 n6 n7 n8 n9 n10 x",
    "rack[1-2]-gpu[08-10]": "rack1-gpu08 rack1-gpu09 rack1-gpu10 rack2-gpu08 rack2-gpu09 rack2-gpu10",
    "a1,b[2-3,7],c[001-3]": "a1 b2 b3 b7 c001 c002 c003",
    "n[098-101]": "n098 n099 n100 n101",
    "n[8-10]": "n8 n9 n10",
    "hpu-node7": "hpu-node7",
}
JOB = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_TASKS_PER_NODE": "2(x2)",
       "SLURM_JOB_NUM_NODES": "2"}


@pytest.mark.parametrize("text", list(HOSTLISTS))
def test_hostlists_expand_as_scontrol_does(text: str) -> None:
    assert " ".join(expand_hostlist(text)) == HOSTLISTS[text]


@pytest.mark.parametrize("text", ["", "n[0-1", "n0-1]", "n[a-b]", "n[3-1]", "n[[1]]", "n0,,n1"])
def test_bad_hostlists_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_tasks_per_node_expand() -> None:
    assert expand_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert expand_tasks_per_node("1") == [1]
    with pytest.raises(ValueError):
        expand_tasks_per_node("2(x)")


def test_an_allocation_gives_hosts_and_slots() -> None:
    assert slurm.allocation({}) is None and slurm.allocation({"SLURM_JOB_NODELIST": "n0"}) is None
    found = slurm.allocation({**JOB, "SLURM_TASKS_PER_NODE": "8,4", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert found is not None and [(h.name, h.slots) for h in found.hosts] == [("gpu07", 8), ("gpu08", 4)]
    assert found.world_size == 12 and "SLURM_JOB_NODELIST=gpu[07-08]" in found.source
    assert slurm.allocation({**JOB, "SLURM_NTASKS_PER_NODE": "2"}) is not None  # agrees


@pytest.mark.parametrize(("change", "words"), [
    ({"SLURM_JOB_NODELIST": "n[0-"}, ["SLURM_JOB_NODELIST='n[0-'", "not a SLURM hostlist"]),
    ({"SLURM_JOB_NODELIST": "n0,n0", "SLURM_JOB_NUM_NODES": ""}, ["lists a node twice"]),
    ({"SLURM_JOB_NUM_NODES": "3"}, ["names 2 node(s), but SLURM_JOB_NUM_NODES=3"]),
    ({"SLURM_TASKS_PER_NODE": ""}, ["SLURM_TASKS_PER_NODE is not", "--ntasks-per-node"]),
    ({"SLURM_TASKS_PER_NODE": "2(x3)"}, ["gives 3 node(s) their ranks", "names 2"]),
    ({"SLURM_TASKS_PER_NODE": "x"}, ["SLURM_TASKS_PER_NODE='x'"]),
    ({"SLURM_NTASKS_PER_NODE": "4"}, ["SLURM_NTASKS_PER_NODE=4 (--ntasks-per-node) disagrees with"
                                      " SLURM_TASKS_PER_NODE=2(x2)"]),
])
def test_contradicting_variables_are_named(change: dict[str, str], words: list[str]) -> None:
    with pytest.raises(AllocationError) as raised:
        slurm.allocation({**JOB, **change})
    for word in words:
        assert word in str(raised.value)
    assert isinstance(raised.value, errors.HostfileError) and errors.AllocationError is AllocationError


def test_deepspeed_and_mpirun_take_the_allocation_torchrun_and_a_hostfile_do_not(tmp_path: Path) -> None:
    found = slurm.allocation(JOB)
    for flag in ("use_deepspeed", "use_mpi"):
        spec = plan.resolve(**{flag: True}, allocation=found)  # type: ignore[arg-type]
        assert ([h.name for h in spec.hosts or ()], spec.world_size, spec.across_hosts) == (["n0", "n1"], 4, True)
        assert spec.hostfile is None and spec.allocation is not None and spec.master_addr == "n0"
    assert plan.resolve(world_size=4, use_mpi=True, allocation=found).world_size == 4
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\n")
    assert [h.name for h in plan.resolve(hostfile=hostfile, use_deepspeed=True, allocation=found).hosts or ()] == ["a"]
    assert plan.resolve(world_size=2, allocation=found).hosts is None  # torchrun on this node, as before
    with pytest.raises(AllocationError, match=r"world_size=3, but the SLURM allocation has 4 task\(s\)"):
        plan.resolve(world_size=3, use_deepspeed=True, allocation=found)


def test_the_runner_reads_the_allocation_and_refuses_a_contradiction(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in JOB.items():
        monkeypatch.setenv(key, value)
    runner = DistributedRunner("t.py", use_deepspeed=True)
    assert runner.world_size == 4 and [h.name for h in runner.hosts or ()] == ["n0", "n1"]
    assert DistributedRunner("t.py", world_size=2).hosts is None
    with pytest.raises(AllocationError, match="world_size=8"):
        DistributedRunner("t.py", world_size=8, use_mpi=True)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    with pytest.raises(AllocationError, match="disagrees"):
        DistributedRunner("t.py", use_mpi=True)


def test_a_hostfile_wins_over_the_allocation_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    for key, value in JOB.items():
        monkeypatch.setenv(key, value)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=1\n")
    runner = DistributedRunner("t.py", hostfile=hostfile, use_deepspeed=True)
    assert [h.name for h in runner.hosts or ()] == ["a", "b"] and runner.world_size == 2
    assert runner._ignored_allocation is not None and "SLURM_JOB_NODELIST=n[0-1]" in runner._ignored_allocation
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "garbage")  # unreadable, but not needed: the hostfile is used
    assert DistributedRunner("t.py", hostfile=hostfile, use_mpi=True).world_size == 2


def test_ranks_another_launcher_starts_see_no_slurm_variable(tmp_path: Path) -> None:
    machine = plan.Machine(python="/py", mpirun="/opt/mpirun", as_root=False, cpus=4)
    base = {"PATH": "/bin", "SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURMD_NODENAME": "n0"}
    for spec in (plan.resolve(2), plan.resolve(2, use_mpi=True), plan.resolve(2, use_deepspeed=True)):
        env = plan.launch_env(spec, base, tmp_path, "t", 1, machine)
        assert not [k for k in env if k.startswith("SLURM")] and env["PATH"] == "/bin"
    kept = plan.launch_env(plan.resolve(1), base, tmp_path, "t", 1, machine)  # plain python: the user's Trainer
    assert kept["SLURM_NTASKS"] == "4"


def test_a_requeued_job_is_a_restart() -> None:
    assert resume.restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert resume.restart_count({"SLURM_RESTART_COUNT": "2", "LIGHTNING_GAUDI_DS_RESTART": "3"}) == 3  # the runner's
    assert resume.restart_count({"SLURM_RESTART_COUNT": ""}) == 0
    assert slurm.job_id({"SLURM_JOB_ID": "7"}) == "7"
    assert slurm.job_id({"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "3"}) == "5_3"
    assert slurm.job_id({"SLURM_JOB_ID": "7; rm -rf /"}) is None
    done, said = slurm.requeue({})
    assert not done and "no SLURM_JOB_ID" in said


@pytest.mark.multiprocess
def test_spawn_in_a_requeued_job_tells_its_ranks_the_restart(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a job SLURM requeued twice, the runner's first start is restart 2 for its ranks (they resume)."""
    toy = tmp_path / "toy.py"
    # one write per line: the two ranks share the output, and print's separate writes of its arguments interleave
    toy.write_text("import os, sys\nsys.stdout.write(f\"restart {os.environ['LIGHTNING_GAUDI_DS_RESTART']}"
                   " {[k for k in os.environ if k.startswith('SLURM_')]}\\n\")\n")
    out = tmp_path / "out.txt"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    import subprocess

    code = subprocess.run([sys.executable, "-m", "lightning_gaudi_ds", "spawn", "--world_size", "2", "--master_port",
                           "0", str(toy)], stdout=out.open("w"), stderr=subprocess.STDOUT, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).returncode
    text = out.read_text()
    assert code == 0, text
    assert text.count("restart 2 []") == 2, text  # torchrun's ranks: restart 2, and no SLURM variable


@pytest.mark.parametrize("example", ["slurm/train.sbatch", "kubernetes/mpijob.yaml", "kubernetes/pytorchjob.yaml"])
def test_the_documented_recipes_are_the_tested_files(example: str) -> None:
    """docs/launching.md shows the batch script and the manifests that tests/multinode runs, as they are."""
    from tests.procs import REPO

    text = (REPO / "examples" / example).read_text().rstrip()
    docs = (REPO / "docs" / "launching.md").read_text()
    lang = "shell" if example.endswith(".sbatch") else "yaml"
    assert f"```{lang}\n{text}\n```" in docs, f"docs/launching.md does not show examples/{example} as it is"
