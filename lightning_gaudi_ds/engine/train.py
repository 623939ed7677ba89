"""Where the training optimizer and scheduler come from, and ZeRO-Offload's optimizer.

The optimizer and the scheduler each come from the DeepSpeed config *or* from ``configure_optimizers``; where both
give one, Lightning's choice wins, said in a warning.
ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's ``DeepSpeedCPUAdam``; users write
``torch.optim.AdamW``. DeepSpeed refuses a torch optimizer when offload is on, so it is converted here, keeping
every parameter group and hyperparameter. On the CPU device, a torch Adam/AdamW that leaves its implementation to
torch steps with torch's fused kernel (:func:`fuse_on_cpu`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer

from lightning_gaudi_ds._compat import (
    _init_optimizers_and_lr_schedulers,
    _MockOptimizer,
    mark_step_wrapped_for_lr_scheduler,
)
from lightning_gaudi_ds.config import ConfigError, offloads_optimizer
from lightning_gaudi_ds.devices import fuses_adam
from lightning_gaudi_ds.errors import ArgumentTypeError
from lightning_gaudi_ds.jit_ops.locks import op_cache

if TYPE_CHECKING:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

#: Exact types converted (a subclass may change the update rule, so it is not converted).
CONVERTIBLE = (torch.optim.Adam, torch.optim.AdamW)


def is_convertible(optimizer: Optimizer) -> bool:
    return type(optimizer) in CONVERTIBLE


_CPU_INFO: list[dict[str, Any]] = []  # py-cpuinfo's answer, once per process


@contextlib.contextmanager
def _cpu_info_once() -> Iterator[None]:
    """``DeepSpeedCPUAdam.__init__`` asks py-cpuinfo for the CPU's vendor, which starts a Python subprocess each time
    (1.4 s on 2 cores): within this block it asks once per process, and py-cpuinfo is left as it was afterwards."""
    try:
        import cpuinfo
        from deepspeed.ops.adam import cpu_adam
    except ImportError:  # DeepSpeed's own import of them will say so
        yield
        return
    original = cpuinfo.get_cpu_info
    # DeepSpeed 0.19 imports it in __init__, from py-cpuinfo; 0.16 at the top of its module: both names, restored
    owners = [m for m in (cpuinfo, cpu_adam) if getattr(m, "get_cpu_info", None) is original]

    def cached() -> dict[str, Any]:
        if not _CPU_INFO:
            _CPU_INFO.append(original())
        return dict(_CPU_INFO[0])

    for owner in owners:
        owner.get_cpu_info = cached
    try:
        yield
    finally:
        for owner in owners:
            owner.get_cpu_info = original


def to_cpu_adam(optimizer: Optimizer, scheduler: Any | None = None) -> DeepSpeedCPUAdam:
    """A ``DeepSpeedCPUAdam`` over ``optimizer``'s parameter groups, with its lr, betas, eps and weight decay.

    The new optimizer holds the *same* group dicts, and ``scheduler`` (if any) is pointed at it, so a learning-rate
    scheduler built in ``configure_optimizers`` keeps driving the learning rate. ``torch.optim.AdamW`` (decoupled
    weight decay) becomes ``adamw_mode=True``, ``torch.optim.Adam`` (L2 penalty) ``adamw_mode=False``.
    """
    if not is_convertible(optimizer):
        raise ArgumentTypeError(f"{type(optimizer).__qualname__} cannot be converted; only"
                                f" {[c.__name__ for c in CONVERTIBLE]}")
    unsupported = sorted({k for g in optimizer.param_groups for k in ("amsgrad", "maximize") if g.get(k)})
    if unsupported:
        raise ConfigError(
            f"ZeRO-Offload trains with DeepSpeedCPUAdam, which has no {' / '.join(unsupported)}; configure_optimizers"
            f" returned {type(optimizer).__name__}({', '.join(f'{k}=True' for k in unsupported)}). Drop that option,"
            " or turn offload_optimizer off."
        )
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # importing DeepSpeed picks its accelerator: not before setup

    defaults = optimizer.defaults
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(defaults.get("decoupled_weight_decay", False))
    for group in optimizer.param_groups:  # DeepSpeedCPUAdam's C++ step takes plain floats
        group["lr"] = float(group["lr"])
        group["betas"] = tuple(float(b) for b in group["betas"])
    with op_cache(), _cpu_info_once():  # the cpu_adam op the set-up built for this environment (loaded here)
        cpu_adam = DeepSpeedCPUAdam(
            optimizer.param_groups,
            lr=float(defaults["lr"]),
            betas=tuple(float(b) for b in defaults["betas"]),
            eps=float(defaults["eps"]),
            weight_decay=float(defaults["weight_decay"]),
            adamw_mode=decoupled,
        )
    if scheduler is not None and getattr(scheduler, "optimizer", None) is optimizer:
        scheduler.optimizer = cpu_adam
        mark_step_wrapped_for_lr_scheduler(cpu_adam)
    return cpu_adam


#: Why :func:`fuse_on_cpu` picks torch's fused kernel (``benchmarks/README.md``: "Where ZeRO is slower than DDP").
FUSED_ON_CPU = (
    "cpu default: torch's fused CPU kernel steps ZeRO's flat fp32 partition in one pass without temporaries, where"
    " the per-tensor loop torch picks on CPU takes 5.8x as long (12.6M parameters: 15.5 vs 90.6 ms on one core);"
    " same update rule. Pass fused=False (or foreach=...) to keep torch's choice"
)


def fuse_on_cpu(optimizer: Optimizer | None, device_type: str | None) -> str | None:
    """On the CPU device, turn on ``fused`` in a torch ``Adam``/``AdamW`` that left ``fused`` and ``foreach`` to
    torch (both None; :func:`fuses_adam` decides); return the line for the resolved-config log, or None when
    nothing changed.

    DeepSpeed's ZeRO optimizers step the wrapped torch optimizer on flat fp32 partitions; on CPU torch then picks
    its per-tensor loop, which allocates temporaries the size of the partition and is the slowest part of ZeRO's
    step. An explicit choice (``fused=False``, ``foreach=True``...) is kept, and so are the options the fused
    kernel lacks (``differentiable``, ``capturable``)."""
    if optimizer is None or not fuses_adam(device_type, optimizer):
        return None
    for group in optimizer.param_groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    return f"optimizer: {type(optimizer).__name__}(fused=True) from configure_optimizers ({FUSED_ON_CPU})"


def optimizer_sources(
    config: Mapping[str, Any], optimizer: Optimizer, scheduler_config: LRSchedulerConfig | None,
    device_type: str | None = None, filled: Callable[[str], None] | None = None, *, fabric: bool = False,
) -> tuple[Optimizer | None, LRSchedulerConfig | None]:
    """The optimizer and scheduler to hand to ``deepspeed.initialize`` besides the config's own sections.

    ``optimizer`` and ``scheduler_config`` are what ``configure_optimizers`` returned (Lightning's
    ``_MockOptimizer`` when it returned None). Where both supply one, Lightning's choice wins, with a warning: the
    config's optimizer (and then its scheduler, or none), else configure_optimizers' scheduler; under Fabric
    (``fabric``) the optimizer given to ``fabric.setup``. Raises
    :class:`ConfigError` (a ``MisconfigurationException``) when neither supplies an optimizer, or when ZeRO-Offload
    is on and the optimizer cannot become DeepSpeedCPUAdam; converts a torch Adam/AdamW under ZeRO-Offload, and on
    the CPU device (``device_type``) otherwise fuses it (:func:`fuse_on_cpu`; ``filled`` receives the log line).
    """
    client: Optimizer | None = None if isinstance(optimizer, _MockOptimizer) else optimizer
    client_scheduler = getattr(scheduler_config, "scheduler", None)
    if fabric and "optimizer" in config and client is not None:
        # Lightning's Fabric strategy passes both on, and DeepSpeed prefers the optimizer it is given
        rank_zero_warn(
            f"The {type(client).__name__} given to fabric.setup wins over the DeepSpeed config's `optimizer` section"
            f" ({_section_type(config, 'optimizer')}), which is ignored (as by Lightning's Fabric DeepSpeedStrategy)."
            " Remove the section, or build the optimizer from it: leave the optimizer out of fabric.setup."
        )
    elif "optimizer" in config and client is not None:
        # Lightning's DeepSpeedStrategy then skips configure_optimizers: the config's optimizer and scheduler train
        ignored = ", ".join(type(o).__name__ for o in (client, client_scheduler) if o is not None)
        rank_zero_warn(
            f"The DeepSpeed config's `optimizer` section ({_section_type(config, 'optimizer')}) wins over the {ignored}"
            " that configure_optimizers returned, which is ignored (as by Lightning's DeepSpeedStrategy); the"
            f" scheduler is the config's ({_section_type(config, 'scheduler')}). Remove the section to train with"
            " configure_optimizers'."
        )
        client, scheduler_config = None, None
    elif "scheduler" in config and client_scheduler is not None:
        # Lightning passes both on, and DeepSpeed prefers the scheduler it is given over its config's
        rank_zero_warn(
            f"configure_optimizers' {type(client_scheduler).__name__} wins over the DeepSpeed config's `scheduler`"
            f" section ({_section_type(config, 'scheduler')}), which is ignored (as by Lightning's DeepSpeedStrategy)."
            " Remove the section, or return no scheduler from configure_optimizers to use it."
        )
    if client is None and "optimizer" not in config:
        raise ConfigError(
            "configure_optimizers returned None and the DeepSpeed config has no `optimizer` section, so there is"
            ' nothing to train with. Return an optimizer, or add e.g. "optimizer": {"type": "AdamW", "params":'
            ' {"lr": "auto"}} to the config.'
        )
    if client is not None and offloads_optimizer(config) and config.get("zero_force_ds_cpu_optimizer", True):
        if not is_convertible(client):
            raise ConfigError(
                f"ZeRO-Offload steps the optimizer on the CPU with DeepSpeedCPUAdam, and configure_optimizers"
                f" returned {type(client).__qualname__}, which DeepSpeed refuses with offload. Return"
                " torch.optim.AdamW or torch.optim.Adam (converted for you), put an `optimizer` section in the"
                ' config, or set "zero_force_ds_cpu_optimizer": false to keep it (slow).'
            )
        before = type(client).__name__
        cpu_adam = to_cpu_adam(client, getattr(scheduler_config, "scheduler", None))
        client = cpu_adam
        rank_zero_info(
            f"ZeRO-Offload: training with DeepSpeedCPUAdam (adamw_mode={cpu_adam.adam_w_mode}) in place of the"
            f" torch.optim.{before} from configure_optimizers, with the same parameter groups and hyperparameters;"
            " DeepSpeed refuses a torch optimizer with offload."
        )
    else:
        line = fuse_on_cpu(client, device_type)
        if line is not None and filled is not None:
            filled(line)
    return client, scheduler_config


def _section_type(config: Mapping[str, Any], section: str) -> str | None:
    block = config.get(section)
    return block.get("type") if isinstance(block, Mapping) else None


def init_optimizers(
    lightning_init: Callable[[], tuple[Optimizer, LRSchedulerConfig | None]], module: Any, config: Any
) -> tuple[Optimizer, LRSchedulerConfig | None]:
    """Lightning's ``DeepSpeedStrategy._init_optimizers`` (``lightning_init``), with its "single optimizer" error
    naming what ``module``'s ``configure_optimizers`` returned (:func:`single_optimizer`), and a Habana fused
    optimizer DeepSpeed cannot train with under ``config`` refused
    (:func:`lightning_gaudi_ds.hpu.fused_optimizer_problem`)."""
    from lightning_gaudi_ds.hpu import fused_optimizer_problem

    try:
        optimizer, scheduler_config = lightning_init()
    except MisconfigurationException:  # more than one optimizer or scheduler: say which (configure_optimizers again)
        single_optimizer(*_init_optimizers_and_lr_schedulers(module))
        raise
    problem = fused_optimizer_problem(optimizer, isinstance(config, dict) and offloads_optimizer(config))
    if problem:
        raise ConfigError(problem)
    return optimizer, scheduler_config


def single_optimizer(
    optimizers: list[Optimizer], schedulers: list[LRSchedulerConfig]
) -> tuple[Optimizer, LRSchedulerConfig | None]:
    """The one optimizer and at most one scheduler DeepSpeed takes, from what ``configure_optimizers`` returned."""
    if len(optimizers) != 1 or len(schedulers) > 1:
        names = [type(o).__name__ for o in optimizers]
        raise ConfigError(
            f"`configure_optimizers` returned {len(optimizers)} optimizers {names} and {len(schedulers)}"
            " schedulers; DeepSpeed takes exactly one optimizer and at most one scheduler. Return a single"
            " optimizer (use parameter groups for different settings)."
        )
    return optimizers[0], schedulers[0] if schedulers else None


# Warned after fit under ZeRO-3 when the module holds its rank's partitions only.
PARTITIONED_AFTER_FIT = (
    "ZeRO-3: after fit, the module's parameters are this rank's partitions, so `model.state_dict()`"
    " returns empty tensors and `torch.save(model.state_dict(), ...)` saves nothing useful."
    " For the full weights, call `trainer.save_checkpoint(path)` on every rank, then"
    " `lightning-gaudi-ds convert path model.pt` (one fp32 file); or gather them in memory on every rank:"
    " `with deepspeed.zero.GatheredParameters(list(model.parameters())): state = {k: v.clone() for k, v"
    " in model.state_dict().items()}`. trainer.validate/test/predict(model) use the partitions as they are."
)


def eval_mode_warning(module: torch.nn.Module) -> str | None:
    """Under ZeRO-3 on a DeepSpeed whose backward asserts training mode (Habana's fork), what to tell the user about
    ``module``'s submodules left in eval mode at the start of training; None when there are none or it is safe."""
    from lightning_gaudi_ds._compat import zero3_backward_requires_training_mode

    names = [name for name, sub in module.named_modules() if name and not sub.training]
    if not names or not zero3_backward_requires_training_mode():
        return None
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"ZeRO-3 on this DeepSpeed (Habana's fork) fails backward through a module in eval mode (\"backward pass is"
        f" invalid for module in evaluation mode\"), and {len(names)} submodule(s) are in eval mode: {shown}. If"
        " gradients flow through them, keep them in train mode (freeze them with requires_grad_(False) instead)."
    )


def warn_at_train_start(module: torch.nn.Module | None, zero_stage_3: bool) -> None:
    """Under ZeRO-3, :func:`eval_mode_warning`'s warning, if any."""
    warning = eval_mode_warning(module) if zero_stage_3 and module is not None else None
    if warning:
        rank_zero_warn(warning)


def warn_at_train_end(module: torch.nn.Module | None, zero_stage_3: bool) -> None:
    """Under ZeRO-3, :data:`PARTITIONED_AFTER_FIT` when the module holds its rank's partitions only."""
    if zero_stage_3 and module is not None and any(is_partition(p) for p in module.parameters()):
        rank_zero_warn(PARTITIONED_AFTER_FIT)


def is_partition(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter not gathered now: its values live in the ranks' partitions (DeepSpeed's own status)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(param, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE
