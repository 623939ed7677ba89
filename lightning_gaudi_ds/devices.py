"""One table of what each device type needs: process-group backend, DeepSpeed accelerator, precisions.

Nothing here imports a hardware SDK at module level; :mod:`lightning_gaudi_ds.hpu` imports ``habana_frameworks``
lazily. Also the device-neutral checks the strategy runs at set-up: determinism, moving a module with tied weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from lightning.pytorch.utilities import find_shared_parameters, set_shared_parameters
from torch.nn import Module

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds.hpu import habana_frameworks_installed, hpu_available

log = logging.getLogger(__name__)

__all__ = [
    "DEVICES", "DeviceSpec", "apply_env_defaults", "deterministic_change", "deterministic_state",
    "detect_device_type", "device_spec", "habana_frameworks_installed", "hpu_available",
    "move_keeping_tied_parameters", "validate_precision",
]

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
        env_defaults=hpu.ENV_DEFAULTS,
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
    # First-generation Gaudi has no float16: without this check deepspeed.initialize fails deep inside.
    if spec.device_type == "hpu" and precision.startswith("16") and habana_frameworks_installed():
        if not hpu.fp16_supported():
            raise ValueError(
                f"`Trainer(precision={precision!r})`: this Gaudi ({hpu.device_name()}, first generation) does not"
                " compute in float16. Use precision='bf16-mixed' (or 'bf16-true'); float16 needs Gaudi2 or later."
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


def detect_device_type() -> str:
    """The device type 'auto' stands for: HPU, then CUDA, then CPU."""
    if hpu_available():
        return "hpu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def deterministic_state() -> tuple[bool, bool]:
    """torch's deterministic mode: (enabled, warn_only)."""
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _describe(state: tuple[bool, bool]) -> str:
    enabled, warn_only = state
    return f"on{' (warn_only)' if warn_only else ''}" if enabled else "off"


def deterministic_change(at_trainer: tuple[bool, bool], forced_before_trainer: bool) -> str | None:
    """What DeepSpeed's accelerator did to torch's deterministic mode, for the user; None when nothing to say.

    ``at_trainer`` is the mode once the Trainer applied ``Trainer(deterministic=...)`` (its constructor does);
    ``forced_before_trainer``: DeepSpeed's HPU accelerator, whose creation forces the mode on, existed already
    then (``import deepspeed`` on a Gaudi machine creates it), so the Trainer's mode may be DeepSpeed's.
    """
    now = deterministic_state()
    undo = (" Some operators run slower or raise in deterministic mode. To choose, call"
            " torch.use_deterministic_algorithms(...) in your LightningModule's setup().")
    if now != at_trainer:
        return (f"DeepSpeed's accelerator turned torch's deterministic algorithms {_describe(now)} when it was"
                f" created; the Trainer had them {_describe(at_trainer)} (Trainer(deterministic=...)).{undo}")
    if forced_before_trainer and now[0]:
        return ("torch's deterministic algorithms are on: DeepSpeed's HPU accelerator turns them on when it is"
                " created, which happened when deepspeed was imported, before the Trainer. If you did not ask for"
                " them with Trainer(deterministic=True), they are DeepSpeed's." + undo)
    return None


def move_keeping_tied_parameters(module: Module, device: torch.device) -> Module:
    """``module.to(device)``, then tie again the parameters that were shared before the move.

    Moving to an HPU (like an XLA device) gives every module its own copy of a shared parameter, so a model that
    ties its embedding and output head would train two matrices. Lightning's XLA strategy wraps the move the same
    way.
    """
    shared = find_shared_parameters(module)
    module = module.to(device)
    return set_shared_parameters(module, shared) if shared else module
