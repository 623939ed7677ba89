"""``HPUAccelerator``: Intel Gaudi devices for Lightning, registered as ``"hpu"``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from typing_extensions import override

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds._compat import _DEVICE, _AcceleratorRegistry
from lightning_gaudi_ds.errors import ConfigError


class HPUAccelerator(Accelerator):
    """Accelerator for Intel Gaudi HPUs. Creating it without the Gaudi stack raises a clear error."""

    def __init__(self) -> None:
        hpu.require_stack()
        super().__init__()

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "hpu":
            raise ConfigError(f"HPUAccelerator got device {device}; expected an 'hpu' device.")

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        import habana_frameworks.torch.hpu as hthpu

        return dict(hthpu.memory_stats(device))

    @override
    def teardown(self) -> None:
        pass

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> int:
        if isinstance(devices, (list, tuple)):
            # Each rank opens the card its local rank maps to through HABANA_VISIBLE_MODULES; an index list
            # would silently run on modules 0..n-1.
            visible = ",".join(str(d) for d in devices)
            raise ConfigError(
                f"`Trainer(accelerator='hpu', devices={list(devices)!r})`: HPUs are chosen by count, not by index."
                f" To train on Gaudi modules {visible}, start Python with HABANA_VISIBLE_MODULES={visible} and pass"
                f" `Trainer(devices={len(devices)})`."
            )
        if devices == "auto" or devices == -1 or devices == "-1":
            return hpu.device_count()
        try:
            count = int(devices)
        except (TypeError, ValueError):
            raise ConfigError(
                f"`Trainer(devices={devices!r})` is not valid for HPUs; pass a positive int or 'auto'."
            ) from None
        if count < 1:
            raise ConfigError(
                f"`Trainer(devices={devices!r})`: at least one HPU is needed; pass devices >= 1."
            )
        return count

    @staticmethod
    @override
    def get_parallel_devices(devices: int | str | list[int]) -> list[torch.device]:
        # Each process opens one Gaudi card; inside the process it is simply "hpu".
        return [torch.device("hpu")] * HPUAccelerator.parse_devices(devices)

    @staticmethod
    @override
    def auto_device_count() -> int:
        return hpu.device_count()

    @staticmethod
    @override
    def is_available() -> bool:
        return hpu.hpu_available()

    @staticmethod
    def get_device_name() -> str:
        """The card's name: ``"GAUDI"`` (first generation), ``"GAUDI2"``, ``"GAUDI3"``."""
        return hpu.device_name()

    @staticmethod
    @override
    def name() -> str:
        return "hpu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(
            cls.name(), cls, description="Intel Gaudi HPU (lightning_gaudi_ds)", override=True
        )


# Defining the accelerator registers it with the Trainer and with Fabric, however this module was reached (see
# lightning_gaudi_ds/__init__.py).
HPUAccelerator.register_accelerators(AcceleratorRegistry)
HPUAccelerator.register_accelerators(ACCELERATOR_REGISTRY)
