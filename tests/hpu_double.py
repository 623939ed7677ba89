"""A test double for ``habana_frameworks``: records what the strategy asks of the Gaudi stack.

It checks wiring only (which calls, in which order, with which arguments). It never trains anything and
never stands in for a real HPU run.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any, Optional

import pytest
import torch


class FusedAdamW(torch.optim.Optimizer):
    """Stands in for habana_frameworks.torch.hpex.optimizers.FusedAdamW (a torch Optimizer subclass)."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})


FusedAdamW.__module__ = "habana_frameworks.torch.hpex.optimizers"


class GaudiDouble:
    def __init__(self, devices: int = 8, lazy: bool = True) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.devices = devices
        self.lazy = lazy

    def record(self, name: str, payload: Any = None) -> None:
        self.calls.append((name, payload))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def modules(self) -> dict[str, types.ModuleType]:
        def module(name: str, **attrs: Any) -> types.ModuleType:
            m = types.ModuleType(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None)
            m.__path__ = []  # a package, so submodule imports resolve through sys.modules
            for key, value in attrs.items():
                setattr(m, key, value)
            return m

        hpu = module(
            "habana_frameworks.torch.hpu",
            is_available=lambda: self.devices > 0,
            device_count=lambda: self.devices,
            set_device=lambda i: self.record("set_device", i),
            current_device=lambda: 0,
            memory_stats=lambda device=None: {"InUse": 0},
        )
        core = module(
            "habana_frameworks.torch.core",
            mark_step=lambda: self.record("mark_step"),
            is_lazy=lambda: self.lazy,
        )
        hccl = module(
            "habana_frameworks.torch.distributed.hccl",
            initialize_distributed_hpu=lambda **kw: self.record("initialize_distributed_hpu", kw),
        )
        optimizers = module("habana_frameworks.torch.hpex.optimizers", FusedAdamW=FusedAdamW)
        mods = {
            "habana_frameworks": module("habana_frameworks"),
            "habana_frameworks.torch": module("habana_frameworks.torch", hpu=hpu, core=core),
            "habana_frameworks.torch.hpu": hpu,
            "habana_frameworks.torch.core": core,
            "habana_frameworks.torch.distributed": module("habana_frameworks.torch.distributed", hccl=hccl),
            "habana_frameworks.torch.distributed.hccl": hccl,
            "habana_frameworks.torch.hpex": module("habana_frameworks.torch.hpex", optimizers=optimizers),
            "habana_frameworks.torch.hpex.optimizers": optimizers,
        }
        mods["habana_frameworks"].torch = mods["habana_frameworks.torch"]
        mods["habana_frameworks.torch"].distributed = mods["habana_frameworks.torch.distributed"]
        return mods


def install(monkeypatch: pytest.MonkeyPatch, devices: int = 8, lazy: bool = True) -> GaudiDouble:
    double = GaudiDouble(devices=devices, lazy=lazy)
    for name, mod in double.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    return double


def uninstall_check() -> Optional[str]:
    return next((m for m in sys.modules if m.startswith("habana_frameworks")), None)
