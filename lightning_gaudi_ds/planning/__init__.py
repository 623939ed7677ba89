"""Memory planning: bytes per rank for each ZeRO stage and offload, and the fastest configuration that fits."""

from lightning_gaudi_ds.planning.inputs import PlanInputs, plan_rows
from lightning_gaudi_ds.planning.memory import (
    CONFIGURATIONS,
    Buckets,
    ModelSpec,
    PlanRow,
    choose,
    comm_bytes_per_param,
    fastest_fitting,
    model_states,
    plan_memory,
    sequence_parallel_activation_bytes,
)
from lightning_gaudi_ds.planning.units import format_bytes, parse_bytes

__all__ = [
    "CONFIGURATIONS",
    "Buckets",
    "ModelSpec",
    "PlanInputs",
    "PlanRow",
    "choose",
    "comm_bytes_per_param",
    "fastest_fitting",
    "format_bytes",
    "model_states",
    "parse_bytes",
    "plan_memory",
    "plan_rows",
    "sequence_parallel_activation_bytes",
]
