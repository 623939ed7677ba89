"""What the device asks of a DeepSpeed run around the engine: the Gaudi execution mode and graph breaks, compiling
the engine, the model's move to the card, torch's deterministic mode, and hccl's reduce.

The strategy owns one :class:`DeviceRuntime` and calls it from its hooks; the Gaudi stack itself is reached
through :mod:`lightning_gaudi_ds.hpu`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds._compat import created_deepspeed_accelerator, pin_device_count
from lightning_gaudi_ds._environ import scoped_environ
from lightning_gaudi_ds.config import ConfigError
from lightning_gaudi_ds.devices import deterministic_change, deterministic_state, move_keeping_tied_parameters
from lightning_gaudi_ds.jit_ops.locks import op_cache

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

#: Lightning's ``reduce_op`` argument, and a reduce or all-reduce taking it.
ReduceOpArg = ReduceOp | str | None
Reduce = Callable[[Tensor, Any, ReduceOpArg], Tensor]


def compile_backend() -> str:
    """DeepSpeed's accelerator's ``torch.compile`` backend (``hpu_backend`` on Gaudi, inductor elsewhere)."""
    from deepspeed.accelerator import get_accelerator

    return str(get_accelerator().get_compile_backend())


@dataclass
class DeviceRuntime:
    """The strategy's ``hpu_mode`` and ``torch_compile`` arguments and what the run found out about the device."""

    requested_mode: hpu.Mode | None = None
    requested_compile: bool | None = None
    mode: hpu.Mode | None = None  # the mode in force, once the Trainer chose an HPU
    deterministic_at_trainer: tuple[bool, bool] = field(default_factory=deterministic_state)
    deepspeed_hpu_before_trainer: bool = False
    mark_step: Callable[[], None] | None = None
    device_type: str | None = None
    local_size: int | None = None  # the CPU ranks on this machine, when no launcher set LOCAL_SIZE
    unpin_device_count: Callable[[], None] | None = None

    @property
    def compile(self) -> bool:
        """Whether the engine is compiled: as requested, else on for HPUs in eager mode (Habana's default path)."""
        if self.requested_compile is not None:
            return self.requested_compile
        return self.mode == "eager"

    def at_trainer(self, device_type: str) -> None:
        """In the Trainer's constructor, which has applied ``Trainer(deterministic=...)`` by now: remember torch's
        deterministic mode, and on an HPU fix the execution mode (refusing one other than the imported one, and
        exporting it to the ranks Lightning's launcher starts)."""
        self.deterministic_at_trainer = deterministic_state()
        self.deepspeed_hpu_before_trainer = created_deepspeed_accelerator() == "hpu"
        if device_type == "hpu":
            self.mode = hpu.check_mode(self.requested_mode)
            if self.mode == "lazy" and self.requested_compile:
                raise ConfigError(
                    "`HPUDeepSpeedStrategy(torch_compile=True)` with HPU lazy mode: torch.compile needs eager mode."
                    " Run with PT_HPU_LAZY_MODE=0 (hpu_mode='eager'), or drop torch_compile=True."
                )

    def before_accelerator_selected(self, device_type: str, num_processes: int) -> None:
        """What DeepSpeed will be told about the device: on CPU without a launcher's ``LOCAL_SIZE``, the number
        of ranks on this machine (see :meth:`after_accelerator_selected` and :meth:`deepspeed_calls`)."""
        self.device_type = device_type
        self.local_size = num_processes if device_type == "cpu" and "LOCAL_SIZE" not in os.environ else None

    def after_accelerator_selected(self, device_type: str) -> None:
        """Once DeepSpeed's accelerator exists: say what it did to torch's deterministic mode, and on an HPU undo its
        uninitialized-memory fill and log the execution mode."""
        # DeepSpeed's HPU accelerator forces deterministic mode when it is created: at the selection, or earlier
        # when deepspeed was imported on a Gaudi machine. Compared after the selection whatever it did.
        change = deterministic_change(self.deterministic_at_trainer, self.deepspeed_hpu_before_trainer)
        if change:
            rank_zero_warn(change)
        if self.local_size is not None and self.unpin_device_count is None:
            # DeepSpeed's CPU accelerator counts devices from LOCAL_SIZE, else with a numactl subprocess per call.
            self.unpin_device_count = pin_device_count(self.local_size)
        if device_type == "hpu":
            hpu.disable_uninitialized_memory_fill()
            self.mode = self.mode or hpu.check_mode(self.requested_mode)
            rank_zero_info(hpu.describe_mode(self.mode, compile_backend() if self.compile else None))

    @contextlib.contextmanager
    def deepspeed_calls(self) -> Iterator[None]:
        """Around ``deepspeed.init_distributed`` and engine creation: the variables DeepSpeed reads there and has
        no argument for, set for the call only (the user's own settings win).

        The op cache (DeepSpeed builds ops inside these calls: FusedAdam, cpu_adagrad, inference kernels); on CPU
        ``LOCAL_SIZE``, which the shm op's ``initialize`` reads with ``getenv`` to decide whether all ranks are
        local; on HPU ``DEEPSPEED_USE_HPU``, which Habana's integrations set before ``deepspeed.initialize``.
        """
        values = {"LOCAL_SIZE": str(self.local_size)} if self.local_size is not None else {}
        if self.device_type == "hpu":
            values["DEEPSPEED_USE_HPU"] = hpu.ENV_DEFAULTS["DEEPSPEED_USE_HPU"]
        with op_cache(), scoped_environ(values):
            yield

    def before_engine(self, module: Module | None, device: torch.device) -> None:
        """On an HPU: the lazy-mode graph break, and the model moved to the card (the engine expects it there) with
        its shared parameters tied again."""
        if device.type != "hpu":
            return
        self.mark_step = hpu.mark_step_fn(self.mode)
        if module is not None:
            move_keeping_tied_parameters(module, device)

    def compile_engine(self, engine: DeepSpeedEngine) -> None:
        if self.compile:
            # Through the engine: Lightning refuses a module already passed through torch.compile with DeepSpeed.
            engine.compile(backend=compile_backend())

    def graph_break(self) -> None:
        if self.mark_step is not None:
            self.mark_step()

    def teardown(self) -> None:
        if self.unpin_device_count is not None:
            self.unpin_device_count()
            self.unpin_device_count = None


