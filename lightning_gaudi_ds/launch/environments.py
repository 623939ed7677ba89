"""Processes started by an external launcher: which one, and does its world size fit the Trainer?

Lightning already detects torchrun (``TorchElasticEnvironment``), mpirun with mpi4py (``MPIEnvironment``)
and its own launcher (``LightningEnvironment``). DeepSpeed's launcher sets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``CROSS_RANK`` (its node rank) but neither ``TORCHELASTIC_RUN_ID`` nor ``NODE_RANK``, so
Lightning falls back to ``LightningEnvironment``, which recomputes the global rank with node rank 0: right on
one node, duplicate ranks on several. :class:`DeepSpeedLauncherEnvironment` reads what that launcher set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    MPIEnvironment,
    TorchElasticEnvironment,
)
from typing_extensions import override

from lightning_gaudi_ds._compat import DEEPSPEED_LAUNCHER_ENV, DEEPSPEED_NODE_RANK_ENV
from lightning_gaudi_ds.errors import LaunchError, SetupError
from lightning_gaudi_ds.launch import envvars
from lightning_gaudi_ds.launch._proc import MPI_SIZE_KEYS
from lightning_gaudi_ds.launch.rendezvous import HOW_TO_START

log = logging.getLogger(__name__)

# Processes per node, as each launcher announces it.
# Processes on this node, as MPI implementations announce it (Open MPI, MPICH/Intel MPI).
_MPI_LOCAL_SIZE_KEYS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
_LOCAL_SIZE_KEYS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


class DeepSpeedLauncherEnvironment(ClusterEnvironment):
    """Ranks started by DeepSpeed's launcher (``deepspeed`` / ``deepspeed.launcher.launch``), on any node."""

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", 29500))

    @staticmethod
    @override
    def detect() -> bool:
        return all(key in os.environ for key in DEEPSPEED_LAUNCHER_ENV) and "TORCHELASTIC_RUN_ID" not in os.environ

    @override
    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    @override
    def set_world_size(self, size: int) -> None:
        log.debug("DeepSpeedLauncherEnvironment: the launcher sets the world size; ignored %s", size)

    @override
    def global_rank(self) -> int:
        return int(os.environ["RANK"])

    @override
    def set_global_rank(self, rank: int) -> None:
        log.debug("DeepSpeedLauncherEnvironment: the launcher sets the global rank; ignored %s", rank)

    @override
    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])

    @override
    def node_rank(self) -> int:
        return int(os.environ.get(DEEPSPEED_NODE_RANK_ENV, 0))

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        check_launcher_world_size(self, num_devices, num_nodes)


def launcher_name(env: ClusterEnvironment) -> str:
    """How a user would call the launcher behind ``env``, for messages."""
    if isinstance(env, TorchElasticEnvironment):
        return "torchrun"
    if isinstance(env, DeepSpeedLauncherEnvironment):
        return "DeepSpeed's launcher"
    if isinstance(env, MPIEnvironment):
        return "mpirun"
    if isinstance(env, LightningEnvironment):
        return "the launcher that set LOCAL_RANK"
    return type(env).__name__


def _mpi_world_size_from_env() -> int | None:
    for key in MPI_SIZE_KEYS:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def _without_mpi_ranks_lightning_can_use(mpi_size: int) -> bool:
    """Whether Lightning's fallback environment would get this mpirun job wrong.

    Without LOCAL_RANK every rank would start processes of its own. habana_frameworks copies Open MPI's
    OMPI_COMM_WORLD_{LOCAL_RANK,RANK,SIZE} into LOCAL_RANK/RANK/WORLD_SIZE when it is imported (before Lightning
    picks an environment), which is enough on one node; across nodes the fallback computes global ranks with node
    rank 0, so nodes would share ranks and wait for each other forever.
    """
    if "LOCAL_RANK" not in os.environ:
        return True
    local = next((int(os.environ[k]) for k in _MPI_LOCAL_SIZE_KEYS if os.environ.get(k, "").isdigit()), None)
    return local is not None and local < mpi_size


def resolve_environment(env: ClusterEnvironment | None) -> ClusterEnvironment | None:
    """The environment to use instead of Lightning's fallback, or ``env`` unchanged.

    Replaces a plain ``LightningEnvironment`` (never one the user passed in a subclass) when DeepSpeed's
    launcher started this process, and refuses to go on under mpirun when Lightning could not see MPI:
    each rank would otherwise start ``devices`` processes of its own.
    """
    if type(env) is not LightningEnvironment:
        return env
    if DeepSpeedLauncherEnvironment.detect():
        return DeepSpeedLauncherEnvironment()
    mpi_size = _mpi_world_size_from_env()
    if mpi_size is not None and mpi_size > 1 and _without_mpi_ranks_lightning_can_use(mpi_size):
        try:
            from mpi4py import MPI  # noqa: F401

            reason = "mpi4py imports, but MPI reported a world size of 1 (is it built against another MPI?)"
        except ImportError as err:
            reason = f"mpi4py cannot be imported ({err})"
        consequence = (
            "every rank would start its own processes" if "LOCAL_RANK" not in os.environ else
            "the ranks of different nodes would get the same global ranks (LOCAL_RANK, copied from Open MPI by"
            " habana_frameworks, is not enough across nodes) and wait for each other forever"
        )
        raise SetupError(
            f"This process was started by mpirun (world size {mpi_size} from the environment), but Lightning"
            f" did not detect MPI: {reason}. Install mpi4py for the MPI that mpirun belongs to"
            f" (`pip install mpi4py`, or `bash scripts/setup.sh`); without it {consequence}."
        )
    return env


