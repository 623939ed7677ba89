"""The package's own strategy arguments, beside Lightning's: one typed object both strategies take."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.nn import Module

    from lightning_gaudi_ds.hpu import Mode


@dataclass(frozen=True)
class Options:
    """What ``HPUDeepSpeedStrategy`` (Trainer and Fabric) takes on top of Lightning's ``DeepSpeedStrategy``; the
    strategies document each argument, and :meth:`lightning_gaudi_ds.core.base.DeepSpeedCore._check_arguments`
    checks them before Lightning's ``__init__`` runs."""

    device_memory: int | str | None = None
    measure_activations: bool = False
    hpu_mode: Mode | None = None
    torch_compile: bool | None = None
    number_checkpoints: int | None = None
    zero3_leaf_modules: Sequence[type[Module] | str] | None = None
    hpz: bool = False
    sequence_parallel_size: int | None = None
    sequence_parallel_modules: Sequence[type[Module] | str] | None = None
