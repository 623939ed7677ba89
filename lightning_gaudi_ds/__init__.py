"""DeepSpeed ZeRO for Lightning's Trainer on Intel Gaudi HPUs, CUDA GPUs and CPUs.

Importing the package registers the ``hpu_deepspeed*`` strategy names and the ``"hpu"`` accelerator with
Lightning's Trainer and with Fabric, so ``Trainer(strategy="hpu_deepspeed_stage_3", accelerator="hpu")`` and
``Fabric(strategy="hpu_deepspeed_stage_3", accelerator="hpu")`` resolve (Fabric's strategy:
``lightning_gaudi_ds.fabric.HPUDeepSpeedStrategy``). Registration
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
        convert_zero_checkpoint_to_fp32_state_dict,
        export_hf,
        export_safetensors,
    )
    from lightning_gaudi_ds.errors import (
        ArgumentTypeError,
        BuildLockError,
        CheckpointError,
        CheckpointNotFoundError,
        ConfigError,
        ConfigNotFoundError,
        EnvVarError,
        HostfileError,
        IncompleteCheckpointError,
        InvalidArgumentError,
        LaunchError,
        LightningGaudiDSError,
        NotACheckpointError,
        PlanError,
        SetupError,
        UnsafeCheckpointError,
    )
    from lightning_gaudi_ds.launch import DistributedRunner
    from lightning_gaudi_ds.lightning_cli import LightningCLI
    from lightning_gaudi_ds.planning import plan_memory
    from lightning_gaudi_ds.strategy import HPUDeepSpeedStrategy, TensorParallelStrategy

__all__ = [
    "ArgumentTypeError",
    "BuildLockError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ConfigNotFoundError",
    "DistributedRunner",
    "EnvVarError",
    "HPUAccelerator",
    "HPUDeepSpeedStrategy",
    "HostfileError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "LaunchError",
    "LightningCLI",
    "LightningGaudiDSError",
    "NotACheckpointError",
    "PlanError",
    "SetupError",
    "TensorParallelStrategy",
    "UnsafeCheckpointError",
    "__version__",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "export_hf",
    "export_safetensors",
    "plan_memory",
]
try:
    __version__ = version("lightning_gaudi_ds")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

# Public name -> the module that defines it; imported on first access.
_EXPORTS = {
    # The package's errors, all in one module (lightning_gaudi_ds.errors).
    **dict.fromkeys((
        "ArgumentTypeError", "BuildLockError", "CheckpointError", "CheckpointNotFoundError", "ConfigError",
        "ConfigNotFoundError", "EnvVarError", "HostfileError", "IncompleteCheckpointError", "InvalidArgumentError",
        "LaunchError", "LightningGaudiDSError", "NotACheckpointError", "PlanError", "SetupError",
        "UnsafeCheckpointError",
    ), "lightning_gaudi_ds.errors"),
    "DistributedRunner": "lightning_gaudi_ds.launch",
    "HPUAccelerator": "lightning_gaudi_ds.accelerator",
    "HPUDeepSpeedStrategy": "lightning_gaudi_ds.strategy",
    "LightningCLI": "lightning_gaudi_ds.lightning_cli",
    "TensorParallelStrategy": "lightning_gaudi_ds.strategy",
    "convert_zero_checkpoint_to_fp32_state_dict": "lightning_gaudi_ds.checkpoint",
    "export_hf": "lightning_gaudi_ds.checkpoint",
    "export_safetensors": "lightning_gaudi_ds.checkpoint",
    "plan_memory": "lightning_gaudi_ds.planning",
}
# Modules that register themselves with Lightning's registries when imported.
_REGISTERING = ("lightning_gaudi_ds.accelerator", "lightning_gaudi_ds.strategy", "lightning_gaudi_ds.fabric")


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# Bodies of this package's modules (and of ``lightning``) running right now, nested imports counted each.
_importing = 0


def _register() -> None:
    # Importing the strategy while a module of this package is part-way through its body (its own import of
    # Lightning got here) would hand the strategy that module half-built: the outermost module registers instead,
    # once its body completes. A registering module already in sys.modules registers itself when its body completes.
    if _importing or "lightning" not in sys.modules:
        return
    for module in _REGISTERING:
        if module not in sys.modules:
            importlib.import_module(module)
    # Registered: the hook has done its one job and leaves sys.meta_path (no later import goes through it)
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_RegisterAfterImport"]


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: calls :func:`_register` each time ``lightning`` or a module of this package has been
    imported, so the names are registered as soon as Lightning is, and never from inside a half-imported module.
    Once they are, it removes itself from ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "lightning" and not fullname.startswith(__name__ + "."):
            return None
        spec = None
        for finder in sys.meta_path:  # the spec the other finders give
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_then_register(module: ModuleType) -> None:
                global _importing
                _importing += 1
                try:
                    exec_module(module)
                finally:
                    _importing -= 1
                _register()

            spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


if not any(type(finder).__name__ == "_RegisterAfterImport" for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
_register()
