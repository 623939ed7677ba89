"""DeepSpeed ZeRO for Lightning's Trainer on Intel Gaudi HPUs, CUDA GPUs and CPUs.

Importing the package registers the ``hpu_deepspeed*`` strategy names and the ``"hpu"`` accelerator with
Lightning, so ``Trainer(strategy="hpu_deepspeed_stage_3", accelerator="hpu")`` resolves. Registration
overrides earlier entries of the same name, so importing (or reloading) twice is harmless.

The package itself imports neither torch, Lightning nor DeepSpeed, so that ``lightning-gaudi-ds --help`` and the
launcher start in a fraction of a second: the names below load on first use, and the strategy and accelerator
modules (which register themselves) are imported as soon as Lightning is: at once if it already is, otherwise
right after ``import lightning`` completes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gaudi_ds.accelerator import HPUAccelerator
    from lightning_gaudi_ds.checkpoint import (
        CheckpointError,
        CheckpointNotFoundError,
        IncompleteCheckpointError,
        convert_zero_checkpoint_to_fp32_state_dict,
    )
    from lightning_gaudi_ds.config import ConfigError
    from lightning_gaudi_ds.launch import DistributedRunner, HostfileError
    from lightning_gaudi_ds.ops import BuildLockError
    from lightning_gaudi_ds.planning import plan_memory
    from lightning_gaudi_ds.strategy import HPUDeepSpeedStrategy

__all__ = [
    "BuildLockError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "DistributedRunner",
    "HPUAccelerator",
    "HPUDeepSpeedStrategy",
    "HostfileError",
    "IncompleteCheckpointError",
    "__version__",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "plan_memory",
]
try:
    __version__ = version("lightning_gaudi_ds")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

# Public name -> the module that defines it; imported on first access.
_EXPORTS = {
    "BuildLockError": "lightning_gaudi_ds.ops",
    "CheckpointError": "lightning_gaudi_ds.checkpoint",
    "CheckpointNotFoundError": "lightning_gaudi_ds.checkpoint",
    "ConfigError": "lightning_gaudi_ds.config",
    "DistributedRunner": "lightning_gaudi_ds.launch",
    "HPUAccelerator": "lightning_gaudi_ds.accelerator",
    "HPUDeepSpeedStrategy": "lightning_gaudi_ds.strategy",
    "HostfileError": "lightning_gaudi_ds.launch",
    "IncompleteCheckpointError": "lightning_gaudi_ds.checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict": "lightning_gaudi_ds.checkpoint",
    "plan_memory": "lightning_gaudi_ds.planning",
}
# Modules that register themselves with Lightning's registries when imported.
_REGISTERING = ("lightning_gaudi_ds.accelerator", "lightning_gaudi_ds.strategy")


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _register() -> None:
    # A module already in sys.modules is imported or being imported (its own import of Lightning got here):
    # either way it registers itself when its body completes.
    for module in _REGISTERING:
        if module not in sys.modules:
            importlib.import_module(module)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: makes the next import of ``lightning`` call :func:`_register` once it completes."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_then_register(module: ModuleType) -> None:
                exec_module(module)
                _register()

            spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


if "lightning" in sys.modules:
    _register()
elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterLightning())
