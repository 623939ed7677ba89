"""Communication bucket sizes in a config, from the model's hidden size (Hugging Face's rule, in
:mod:`lightning_gaudi_ds.planning.buckets`, which the planner shares), and the loaders' shared batch size.

Lightning's default buckets are 2e8 elements (400 MB each in bf16) and DeepSpeed's 5e8, whatever the model:
for a small model that is memory spent on nothing, so the default config sizes them from the model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_gaudi_ds.config.keys import AUTO, BUCKET_KEYS, ZERO
from lightning_gaudi_ds.planning.buckets import bucket_sizes, hidden_size

__all__ = ["bucket_hints", "bucket_sizes", "hidden_size", "mark_model_buckets", "shared_batch_size"]


def bucket_hints(config: Mapping[str, Any], hidden: int | None) -> list[str]:
    """One line per bucket size a user config leaves to DeepSpeed's default when the model wants far less."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = config.get(ZERO)
    if not hidden or not isinstance(zero, dict) or zero.get("stage", 0) in (0, AUTO):
        return []
    names = ("reduce_bucket_size", "stage3_prefetch_bucket_size" if zero["stage"] == 3 else "allgather_bucket_size")
    fields = {info.alias or name: info.default for name, info in DeepSpeedZeroConfig.model_fields.items()}
    wanted = bucket_sizes(hidden)
    return [
        f'{ZERO}.{name} is left to DeepSpeed\'s default of {int(fields[name]):,} elements; "auto" would size it from'
        f" the model (hidden size {hidden}): {wanted[f'{ZERO}.{name}']:,}"
        for name in names
        if name not in zero
        and isinstance(fields.get(name), (int, float))
        and fields[name] > 10 * wanted[f"{ZERO}.{name}"]
    ]


def mark_model_buckets(config: Mapping[str, Any], explicit_args: Mapping[str, Any]) -> dict[str, Any]:
    """For Lightning's default config (no user config): bucket keys set to ``"auto"`` unless passed explicitly.

    Lightning's default buckets are 2e8 elements (400 MB each in bf16) whatever the model size.
    """
    cfg = copy.deepcopy(dict(config))
    zero = cfg.get(ZERO)
    if not isinstance(zero, dict):
        return cfg
    stage3 = zero.get("stage") == 3
    for key in BUCKET_KEYS:
        name = key.split(".", 1)[1]
        if name in explicit_args or (name.startswith("stage3_") and not stage3):
            continue
        if name == "allgather_bucket_size" and stage3:
            continue  # not used by ZeRO-3
        zero[name] = AUTO
    return cfg


def shared_batch_size(loaders: Iterable[Any] | None) -> int | None:
    """The batch size every DataLoader in ``loaders`` shares (read from it or its batch sampler), else None."""
    sizes = set()
    for loader in loaders or ():
        sampler = getattr(loader, "batch_sampler", None)
        size = getattr(loader, "batch_size", None) or getattr(sampler, "batch_size", None)
        sizes.add(size if isinstance(size, int) else None)
    return sizes.pop() if len(sizes) == 1 else None
