"""One table of what each device type needs: process-group backend, DeepSpeed accelerator, precisions.

Nothing here imports a hardware SDK at module level; :mod:`lightning_gaudi_ds.hpu` imports ``habana_frameworks``
lazily. Also the device-neutral checks the strategy runs at set-up: determinism, moving a module with tied weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import find_shared_parameters, set_shared_parameters
from torch.nn import Module
from torch.optim import Optimizer

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds._compat import fused_kernel_devices
from lightning_gaudi_ds.errors import ConfigError
from lightning_gaudi_ds.hpu import habana_frameworks_installed, hpu_available
from lightning_gaudi_ds.precisions import PRECISIONS, ZERO_DEFAULT_KEYS

log = logging.getLogger(__name__)

__all__ = [
    "DEVICES", "DeviceSpec", "ZERO_DEFAULT_KEYS", "deterministic_change", "deterministic_state",
    "detect_device_type", "device_spec", "habana_frameworks_installed", "hpu_available",
    "move_keeping_tied_parameters", "validate_precision",
]

#: ``zero_optimization`` keys whose best value depends on the device; the strategy fills them where the user's
#: config (or an explicit strategy argument) does not set them. Stage -> key -> (value, reason).
ZeroDefaults = Mapping[int, Mapping[str, tuple[Any, str]]]

# DeepSpeed 0.19 (stage_1_and_2.py, average_tensor) reduces ZeRO-1/2 gradient buckets three ways:
# reduce_scatter=false all-reduces the bucket; reduce_scatter=true with use_multi_rank_bucket_allreduce=true (its
# default) also all-reduces it; reduce_scatter=true with use_multi_rank_bucket_allreduce=false reduces each slice to
# the rank that owns it. The all-reduce paths plus the all-gather of the updated partitions send 1.5x DDP's bytes,
# reduce-to-owner 1.0x (benchmarks/README.md, section 6).
_OWNER = "reduce each gradient slice to its owner: 1.0x DDP's bytes instead of all-reduce's 1.5x"
_NO_STREAMS = "no streams on CPU: nothing to overlap, only extra buffer copies"
_CONTIGUOUS = "copy gradients into one flat buffer as they arrive (DeepSpeed's default)"
_GPU_OVERLAP = "overlap reduction with backward on a side stream (Lightning's and Hugging Face's GPU default)"
_GAUDI = "Habana's validated Gaudi ZeRO-{} config"


def _stages(per_stage: Mapping[int, Mapping[str, tuple[Any, str]]]) -> ZeroDefaults:
    return {stage: dict(values) for stage, values in per_stage.items()}


_CPU_12 = {
    "overlap_comm": (False, _NO_STREAMS),
    "reduce_scatter": (True, _OWNER),
    "use_multi_rank_bucket_allreduce": (False, _OWNER),
    "contiguous_gradients": (True, _CONTIGUOUS),
}
_CUDA_12 = {**_CPU_12, "overlap_comm": (True, _GPU_OVERLAP)}
_HPU_2 = {key: (False, _GAUDI.format(2)) for key in ("overlap_comm", "reduce_scatter", "contiguous_gradients")}

CPU_ZERO_DEFAULTS = _stages({
    1: _CPU_12, 2: _CPU_12,
    3: {"overlap_comm": (False, _NO_STREAMS), "contiguous_gradients": (True, _CONTIGUOUS)},
})
CUDA_ZERO_DEFAULTS = _stages({
    1: _CUDA_12, 2: _CUDA_12,
    3: {"overlap_comm": (True, _GPU_OVERLAP), "contiguous_gradients": (True, _CONTIGUOUS)},
})
# Habana's Gaudi configs (DeepSpeed User Guide for Gaudi, Optimum Habana's DeepSpeed examples): ZeRO-1 without
# contiguous gradients; ZeRO-2 with overlap, reduce-scatter and contiguous gradients off (HCCL's all-reduce is its
# fastest path); ZeRO-3 with overlap and reduce-scatter off.
HPU_ZERO_DEFAULTS = _stages({
    1: {"overlap_comm": (False, _GAUDI.format(1)), "contiguous_gradients": (False, _GAUDI.format(1))},
    2: _HPU_2,
    3: {"overlap_comm": (False, _GAUDI.format(3)), "reduce_scatter": (False, _GAUDI.format(3)),
        "contiguous_gradients": (True, _GAUDI.format(3))},
})


@dataclass(frozen=True)
class DeviceSpec:
    """What the strategy needs to know about one device type."""

    device_type: str
    backend: str  # torch.distributed process-group backend
    deepspeed_accelerator: str  # value of DS_ACCELERATOR
    precisions: tuple[str, ...]
    zero_defaults: ZeroDefaults = field(default_factory=dict)  # see ZERO_DEFAULT_KEYS


DEVICES: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec("cpu", "gloo", "cpu", ("32-true", "bf16-mixed", "bf16-true"), zero_defaults=CPU_ZERO_DEFAULTS),
    "cuda": DeviceSpec("cuda", "nccl", "cuda", PRECISIONS, zero_defaults=CUDA_ZERO_DEFAULTS),
    "hpu": DeviceSpec("hpu", "hccl", "hpu", PRECISIONS, zero_defaults=HPU_ZERO_DEFAULTS),
}


def device_spec(device: torch.device | str) -> DeviceSpec:
    """Return the table row for ``device`` (a ``torch.device`` or a type name)."""
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    try:
        return DEVICES[device_type]
    except KeyError:
        raise ConfigError(
            f"Device type {device_type!r} is not supported by HPUDeepSpeedStrategy."
            f" Supported: {', '.join(DEVICES)}. Use Trainer(accelerator='hpu' | 'cuda' | 'cpu')."
        ) from None


def validate_precision(precision: str, device: torch.device | str) -> None:
    """Fail loudly when ``precision`` cannot run on ``device`` (a :class:`~lightning_gaudi_ds.errors.ConfigError`,
    which is a ``ValueError``)."""
    spec = device_spec(device)
    if precision not in spec.precisions:
        hint = " fp16 has no fast path on CPU; use precision='bf16-mixed'." if precision.startswith("16") else ""
        raise ConfigError(
            f"`Trainer(precision={precision!r})` is not supported by HPUDeepSpeedStrategy on {spec.device_type!r}."
            f" Supported on {spec.device_type}: {', '.join(spec.precisions)}.{hint}"
        )
    # First-generation Gaudi has no float16: without this check deepspeed.initialize fails deep inside.
    if spec.device_type == "hpu" and precision.startswith("16") and habana_frameworks_installed():
        if not hpu.fp16_supported():
            raise ConfigError(
                f"`Trainer(precision={precision!r})`: this Gaudi ({hpu.device_name()}, first generation) does not"
                " compute in float16. Use precision='bf16-mixed' (or 'bf16-true'); float16 needs Gaudi2 or later."
            )


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


def fuses_adam(device_type: str | None, optimizer: Optimizer | str) -> bool:
    """Whether the strategy steps ``optimizer`` with torch's fused kernel
    (:func:`lightning_gaudi_ds.engine.train.fuse_on_cpu`; the planner asks too): a torch ``Adam``/``AdamW`` on the
    CPU device that left ``fused`` and ``foreach`` to torch. A name (``"adamw"``) stands for that torch optimizer with
    its defaults (the memory planner's assumption before ``configure_optimizers`` runs)."""
    if device_type != "cpu":
        return False
    if "cpu" not in fused_kernel_devices():
        return False
    if isinstance(optimizer, str):
        return optimizer.lower() in ("adam", "adamw")
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):  # a subclass may change the update rule
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable")
           or g.get("capturable") for g in groups):
        return False
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    return all(p.dtype in dtypes for g in groups for p in g["params"])
