"""The package's errors, one family: every class is a :class:`LightningGaudiDSError`, and also the type Lightning
(or torch, or Python) raises in the same situation, so code catching Lightning's errors catches these. A setting
that cannot be used is a ``MisconfigurationException`` and a ``ValueError``; a missing checkpoint a
``FileNotFoundError`` too; a refused pickle an ``UnpicklingError``; a bad argument of the launcher or the planner
a ``ValueError``. Every message names the value, what is allowed and how to fix it.

Standard library only, so that the launcher and the planner (which start without Lightning or torch) raise the
family too. The classes that subclass Lightning's ``MisconfigurationException`` are defined in
:mod:`lightning_gaudi_ds._lightning_errors` and load from here on first use (importing them imports Lightning).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gaudi_ds._lightning_errors import (
        CheckpointError,
        CheckpointNotFoundError,
        ConfigError,
        ConfigNotFoundError,
        IncompleteCheckpointError,
        NotACheckpointError,
        UnsafeCheckpointError,
    )

__all__ = [
    "AllocationError",
    "ArgumentTypeError",
    "BuildLockError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ConfigNotFoundError",
    "EnvVarError",
    "HostfileError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "LaunchError",
    "LightningGaudiDSError",
    "ModelLoadError",
    "NotACheckpointError",
    "PlanError",
    "SetupError",
    "UnsafeCheckpointError",
]


class LightningGaudiDSError(Exception):
    """The base of every error this package raises."""


# ------------------------------------------------------------- arguments outside the Trainer and Fabric
class InvalidArgumentError(LightningGaudiDSError, ValueError):
    """An argument that cannot be used as given (a ``ValueError``, as Python raises for a bad value)."""


class ArgumentTypeError(LightningGaudiDSError, TypeError):
    """An argument of the wrong type (a ``TypeError``, as Python raises for one)."""


class LaunchError(InvalidArgumentError):
    """An argument of ``lightning-gaudi-ds spawn`` or :class:`~lightning_gaudi_ds.DistributedRunner` that cannot be
    used."""


class HostfileError(LaunchError):
    """A hostfile line that DeepSpeed's and Open MPI's runners would refuse or misread."""


class AllocationError(HostfileError):
    """The SLURM allocation's variables cannot be read as the hosts of a launch, or disagree with each other or with
    the launch's arguments. A ``HostfileError``: the allocation stands in for the hostfile."""


class EnvVarError(InvalidArgumentError):
    """A package environment variable holds a value that cannot be used; the message names the variable, the value
    and what is allowed."""


class PlanError(InvalidArgumentError):
    """An input of the memory planner (``lightning-gaudi-ds plan``, :func:`~lightning_gaudi_ds.plan_memory`) that
    cannot be used."""


class ModelLoadError(LightningGaudiDSError, OSError):
    """A Hugging Face model that ``from_pretrained`` cannot load as named (an ``OSError``, as transformers raises);
    the message names the model id or the file, and what to do."""


# ----------------------------------------------------------------------------------- the machine
class SetupError(LightningGaudiDSError, RuntimeError):
    """This process or machine lacks what the request needs (the Gaudi software stack, ``mpirun``, the devices, a
    rank that never joined): a ``RuntimeError``, as torch and Lightning raise in these situations."""


class BuildLockError(SetupError):
    """A torch extension build lock that cannot be judged safe to wait on or to clear."""


# Defined with Lightning's MisconfigurationException as a base (lightning_gaudi_ds._lightning_errors).
_LIGHTNING_TYPED = frozenset({
    "CheckpointError", "CheckpointNotFoundError", "ConfigError", "ConfigNotFoundError", "IncompleteCheckpointError",
    "NotACheckpointError", "UnsafeCheckpointError",
})


def __getattr__(name: str) -> Any:
    if name not in _LIGHTNING_TYPED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("lightning_gaudi_ds._lightning_errors"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LIGHTNING_TYPED})
