"""Launching on Gaudi: the execution mode reaches every rank, mpirun binds cores and forwards the Gaudi settings,
and an mpirun job is recognised from Open MPI's own variables even after habana_frameworks rewrote LOCAL_RANK.

Commands and environments are checked as data (the launcher is not run); the MPI check runs against the
habana_frameworks double, whose import copies OMPI_COMM_WORLD_* into LOCAL_RANK/RANK/WORLD_SIZE as hccl's does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds.launch import plan
from lightning_gaudi_ds.launch.environments import resolve_environment
from lightning_gaudi_ds.launch.runner import DistributedRunner, add_arguments
from tests import hpu_double
from tests.test_launch import launcher_env  # noqa: F401  (fixture)

GAUDI = plan.Machine(python="/py", mpirun="/opt/mpirun", as_root=False, cpus=192, gaudi=True, physical_cores=96,
                     gaudi_env=("HABANA_VISIBLE_MODULES", "HCCL_SOCKET_IFNAME", "LD_LIBRARY_PATH"))
CPU = plan.Machine(python="/py", mpirun="/opt/mpirun", as_root=False, cpus=192)


def exported(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "-x"]


def test_mpirun_on_gaudi_binds_each_rank_to_its_cores_and_forwards_gaudi_settings(tmp_path: Path) -> None:
    argv = plan.launch_argv(plan.resolve(8, use_mpi=True), ["t.py"], 1, GAUDI)
    assert argv[3:9] == ["--bind-to", "core", "--map-by", "socket:PE=12", "--rank-by", "slot"]
    assert {"PT_HPU_LAZY_MODE", "HABANA_VISIBLE_MODULES", "HCCL_SOCKET_IFNAME", "LD_LIBRARY_PATH",
            "MASTER_ADDR"} <= set(exported(argv))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=8\nb slots=8\n")
    multi = plan.launch_argv(plan.resolve(16, hostfile, use_mpi=True), ["t.py"], 1, GAUDI)
    assert "socket:PE=12" in multi and multi[multi.index("--hostfile") + 1] == str(hostfile.resolve())
    cpu = plan.launch_argv(plan.resolve(8, use_mpi=True), ["t.py"], 1, CPU)
    assert cpu[3:5] == ["--bind-to", "none"] and "PT_HPU_LAZY_MODE" not in exported(cpu)


@pytest.mark.parametrize("launcher", [{}, {"world_size": 2}, {"world_size": 2, "use_deepspeed": True},
                                      {"world_size": 2, "use_mpi": True}])
def test_every_launcher_exports_the_mode_to_the_ranks(tmp_path: Path, launcher: dict) -> None:
    def mode(spec: plan.LaunchSpec, base: dict, machine: plan.Machine = GAUDI) -> str | None:
        return plan.launch_env(spec, base, tmp_path, "tok", 1, machine).get("PT_HPU_LAZY_MODE")

    assert mode(plan.resolve(**launcher), {}) == "0"  # unset: eager, spelled out for every rank
    assert mode(plan.resolve(**launcher), {"PT_HPU_LAZY_MODE": "1"}) == "1"
    assert mode(plan.resolve(**launcher, hpu_mode="lazy"), {"PT_HPU_LAZY_MODE": "0"}) == "1"
    assert mode(plan.resolve(**launcher, hpu_mode="eager"), {}, CPU) == "0"
    assert mode(plan.resolve(**launcher), {}, CPU) is None  # no Gaudi: nothing added


def test_deepspeed_multi_node_gaudi_launch_writes_its_env_file_keeping_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1")
    for key in ("PT_HPU_LAZY_MODE", *hpu.ENV_DEFAULTS):
        monkeypatch.delenv(key, raising=False)
    hostfile = work / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    runner = DistributedRunner(["t.py"], hostfile=hostfile, use_deepspeed=True, hpu_mode="lazy")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = runner._environment(run_dir, "tok", 29500)
    assert env["DS_ENV_FILE"] == str(run_dir / "deepspeed_env")
    lines = (run_dir / "deepspeed_env").read_text().splitlines()
    assert lines[0] == "NCCL_DEBUG=INFO" and {"PT_HPU_LAZY_MODE=1", "HABANA_VISIBLE_MODULES=0,1"} <= set(lines)
    defaults = {f"{k}={v}" for k, v in hpu.ENV_DEFAULTS.items()}  # the ranks get them, not the runner's process
    assert defaults <= set(lines) and all(env[k] == v for k, v in hpu.ENV_DEFAULTS.items())
    one_node = DistributedRunner(["t.py"], world_size=2, use_deepspeed=True, hpu_mode="lazy")
    assert "DS_ENV_FILE" not in one_node._environment(run_dir, "tok", 29500)  # local ranks inherit the env


def test_spawn_cli_takes_hpu_mode() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--world_size", "2", "--hpu_mode", "lazy", "t.py"])
    assert args.hpu_mode == "lazy"
    with pytest.raises(ValueError, match=r"^hpu_mode='graph' is not a Gaudi execution mode\. Use 'eager'"):
        DistributedRunner(["t.py"], hpu_mode="graph")


# ------------------------------------------------------------------------------------------------- MPI (point 6)
def _mpirun_rank(launcher_env, monkeypatch: pytest.MonkeyPatch, world: int, per_node: int) -> None:  # noqa: F811
    launcher_env(OMPI_COMM_WORLD_SIZE=world, OMPI_COMM_WORLD_RANK=per_node + 1, OMPI_COMM_WORLD_LOCAL_RANK=1,
                 OMPI_COMM_WORLD_LOCAL_SIZE=per_node)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails: Lightning cannot see MPI
    hpu_double.install(monkeypatch, deepspeed_detects=False)  # hccl's import copies OMPI_* into LOCAL_RANK etc.


def test_multi_node_mpirun_without_mpi4py_is_refused_although_hccl_set_local_rank(
    launcher_env, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    _mpirun_rank(launcher_env, monkeypatch, world=16, per_node=8)
    import os

    assert os.environ["LOCAL_RANK"] == "1" and os.environ["RANK"] == "9"
    with pytest.raises(RuntimeError, match=r"world size 16.*mpi4py cannot be imported.*same global ranks"):
        resolve_environment(LightningEnvironment())


def test_single_node_mpirun_with_hccl_ranks_is_left_to_lightning(
    launcher_env, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    _mpirun_rank(launcher_env, monkeypatch, world=8, per_node=8)
    env = LightningEnvironment()
    assert resolve_environment(env) is env
