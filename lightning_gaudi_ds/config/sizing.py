"""Communication bucket sizes from the model's hidden size (Hugging Face's rule), in elements.

Lightning's default buckets are 2e8 elements (400 MB each in bf16) and DeepSpeed's 5e8, whatever the model:
for a small model that is memory spent on nothing, so the default config sizes them from the model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_gaudi_ds.config.keys import AUTO, BUCKET_KEYS, ZERO


def bucket_sizes(hidden: int) -> dict[str, int]:
    """Hugging Face's rule for bucket sizes from the model's hidden size (elements, not bytes), rounded up to an
    even count: ZeRO 1-2 assert that the allgather bucket is a multiple of 2 elements (an odd hidden size fails)."""
    square = hidden * hidden + (hidden * hidden) % 2
    return {
        f"{ZERO}.reduce_bucket_size": square,
        f"{ZERO}.allgather_bucket_size": square,
        f"{ZERO}.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        f"{ZERO}.stage3_param_persistence_threshold": 10 * hidden,
    }


def hidden_size(module: Any) -> int | None:
    """The model's hidden size: ``config.hidden_size`` of the module or a submodule (Hugging Face), else hparam
    ``hidden_size``, else the smaller dimension of the largest 2-D parameter; None when none of these exists."""
    modules = module.modules() if hasattr(module, "modules") else [module]
    for sub in modules:
        value = getattr(getattr(sub, "config", None), "hidden_size", None)
        if isinstance(value, int) and value > 0:
            return value
    value = (getattr(module, "hparams", None) or {}).get("hidden_size")
    if isinstance(value, int) and value > 0:
        return value
    best: tuple[int, int] | None = None
    for param in module.parameters() if hasattr(module, "parameters") else ():
        shape = tuple(getattr(param, "ds_shape", None) or param.shape)  # ZeRO-3 partitioned parameters
        if len(shape) == 2 and (best is None or shape[0] * shape[1] > best[0]):
            best = (shape[0] * shape[1], min(shape))
    return best[1] if best else None


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
