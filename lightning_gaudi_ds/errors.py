"""The package's errors, in one place. Each is also the type Lightning (or torch) raises in the same situation, so
that code catching Lightning's errors catches these: a setting that cannot be used is a
``MisconfigurationException`` and a ``ValueError``, a missing checkpoint a ``FileNotFoundError`` too, a refused
pickle an ``UnpicklingError``. Every message names the value, what is allowed and how to fix it.

The classes are importable from where they were first defined as well (``lightning_gaudi_ds.config``,
``lightning_gaudi_ds.checkpoint``, ``lightning_gaudi_ds.jit_ops``, ``lightning_gaudi_ds.launch.hostfile``,
``lightning_gaudi_ds.launch.slurm``).
"""

from __future__ import annotations

import pickle

from lightning.fabric.utilities.exceptions import MisconfigurationException

__all__ = [
    "AllocationError",
    "BuildLockError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ConfigNotFoundError",
    "EnvVarError",
    "HostfileError",
    "IncompleteCheckpointError",
    "NotACheckpointError",
    "UnsafeCheckpointError",
]


# ------------------------------------------------------------------------------------------ settings
class ConfigError(MisconfigurationException, ValueError):
    """A DeepSpeed config, strategy argument or Trainer setting that cannot be used as given; the message lists every
    problem found. A ``MisconfigurationException``, as Lightning raises in the same situations, and a ``ValueError``."""


class ConfigNotFoundError(ConfigError, FileNotFoundError):
    """The DeepSpeed config path does not exist (Lightning: ``MisconfigurationException``)."""


# ---------------------------------------------------------------------------------------- checkpoints
class CheckpointError(MisconfigurationException, ValueError):
    """The path is not a usable DeepSpeed ZeRO checkpoint; the message says why and what to do. A
    ``MisconfigurationException``, as Lightning raises when DeepSpeed cannot load a checkpoint, and a ``ValueError``."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist (Lightning: ``FileNotFoundError``)."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path is a file, a folder inside a checkpoint or any other folder (Lightning: ``FileNotFoundError``, "not a
    valid DeepSpeed checkpoint")."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """The checkpoint was not completely written (a save was interrupted); the message names what is missing. A
    ``FileNotFoundError`` too, as DeepSpeed's loader raises for a missing shard."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file holds objects that torch's safe unpickler (``weights_only=True``) refuses to build: loading it
    could run code from the file. An ``UnpicklingError``, as ``torch.load`` raises for it."""


# ------------------------------------------------------------------------------------------- op builds
class BuildLockError(RuntimeError):
    """A torch extension build lock that cannot be judged safe to wait on or to clear."""


# The launcher's own errors are defined beside the hostfile parser, which `lightning-gaudi-ds spawn --help` imports
# without Lightning or torch, and the environment variables, which the rank shim reads without the package (this
# module imports Lightning for MisconfigurationException); re-exported here.
from lightning_gaudi_ds.launch.envvars import EnvVarError  # noqa: E402
from lightning_gaudi_ds.launch.hostfile import HostfileError  # noqa: E402
from lightning_gaudi_ds.launch.slurm import AllocationError  # noqa: E402
