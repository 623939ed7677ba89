"""A test double for ``habana_frameworks`` that behaves like importing the real library, and records the calls.

It checks wiring only: which calls, in which order, with which arguments, and what the import does to the
process. It never trains anything and never stands in for a real HPU run.

What the real import does, and the double models (Intel Gaudi PyTorch bridge, HabanaAI/gaudi-pytorch-bridge,
``python_packages/habana_frameworks/torch``; older layout mirrored in ZoneTwelve/habana_frameworks):

- ``torch/__init__.py`` loads the lazy or the eager plugin at the first import, from ``PT_HPU_LAZY_MODE``.
  ``utils/internal.py``: ``is_lazy()`` reads ``os.getenv("PT_HPU_LAZY_MODE", "0") != "0"`` once and caches it
  in ``is_lazy._is_lazy`` (releases before 1.19 defaulted to "1" and did not cache). ``core/__init__.py``
  re-exports ``is_lazy`` and ``mark_step``; ``core/step_closure.py``: ``mark_step(device_str="")``, which does
  nothing in eager mode (``internal.lazy_only``). The runtime-flags table of Habana's documentation lists
  ``PT_HPU_LAZY_MODE`` default 0.
- ``distributed/hccl/__init__.py`` calls ``initialize_distributed_hpu()`` at import. Without arguments it copies
  ``OMPI_COMM_WORLD_{LOCAL_RANK,SIZE,RANK}`` to ``LOCAL_RANK``/``WORLD_SIZE``/``RANK`` (unless all three are set),
  defaults ``MASTER_ADDR=localhost``/``MASTER_PORT=12345``, sets ``ID`` and ``WORLD_SIZE``; with
  ``(world_size, rank, local_rank)`` it writes those. Signature ``initialize_distributed_hpu(world_size=None,
  rank=None, local_rank=None) -> Tuple[int, int, int]``. The backend is registered with
  ``torch.distributed.Backend.register_backend("hccl", ..., devices=["hpu"])``: a collective on a CPU tensor
  finds no backend. The double raises torch's error for that (:meth:`GaudiDouble.all_reduce`), because torch
  without the bridge cannot hold HPU tensors.
- ``hpu/__init__.py``: ``is_available()``, ``device_count()``, ``get_device_name(device=None)`` ("GAUDI" for the
  first generation, "GAUDI2", "GAUDI3"; lightning-habana and the bridge's own tests compare against these),
  ``current_device()``, ``set_device(device)``; ``hpu/memory.py``: ``memory_stats(device=None)``; the ``Event``
  and ``Stream`` classes, which DeepSpeed's HPU accelerator reads (through ``core.hpu``) while ``deepspeed``
  imports.
- ``utils/experimental``: ``_is_fp16_supported()``, which DeepSpeed's HPU accelerator calls.
- ``hpex/optimizers/FusedAdamW.py``: ``FusedAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6,
  weight_decay=0.0, bias_correction=True, moments_dtype=None)``, a ``torch.optim.Optimizer``.
- Moving a module to an HPU: bridge tensors are not shallow-copy compatible with CPU ones, so ``Module._apply``
  replaces each module's ``Parameter`` with a new one and shared parameters come back untied (the reason
  Lightning's XLA strategy and optimum-habana tie them again). The double's ``Module.to("hpu")`` does exactly that,
  with the tensors left on the CPU.
- DeepSpeed (``deepspeed/accelerator/real_accelerator.py`` 0.19 and HabanaAI/DeepSpeed 1.21) picks its HPU
  accelerator by itself when ``habana_frameworks.torch.hpu`` imports; the accelerator's constructor turns on
  ``torch.use_deterministic_algorithms(True)`` (upstream also sets ``fill_uninitialized_memory = False``; the
  fork does not). :func:`install` lets the real ``get_accelerator()`` detect the double, as importing DeepSpeed
  on a Gaudi machine would. Upstream 0.16.1 calls ``hpu.setDeterministic(True)`` there instead; the fork 1.20/1.21
  calls it only with ``DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API=1`` and otherwise turns torch's mode on
  (:func:`deepspeed_hpu_determinism` tells which the installed DeepSpeed does).
- ``hpu.is_lazy()`` and ``hpu.wrap_in_hpu_graph(module)``: the fork's ``HPU_Accelerator.wrap_in_hpu_graph`` wraps
  in lazy mode only; ``hpu.setDeterministic(flag)`` sets the bridge's own deterministic mode.
- The fork's ``CheckpointFunction.backward`` calls ``habana_frameworks.torch.core.mark_step()`` when the gradients
  are on an HPU (the double's ``core.mark_step``), and its ZeRO-3 ``pre_sub_module_backward_function`` asserts
  ``sub_module.training``.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import sys
import types
import weakref
from typing import Any, Callable, Iterable, Optional, Union

import pytest
import torch

log = logging.getLogger(__name__)

# Every variable the real import or the strategy may write: the double restores them after each test.
TOUCHED_ENV = (
    "PT_HPU_LAZY_MODE", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ID", "HLS_MODULE_ID",
    "DEEPSPEED_USE_HPU", "PT_HPU_LAZY_ACC_PAR_MODE", "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES", "DS_ACCELERATOR",
)
_OMPI_TO_TORCH = {"OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
                  "OMPI_COMM_WORLD_RANK": "RANK"}


class FusedAdamW(torch.optim.Optimizer):
    """habana_frameworks.torch.hpex.optimizers.FusedAdamW's signature; steps like AdamW on the CPU."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        moments_dtype: Optional[Union[torch.dtype, tuple[torch.dtype, torch.dtype]]] = None,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.moments_dtype = moments_dtype