def launcher_world_size(env: ClusterEnvironment) -> int | None:
    """The number of processes the external launcher started, or None when unknown or not launched externally."""
    if not env.creates_processes_externally:
        return None
    if isinstance(env, (TorchElasticEnvironment, DeepSpeedLauncherEnvironment, MPIEnvironment)):
        return env.world_size()
    if isinstance(env, LightningEnvironment):
        value = os.environ.get("WORLD_SIZE", "")
        return int(value) if value.isdigit() else None
    return None  # SLURM, LSF, Kubeflow, ...: Lightning validates those itself


def launcher_local_world_size() -> tuple[str, int] | None:
    """(variable, value) of the launcher's processes-per-node announcement, if any."""
    for key in _LOCAL_SIZE_KEYS:
        if os.environ.get(key, "").isdigit():
            return key, int(os.environ[key])
    return None


def launcher_num_nodes(num_nodes: int, environ: Mapping[str, str] = os.environ) -> int:
    """The nodes this job runs on: ``LIGHTNING_GAUDI_DS_NUM_NODES`` when ``lightning-gaudi-ds spawn --min_nodes``
    left hosts out of this restart (only the runner sets it, for its ranks), else ``num_nodes`` (the Trainer's).

    Read whatever the cluster environment: under mpirun with one rank left, Lightning sees no MPI (a world of 1)
    and takes the process for its own launcher's, which would start ``devices x num_nodes`` processes."""
    nodes = envvars.read(envvars.NUM_NODES, environ)
    return num_nodes if nodes is None else nodes


def check_launcher_world_size(env: ClusterEnvironment | None, devices: int, num_nodes: int) -> None:
    """Raise before training when the launcher's process count disagrees with ``devices`` × ``num_nodes``."""
    if env is None:
        return
    world_size = launcher_world_size(env)
    if world_size is None:
        return
    name = launcher_name(env)
    expected = devices * num_nodes
    if world_size != expected:
        per_node, nodes = _split(world_size, num_nodes)
        raise LaunchError(
            f"{name} started {world_size} processes in all, but `Trainer(devices={devices}, num_nodes={num_nodes})`"
            f" makes {devices} × {num_nodes} = {expected}. Either set `Trainer(devices={per_node},"
            f" num_nodes={nodes})`, or launch {expected} processes (e.g. `lightning-gaudi-ds spawn --world_size"
            f" {expected} ...` on one node)."
        )
    local = launcher_local_world_size()
    if local is not None and local[1] != devices:
        key, value = local
        raise LaunchError(
            f"{name} started {value} processes on this node ({key}={value}), but `Trainer(devices={devices})`"
            f" expects {devices} per node. Set `Trainer(devices={value}, num_nodes={world_size // max(value, 1)})`"
            f" or start {devices} processes per node."
        )


def _split(world_size: int, num_nodes: int) -> tuple[int, int]:
    """A devices/num_nodes suggestion for ``world_size`` processes, keeping num_nodes when it divides."""
    if num_nodes > 0 and world_size % num_nodes == 0:
        return world_size // num_nodes, num_nodes
    return world_size, 1


# What a hand-started multi-node run sets on every node for Lightning's default environment (Lightning's docs).
_NODE_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE")


def check_multi_node_environment(env: ClusterEnvironment | None, num_nodes: int,
                                 environ: Mapping[str, str] = os.environ) -> None:
    """Refuse ``num_nodes > 1`` where nothing could ever start or reach another node: Lightning's default
    environment spawning the devices itself (no launcher, no SLURM/MPI/torchrun/... environment) and none of
    MASTER_ADDR, MASTER_PORT, NODE_RANK, GROUP_RANK, WORLD_SIZE set. Rank 0 would wait for the rendezvous time-out."""
    if num_nodes <= 1 or type(env) is not LightningEnvironment or env.creates_processes_externally:
        return
    if any(environ.get(key) for key in _NODE_ENV_KEYS):
        return  # started by hand on each node (or the others are reached through these): wait, bounded
    from lightning_gaudi_ds.errors import ConfigError

    raise ConfigError(
        f"Trainer(num_nodes={num_nodes}), but this process runs on its own: no launcher started it, no cluster"
        f" environment (SLURM, torchrun, mpirun, ...) was detected, and none of {', '.join(_NODE_ENV_KEYS)} is set,"
        f" so no other node could ever join. {HOW_TO_START}"
    )
