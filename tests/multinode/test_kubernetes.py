"""The Kubernetes recipes of docs/launching.md (examples/kubernetes/*.yaml), run through the two hosts as their pods
would run them: what each manifest's containers run, with the environment and files its operator gives them.

- MPI Operator (``MPIJob``): the launcher runs ``lightning-gaudi-ds spawn --hostfile /etc/mpi/hostfile --use_mpi``
  with the operator's ``OMPI_MCA_*`` settings and a hostfile in its format (``<worker> slots=<slotsPerWorker>``).
- ``PyTorchJob``: every pod runs ``torchrun`` with the operator's ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
  ``RANK`` and ``PET_*`` variables, and nothing else telling it where it runs.

The manifests ask for 8 ranks a node (``slotsPerWorker``, ``nprocPerNode``); here each host runs 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.multinode.cluster import Cluster
from tests.multinode.test_multinode import ARGV_JOB, COLLECTIVE, finish
from tests.procs import REPO, LiveJob, free_port

pytestmark = [pytest.mark.multinode, pytest.mark.multiprocess]

MANIFESTS = REPO / "examples" / "kubernetes"


def containers(kind: str, replica: str) -> list[dict[str, Any]]:
    manifest = yaml.safe_load((MANIFESTS / f"{kind}.yaml").read_text())
    specs = manifest["spec"]["mpiReplicaSpecs" if kind == "mpijob" else "pytorchReplicaSpecs"]
    return specs[replica]["template"]["spec"]["containers"]


def test_the_mpijob_launcher_command_runs_both_workers(clean: Cluster, tmp_path: Path) -> None:
    [launcher] = containers("mpijob", "Launcher")
    command = launcher["command"]
    assert command[:2] == ["lightning-gaudi-ds", "spawn"] and "--use_mpi" in command
    flags, script = command[2:command.index("train.py")], command[command.index("train.py"):]
    hostfile = tmp_path / "hostfile"  # the operator's /etc/mpi/hostfile: one line per worker pod
    hostfile.write_text("".join(f"{h.name} slots=1\n" for h in clean.hosts))
    flags = [str(hostfile) if f == "/etc/mpi/hostfile" else f for f in flags]
    out = tmp_path / "out"
    out.mkdir()
    operator_env = {"OMPI_MCA_orte_default_hostfile": str(hostfile),
                    "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                    "OMPI_MCA_orte_keep_fqdn_hostnames": "true", "OMPI_MCA_orte_set_default_slots": "1"}
    job = LiveJob([*clean.hosts[0].enter(tmp_path), sys.executable, "-m", "lightning_gaudi_ds", "spawn", *flags,
                   ARGV_JOB, str(out), *script[1:]], env={**clean.env(), **operator_env}, cwd=tmp_path)
    [result] = finish(clean, job, timeout=120)
    print(f"\nMPIJob launcher command: {result.seconds:.1f} s")
    assert result.returncode == 0, result.output[-4000:]
    found = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["host"], r["world_size"], r["args"]) for r in found] == [
        (f"n{r}", "2", ["--lr", "3e-4"]) for r in (0, 1)], found


def test_the_pytorchjob_environment_starts_torchrun_on_both_pods(clean: Cluster, tmp_path: Path) -> None:
    commands = [containers("pytorchjob", replica)[0]["command"] for replica in ("Master", "Worker")]
    assert all(c == ["torchrun", "train.py", "--lr", "3e-4"] for c in commands), commands
    port = str(free_port())
    jobs = []
    for rank, host in enumerate(clean.hosts):  # the pods: Master-0 (RANK 0), Worker-0 (RANK 1)
        operator_env = {"MASTER_ADDR": "n0", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(rank),
                        "PET_MASTER_ADDR": "n0", "PET_MASTER_PORT": port, "PET_NNODES": "2",
                        "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1"}
        jobs.append(LiveJob([*host.enter(tmp_path), sys.executable, "-m", "torch.distributed.run", COLLECTIVE,
                             "--seconds", "1"], env={**clean.env(), **operator_env}, cwd=tmp_path))
    results = finish(clean, *jobs, timeout=120)
    print(f"\nPyTorchJob pods (torchrun from the operator's environment): {max(r.seconds for r in results):.1f} s")
    for rank, result in enumerate(results):
        assert result.returncode == 0, result.output[-4000:]
        assert f"rank {rank} on n{rank}: step 0 sum 2" in result.output, result.output[-3000:]