FusedAdamW.__module__ = "habana_frameworks.torch.hpex.optimizers.FusedAdamW"


class GaudiDouble:
    """The state of one imported double: mode, devices, and the calls made to it."""

    def __init__(self, devices: int = 8, device_name: str = "GAUDI2") -> None:
        self.calls: list[tuple[str, Any]] = []
        self.devices = devices
        self.device_name = device_name
        self.lazy: Optional[bool] = None  # fixed by the first `is_lazy()` call, which the import makes
        self.on_hpu: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
        self.deterministic = False  # the bridge's mode (hpu.setDeterministic), apart from torch's

    def record(self, name: str, payload: Any = None) -> None:
        self.calls.append((name, payload))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    # ---------------------------------------------------------------- habana_frameworks.torch.utils.internal
    def is_lazy(self) -> bool:
        if self.lazy is None:
            self.lazy = os.getenv("PT_HPU_LAZY_MODE", "0") != "0"
        return self.lazy

    # ------------------------------------------------------------------------- habana_frameworks.torch.core
    def mark_step(self, device_str: str = "") -> None:
        self.record("mark_step" if self.is_lazy() else "mark_step (no effect in eager mode)")

    # -------------------------------------------------------------------------- habana_frameworks.torch.hpu
    def set_deterministic(self, flag: bool) -> None:
        """``hpu.setDeterministic``: the bridge's own deterministic mode; torch's flags are left as they are. Kept as
        state rather than a call: DeepSpeed makes it whenever its accelerator is created, outside the strategy."""
        self.deterministic = bool(flag)

    def wrap_in_hpu_graph(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        """``hpu.wrap_in_hpu_graph``: the module itself, its forward replayed from a recorded graph."""
        self.record("wrap_in_hpu_graph", module)
        return module

    # -------------------------------------------------------------- habana_frameworks.torch.distributed.hccl
    def initialize_distributed_hpu(
        self, world_size: Optional[int] = None, rank: Optional[int] = None, local_rank: Optional[int] = None
    ) -> tuple[int, int, int]:
        args = {"world_size": world_size, "rank": rank, "local_rank": local_rank}
        self.record("initialize_distributed_hpu", args)
        if all(v is not None for v in args.values()):
            os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(local_rank))
        else:
            torch_keys_set = all(key in os.environ for key in _OMPI_TO_TORCH.values())
            if not torch_keys_set and all(key in os.environ for key in _OMPI_TO_TORCH):
                for ompi, key in _OMPI_TO_TORCH.items():
                    os.environ[key] = os.environ[ompi]
            os.environ.setdefault("MASTER_ADDR", "localhost")
            os.environ.setdefault("MASTER_PORT", "12345")
        size = int(os.getenv("WORLD_SIZE", 1))
        global_rank = int(os.getenv("RANK", -1))
        local = int(os.environ.get("LOCAL_RANK", -1))
        if global_rank != -1:
            os.environ["ID"] = str(global_rank)
        os.environ["WORLD_SIZE"] = str(size)
        return size, global_rank, local

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", world_size: int = 1) -> torch.Tensor:
        """A collective on the hccl process group: it holds a backend for HPU tensors only."""
        if tensor not in self.on_hpu:
            raise RuntimeError("No backend type associated with device type cpu")
        self.record("hccl.all_reduce", (op, tensor.dtype))
        return tensor * world_size if op == "sum" else tensor

    # ------------------------------------------------------------------------ moving tensors and modules
    def patch_to(self, monkeypatch: pytest.MonkeyPatch) -> None:
        tensor_to: Callable[..., torch.Tensor] = torch.Tensor.to
        module_to: Callable[..., torch.nn.Module] = torch.nn.Module.to
        double = self

        def to_device(args: tuple, kwargs: dict) -> Optional[torch.device]:
            device = kwargs.get("device", args[0] if args else None)
            if isinstance(device, (str, torch.device)):
                device = torch.device(device)
                return device if device.type == "hpu" else None
            return None

        def tensor_to_double(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if to_device(args, kwargs) is None:
                return tensor_to(self, *args, **kwargs)
            dtype = kwargs.get("dtype", args[1] if len(args) > 1 and isinstance(args[1], torch.dtype) else None)
            moved = self.clone() if dtype is None else tensor_to(self, dtype=dtype, copy=True)
            double.on_hpu.add(moved)
            return moved

        def module_to_double(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            if to_device(args, kwargs) is None:
                return module_to(self, *args, **kwargs)
            double.record("module.to", torch.device("hpu"))
            previous = torch.__future__.get_overwrite_module_params_on_conversion()
            torch.__future__.set_overwrite_module_params_on_conversion(True)
            try:
                return self._apply(lambda t: tensor_to_double(t, "hpu"))
            finally:
                torch.__future__.set_overwrite_module_params_on_conversion(previous)

        monkeypatch.setattr(torch.Tensor, "to", tensor_to_double)
        monkeypatch.setattr(torch.nn.Module, "to", module_to_double)

    # --------------------------------------------------------------------------------------- the modules
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
            get_device_name=lambda device=None: self.device_name if self.devices > 0 else "",
            set_device=lambda device: self.record("set_device", device),
            current_device=lambda: 0,
            # the keys Lightning's HPU DeviceStatsMonitor documents: "Limit" is the card's memory (Gaudi2: 96 GB)
            memory_stats=lambda device=None: {"InUse": 0, "Limit": 96 * 10**9},
            HABANA_VISIBLE_MODULES_VAR="HABANA_VISIBLE_MODULES",
            HLS_MODULE_ID_VAR="HLS_MODULE_ID",
            is_lazy=self.is_lazy,
            setDeterministic=self.set_deterministic,
            wrap_in_hpu_graph=self.wrap_in_hpu_graph,
            Event=type("Event", (), {"__module__": "habana_frameworks.torch.hpu"}),  # hpu/events.py
            Stream=type("Stream", (), {"__module__": "habana_frameworks.torch.hpu"}),  # hpu/streams.py
        )
        internal = module("habana_frameworks.torch.utils.internal", is_lazy=self.is_lazy)
        experimental = module("habana_frameworks.torch.utils.experimental",
                              _is_fp16_supported=lambda: self.device_name != "GAUDI")
        utils = module("habana_frameworks.torch.utils", internal=internal, experimental=experimental)
        core = module("habana_frameworks.torch.core", mark_step=self.mark_step, is_lazy=self.is_lazy, hpu=hpu)
        hccl = module("habana_frameworks.torch.distributed.hccl",
                      initialize_distributed_hpu=self.initialize_distributed_hpu)
        optimizers = module("habana_frameworks.torch.hpex.optimizers", FusedAdamW=FusedAdamW)
        distributed = module("habana_frameworks.torch.distributed", hccl=hccl)
        hpex = module("habana_frameworks.torch.hpex", optimizers=optimizers)
        torch_pkg = module("habana_frameworks.torch", hpu=hpu, core=core, utils=utils, distributed=distributed,
                           hpex=hpex, __version__="1.21.0-double")
        return {
            "habana_frameworks": module("habana_frameworks", torch=torch_pkg),
            "habana_frameworks.torch": torch_pkg,
            "habana_frameworks.torch.hpu": hpu,
            "habana_frameworks.torch.core": core,
            "habana_frameworks.torch.utils": utils,
            "habana_frameworks.torch.utils.internal": internal,
            "habana_frameworks.torch.utils.experimental": experimental,
            "habana_frameworks.torch.distributed": distributed,
            "habana_frameworks.torch.distributed.hccl": hccl,
            "habana_frameworks.torch.hpex": hpex,
            "habana_frameworks.torch.hpex.optimizers": optimizers,
        }


def deepspeed_hpu_determinism(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> str:
    """What the installed DeepSpeed's HPU accelerator turns on when it is created: ``"torch"`` (torch's
    deterministic algorithms: 0.19, the fork by default) or ``"hpu"`` (``hpu.setDeterministic``: upstream 0.16.1,
    the fork with ``DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API=1``)."""
    import inspect

    from deepspeed.accelerator.hpu_accelerator import HPU_Accelerator

    source = inspect.getsource(HPU_Accelerator.__init__)
    if "DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API" in source:  # Habana's fork
        chosen = environ.get("DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API", "").lower() in ("true", "1")
        return "hpu" if chosen else "torch"
    return "hpu" if "setDeterministic" in source else "torch"


def protect_env(monkeypatch: pytest.MonkeyPatch, keys: Iterable[str] = TOUCHED_ENV) -> None:
    """Have pytest restore ``keys`` after the test, however the code under test writes them."""
    for key in keys:
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:  # set then delete: pytest records the absence and restores it
            monkeypatch.setenv(key, "x")
            monkeypatch.delenv(key)


def install(
    monkeypatch: pytest.MonkeyPatch, devices: int = 8, device_name: str = "GAUDI2", deepspeed_detects: bool = True
) -> GaudiDouble:
    """Import the double as the real ``habana_frameworks`` would be imported, in the current environment.

    Fixes the execution mode from ``PT_HPU_LAZY_MODE`` now, runs hccl's module-level rank set-up, and (with
    ``deepspeed_detects``) lets DeepSpeed's real detection pick its HPU accelerator, with the global side effects
    its constructor has. Callers restore torch's deterministic flags (see ``tests/test_hpu_wiring.py``).
    """
    protect_env(monkeypatch)
    double = GaudiDouble(devices=devices, device_name=device_name)
    for name, mod in double.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    double.is_lazy()  # habana_frameworks/torch/__init__.py picks its plugin here
    double.initialize_distributed_hpu()  # distributed/hccl/__init__.py, at import
    double.calls.clear()
    double.patch_to(monkeypatch)
    import deepspeed.accelerator.real_accelerator as real_accelerator

    # Restored after the test: DeepSpeed's global accelerator and the fill flag its HPU accelerator sets.
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory",
                        torch.utils.deterministic.fill_uninitialized_memory)
    monkeypatch.setattr(real_accelerator, "ds_accelerator", real_accelerator.ds_accelerator)
    if deepspeed_detects:
        monkeypatch.setattr(real_accelerator, "ds_accelerator", None)
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
        real_accelerator.get_accelerator()
    return double


def uninstall_check() -> Optional[str]:
    return next((m for m in sys.modules if m.startswith("habana_frameworks")), None)
