"""One table of what each device type needs: process-group backend, DeepSpeed accelerator, precisions.

Nothing here imports a hardware SDK at module level; detection imports ``habana_frameworks`` lazily.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch

log = logging.getLogger(__name__)

ALL_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")


@dataclass(frozen=True)
class DeviceSpec:
    """What the strategy needs to know about one device type."""

    device_type: str
    backend: str  # torch.distributed process-group backend
    deepspeed_accelerator: str  # value of DS_ACCELERATOR
    precisions: tuple[str, ...]
    env_defaults: Mapping[str, str] = field(default_factory=dict)


DEVICES: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec("cpu", "gloo", "cpu", ("32-true", "bf16-mixed", "bf16-true")),
    "cuda": DeviceSpec("cuda", "nccl", "cuda", ALL_PRECISIONS),
    "hpu": DeviceSpec(
        "hpu",
        "hccl",
        "hpu",
        ALL_PRECISIONS,
        env_defaults={
            "DEEPSPEED_USE_HPU": "true",
            "PT_HPU_LAZY_ACC_PAR_MODE": "0",
            "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES": "0",
        },
    ),
}


def device_spec(device: torch.device | str) -> DeviceSpec:
    """Return the table row for ``device`` (a ``torch.device`` or a type name)."""
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    try:
        return DEVICES[device_type]
    except KeyError:
        raise ValueError(
            f"Device type {device_type!r} is not supported by HPUDeepSpeedStrategy."
            f" Supported: {', '.join(DEVICES)}. Use Trainer(accelerator='hpu' | 'cuda' | 'cpu')."
        ) from None


def validate_precision(precision: str, device: torch.device | str) -> None:
    """Fail loudly when ``precision`` cannot run on ``device``."""
    spec = device_spec(device)
    if precision not in spec.precisions:
        hint = " fp16 has no fast path on CPU; use precision='bf16-mixed'." if precision.startswith("16") else ""
        raise ValueError(
            f"`Trainer(precision={precision!r})` is not supported by HPUDeepSpeedStrategy on {spec.device_type!r}."
            f" Supported on {spec.device_type}: {', '.join(spec.precisions)}.{hint}"
        )


def apply_env_defaults(spec: DeviceSpec) -> dict[str, str]:
    """Set ``spec.env_defaults`` where unset; return (and log) what was set."""
    applied = {}
    for key, value in spec.env_defaults.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    if applied:
        log.info("HPUDeepSpeedStrategy set environment defaults: %s", applied)
    return applied


def habana_frameworks_installed() -> bool:
    """Whether the Gaudi software stack can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("habana_frameworks.torch") is not None
    except (ModuleNotFoundError, ValueError):  # ValueError: a module in sys.modules without __spec__
        return False


def hpu_available() -> bool:
    """Whether at least one Gaudi device is usable from this process."""
    if not habana_frameworks_installed():
        return False
    try:
        import habana_frameworks.torch.hpu as hthpu

        return bool(hthpu.is_available())
    except Exception as err:  # a broken install must not break CPU users
        log.debug("habana_frameworks is installed but unusable: %s", err)
        return False


def detect_device_type() -> str:
    """The device type 'auto' stands for: HPU, then CUDA, then CPU."""
    if hpu_available():
        return "hpu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"
