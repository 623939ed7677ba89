"""Key names of a DeepSpeed config and dotted-path access to them (``"zero_optimization.stage"``)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

from lightning_gaudi_ds.precisions import AUTO, ZERO, ZERO_DEFAULT_KEYS

__all__ = [
    "AUTO",
    "AUTO_KEYS",
    "BUCKET_KEYS",
    "CONFIG_FILENAME",
    "DEVICE_TUNED_KEYS",
    "MAX_PROBLEMS",
    "MISSING",
    "OFFLOAD_SECTIONS",
    "OPTIMIZER_AUTO_KEYS",
    "SCHEDULER_AUTO_KEYS",
    "STRATEGY_ARG_KEYS",
    "TRAINER_KEYS",
    "ZERO",
    "fmt",
    "get",
    "leaves",
    "offloads_optimizer",
    "offloads_parameters",
    "report",
    "same",
    "set_key",
    "short",
    "without_disabled_offload",
]

CONFIG_FILENAME = "deepspeed_config.json"

BUCKET_KEYS = (
    f"{ZERO}.reduce_bucket_size",
    f"{ZERO}.allgather_bucket_size",
    f"{ZERO}.stage3_prefetch_bucket_size",
    f"{ZERO}.stage3_param_persistence_threshold",
)
#: ZeRO++ hpZ: the secondary partition's size; "auto" is the devices of one node (config/zeropp.py).
HPZ_KEY = f"{ZERO}.zero_hpz_partition_size"
#: Keys whose default depends on the device (the device table's ``zero_defaults``): filled where not set.
DEVICE_TUNED_KEYS = tuple(f"{ZERO}.{k}" for k in ZERO_DEFAULT_KEYS)
OPTIMIZER_AUTO_KEYS = tuple(f"optimizer.params.{k}" for k in ("lr", "betas", "eps", "weight_decay"))
SCHEDULER_AUTO_KEYS = tuple(
    f"scheduler.params.{k}" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
)
#: Every key that may be ``"auto"``; anywhere else DeepSpeed would receive the string itself.
AUTO_KEYS: tuple[str, ...] = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "bf16.enabled",
    "fp16.enabled",
    *OPTIMIZER_AUTO_KEYS,
    *SCHEDULER_AUTO_KEYS,
    *BUCKET_KEYS,
    *DEVICE_TUNED_KEYS,
    HPZ_KEY,
)

#: Keys Lightning always sets from the Trainer: left out of a config, they are filled as if "auto".
TRAINER_KEYS = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "gradient_clipping")

# Strategy argument -> config key it stands for (compared with, or filled into, a user config).
STRATEGY_ARG_KEYS: dict[str, str] = {
    "stage": f"{ZERO}.stage",
    "contiguous_gradients": f"{ZERO}.contiguous_gradients",
    "overlap_comm": f"{ZERO}.overlap_comm",
    "allgather_partitions": f"{ZERO}.allgather_partitions",
    "reduce_scatter": f"{ZERO}.reduce_scatter",
    "allgather_bucket_size": f"{ZERO}.allgather_bucket_size",
    "reduce_bucket_size": f"{ZERO}.reduce_bucket_size",
    "sub_group_size": f"{ZERO}.sub_group_size",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "partition_activations": "activation_checkpointing.partition_activations",
    "cpu_checkpointing": "activation_checkpointing.cpu_checkpointing",
    "contiguous_memory_optimization": "activation_checkpointing.contiguous_memory_optimization",
    "synchronize_checkpoint_boundary": "activation_checkpointing.synchronize_checkpoint_boundary",
    "logging_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "loss_scale": "fp16.loss_scale",
    "initial_scale_power": "fp16.initial_scale_power",
    "loss_scale_window": "fp16.loss_scale_window",
    "hysteresis": "fp16.hysteresis",
    "min_loss_scale": "fp16.min_loss_scale",
}

#: Returned by :func:`get` for a key the config does not have.
MISSING: Any = object()


def offloads_optimizer(config: Any) -> bool:
    """Whether ``config`` offloads the optimizer states (and step) to CPU or NVMe: ZeRO-Offload, which steps
    with DeepSpeedCPUAdam and so needs that op built."""
    zero = config.get(ZERO) if isinstance(config, Mapping) else None
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    device = offload.get("device") if isinstance(offload, Mapping) else None
    return str(device).lower() in ("cpu", "nvme")


#: The offload sections a config may turn off with ``false``, as Lightning's strategy accepts them.
OFFLOAD_SECTIONS = ("offload_optimizer", "offload_param")


def without_disabled_offload(config: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``config`` without the offload sections set to ``false`` (no offload), which Lightning
    keeps in its config and DeepSpeed's own model refuses ("Input should be a valid dictionary")."""
    out = dict(config)
    zero = out.get(ZERO)
    if isinstance(zero, Mapping) and any(zero.get(s) is False for s in OFFLOAD_SECTIONS):
        out[ZERO] = {k: v for k, v in zero.items() if not (k in OFFLOAD_SECTIONS and v is False)}
    return out


def offloads_parameters(config: Any) -> bool:
    """Whether ``config`` offloads parameters (``offload_param``) to CPU or NVMe; only ZeRO-3 does that."""
    return str(get(config, f"{ZERO}.offload_param.device", None) if isinstance(config, Mapping) else None).lower() \
        in ("cpu", "nvme")


def get(config: Mapping[str, Any], key: str, default: Any = MISSING) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if part in ("bf16",) and isinstance(node, Mapping) and "bfloat16" in node:
                node = node["bfloat16"]  # DeepSpeed's older name for the bf16 block
                continue
            return default
        node = node[part]
    return node


def set_key(config: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        if part == "bf16" and part not in node and "bfloat16" in node:
            part = "bfloat16"
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def leaves(config: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted keys of every non-mapping value."""
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            yield from leaves(value, dotted)
        else:
            yield dotted


def same(a: Any, b: Any) -> bool:
    """Config-value equality: numbers within rounding, bools never equal to ints, lists like tuples."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def fmt(value: Any) -> str:
    try:
        return json.dumps(value)  # the user wrote JSON: show true/false/null as JSON
    except (TypeError, ValueError):
        return repr(value)


#: Problems listed in one error; a config with thousands of bad keys gets the first ones and a count.
MAX_PROBLEMS = 20
_MAX_PROBLEM_CHARS = 500


def report(title: str, problems: list[str], note: str = "") -> str:
    shown = [p if len(p) <= _MAX_PROBLEM_CHARS else p[:_MAX_PROBLEM_CHARS] + "... (cut)"
             for p in problems[:MAX_PROBLEMS]]
    lines = "\n".join(f"  - {p}" for p in shown)
    if len(problems) > MAX_PROBLEMS:
        lines += f"\n  ... and {len(problems) - MAX_PROBLEMS} more"
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return f"{title}: {count}:\n{lines}" + (f"\n{note}" if note else "")


def short(value: Any, limit: int = 80) -> str:
    """:func:`fmt`, cut to ``limit`` characters (a value can be a whole pasted config)."""
    text = fmt(value)
    return text if len(text) <= limit else text[:limit] + "..."
