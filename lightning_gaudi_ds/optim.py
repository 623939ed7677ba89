"""ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's ``DeepSpeedCPUAdam``; users write
``torch.optim.AdamW``. DeepSpeed refuses a torch optimizer when offload is on, so the strategy converts it here,
keeping every parameter group and hyperparameter.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch.optim import Optimizer

#: Exact types converted (a subclass may change the update rule, so it is not converted).
CONVERTIBLE = (torch.optim.Adam, torch.optim.AdamW)


def is_convertible(optimizer: Optimizer) -> bool:
    return type(optimizer) in CONVERTIBLE


def to_cpu_adam(optimizer: Optimizer, scheduler: Optional[Any] = None) -> Optimizer:
    """A ``DeepSpeedCPUAdam`` over ``optimizer``'s parameter groups, with its lr, betas, eps and weight decay.

    The new optimizer holds the *same* group dicts, and ``scheduler`` (if any) is pointed at it, so a learning-rate
    scheduler built in ``configure_optimizers`` keeps driving the learning rate. ``torch.optim.AdamW`` (decoupled
    weight decay) becomes ``adamw_mode=True``, ``torch.optim.Adam`` (L2 penalty) ``adamw_mode=False``.
    """
    if not is_convertible(optimizer):
        raise TypeError(f"{type(optimizer).__qualname__} cannot be converted; only {[c.__name__ for c in CONVERTIBLE]}")
    unsupported = sorted({k for g in optimizer.param_groups for k in ("amsgrad", "maximize") if g.get(k)})
    if unsupported:
        raise ValueError(
            f"ZeRO-Offload trains with DeepSpeedCPUAdam, which has no {' / '.join(unsupported)}; configure_optimizers"
            f" returned {type(optimizer).__name__}({', '.join(f'{k}=True' for k in unsupported)}). Drop that option,"
            " or turn offload_optimizer off."
        )
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    defaults = optimizer.defaults
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(defaults.get("decoupled_weight_decay", False))
    for group in optimizer.param_groups:  # DeepSpeedCPUAdam's C++ step takes plain floats
        group["lr"] = float(group["lr"])
        group["betas"] = tuple(float(b) for b in group["betas"])
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
        _mark_step_for_scheduler(cpu_adam)
    return cpu_adam


def _mark_step_for_scheduler(optimizer: Optimizer) -> None:
    # torch's LRScheduler wraps `optimizer.step` when it is built, and on its first step warns ("optimizer.step()
    # has been overridden ...") unless the optimizer carries that wrapper. Give the new optimizer the same marks.
    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
