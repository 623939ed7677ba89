"""The package's errors, one family: every class is a :class:`LightningGaudiDSError`, and also the type Lightning
(or torch, or Python) raises in the same situation, so code catching Lightning's errors catches these. A setting
that cannot be used is a ``MisconfigurationException`` and a ``ValueError``; a missing checkpoint a
``FileNotFoundError`` too; a refused pickle an ``UnpicklingError``; a bad argument of the launcher or the planner
a ``ValueError``. Every message names the value, what is allowed and how to fix it.

Standard library only, so that the launcher and the planner (which start without Lightning or torch) raise the
family too: those members are defined in :mod:`lightning_gaudi_ds._base_errors`; the ones that subclass Lightning's
``MisconfigurationException``, in :mod:`lightning_gaudi_ds._lightning_errors`, load from here on first use
(importing them imports Lightning).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_gaudi_ds._base_errors import (
    AllocationError,
    ArgumentTypeError,
    BuildLockError,
    EnvVarError,
    HostfileError,
    InvalidArgumentError,
    LaunchError,
    LightningGaudiDSError,
    ModelLoadError,
    PlanError,
    SetupError,
)

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