def is_mean(reduce_op: ReduceOpArg) -> bool:
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return bool(reduce_op == torch.distributed.ReduceOp.AVG)


def hccl_reduce_input(tensor: Tensor, device: torch.device, reduce_op: ReduceOpArg) -> tuple[Tensor, bool]:
    """``tensor`` made reducible by hccl, and whether the reduction is a mean (to do as a sum divided by the ranks).

    hccl is registered for HPU tensors only (a logged CPU value would find no backend), and reduces with sum/min/max
    only: a mean's integers become floating point, so that the division does not truncate.
    """
    mean = is_mean(reduce_op)
    dtype = torch.get_default_dtype() if mean and not tensor.is_floating_point() else None
    return tensor.to(device=device, dtype=dtype), mean


def hccl_reduce(
    reduce: Reduce, tensor: Tensor, group: Any, reduce_op: ReduceOpArg, device: torch.device,
    world_size: int,
) -> Tensor:
    """``reduce(tensor, group, reduce_op)`` (the strategy's reduce or all-reduce) on hccl: the tensor on the card,
    a mean as a sum divided by the ranks (see :func:`hccl_reduce_input`)."""
    tensor, mean = hccl_reduce_input(tensor, device, reduce_op)
    if not mean:
        return reduce(tensor, group, reduce_op)
    size = torch.distributed.get_world_size(group) if group is not None else world_size
    return reduce(tensor, group, "sum") / size


def reduce_on_device(reduce: Callable[[Tensor | Any, Any, ReduceOpArg], Tensor], backend: str, device: torch.device,
                     world_size: int, tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOpArg) -> Tensor:
    """A strategy's ``reduce`` (Trainer) or ``all_reduce`` (Fabric) on its process group's ``backend``:
    :func:`hccl_reduce` for a tensor on hccl, else ``reduce`` as it is."""
    if backend != "hccl" or not isinstance(tensor, Tensor):
        return reduce(tensor, group, reduce_op)
    return hccl_reduce(reduce, tensor, group, reduce_op, device, world_size)
