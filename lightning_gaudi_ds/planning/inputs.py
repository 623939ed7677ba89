"""What decides the fastest ZeRO configuration that fits, gathered in one value: ``lightning-gaudi-ds plan`` and
``stage="auto"`` both build a :class:`PlanInputs` with :meth:`PlanInputs.build`, plan it with :func:`plan_rows` and
take :func:`~lightning_gaudi_ds.planning.memory.fastest_fitting` of the rows, so that they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gaudi_ds.planning.memory import CONFIGURATIONS, DEFAULT_HEADROOM, Buckets, ModelSpec, plan_memory


@dataclass(frozen=True)
class PlanInputs:
    """The model, the devices, the precision, the optimizer (and whether the strategy fuses it), the bucket and
    communication settings, the memories and the activations the plan is made for."""

    spec: ModelSpec
    device_type: str  # "cpu" | "cuda" | "hpu": its communication defaults, and whether Adam is fused
    devices: int
    nodes: int
    precision: str
    buckets: Buckets
    fused_optimizer: bool  # the optimizer steps with torch's fused kernel: no step temporaries
    optimizer: str = "adamw"
    device_memory: int | None = None
    host_memory: int | None = None
    headroom: float = DEFAULT_HEADROOM
    activation_bytes: int | None = None  # of one micro batch on one device
    param_groups: int = 1
    hpz: bool = False  # ZeRO-3 rows with hpZ (zero_hpz_partition_size = devices per node)
    sequence_parallel_size: int = 1  # ranks sharing each sequence: each holds 1/K of the activations

    @classmethod
    def build(cls, spec: ModelSpec, *, device_type: str, zero_config: Mapping[str, Any] | None = None,
              optimizer: str = "adamw", **rest: Any) -> PlanInputs:
        """Inputs for ``spec`` on ``device_type``, as the strategy will train it: the buckets and communication
        settings of ``zero_config`` (the ``zero_optimization`` section as its resolution starts; None: the
        strategy's default config) with the device's defaults where it sets none
        (:meth:`~lightning_gaudi_ds.planning.memory.Buckets.for_model`), and whether the engine fuses the torch
        ``optimizer`` (:func:`~lightning_gaudi_ds.devices.fuses_adam`). ``rest``: the other fields."""
        from lightning_gaudi_ds.devices import fuses_adam

        return cls(spec=spec, device_type=device_type, optimizer=optimizer,
                   buckets=Buckets.for_model(spec.hidden_size, zero_config, device_type),
                   fused_optimizer=fuses_adam(device_type, optimizer), **rest)


def plan_rows(inputs: PlanInputs,
              configurations: Sequence[tuple[int, bool, bool]] = CONFIGURATIONS) -> list[dict[str, Any]]:
    """:func:`~lightning_gaudi_ds.planning.memory.plan_memory` of ``inputs``, fastest configuration first."""
    return plan_memory(
        inputs.spec, devices=inputs.devices, nodes=inputs.nodes, precision=inputs.precision,
        optimizer=inputs.optimizer, device_memory=inputs.device_memory, host_memory=inputs.host_memory,
        headroom=inputs.headroom, activation_bytes=inputs.activation_bytes, buckets=inputs.buckets,
        param_groups=inputs.param_groups, configurations=configurations, device_type=inputs.device_type,
        fused_optimizer=inputs.fused_optimizer, hpz=inputs.hpz, sequence_parallel_size=inputs.sequence_parallel_size,
    )
