"""DeepSpeed ZeRO for Lightning's Trainer on Intel Gaudi HPUs, CUDA GPUs and CPUs.

Importing the package registers the ``hpu_deepspeed*`` strategy names and the ``"hpu"`` accelerator with
Lightning, so ``Trainer(strategy="hpu_deepspeed_stage_3", accelerator="hpu")`` resolves. Registration
overrides earlier entries of the same name, so importing (or reloading) twice is harmless.
"""

from importlib.metadata import PackageNotFoundError, version

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

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

HPUDeepSpeedStrategy.register_strategies(StrategyRegistry)
HPUAccelerator.register_accelerators(AcceleratorRegistry)
