"""The members of the error family (:mod:`lightning_gaudi_ds.errors`) that are also Lightning's
``MisconfigurationException``, as Lightning raises it for the same situations. Import them from
:mod:`lightning_gaudi_ds.errors`, which loads this module on first use."""

from __future__ import annotations

import pickle

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_gaudi_ds._base_errors import LightningGaudiDSError

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ConfigNotFoundError",
    "IncompleteCheckpointError",
    "NotACheckpointError",
    "UnsafeCheckpointError",
]


# ------------------------------------------------------------------------------------------ settings
class ConfigError(LightningGaudiDSError, MisconfigurationException, ValueError):
    """A DeepSpeed config, strategy argument or Trainer setting that cannot be used as given; the message lists every
    problem found. A ``MisconfigurationException``, as Lightning raises in the same situations, and a ``ValueError``."""


class ConfigNotFoundError(ConfigError, FileNotFoundError):
    """The DeepSpeed config path does not exist (Lightning: ``MisconfigurationException``)."""


# ---------------------------------------------------------------------------------------- checkpoints
class CheckpointError(LightningGaudiDSError, MisconfigurationException, ValueError):
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
