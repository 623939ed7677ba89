"""The model's hidden size and the communication bucket sizes it implies (Hugging Face's rule, in elements): one
rule for the config's resolution (:mod:`lightning_gaudi_ds.config.sizing`) and the planner. Standard library only."""

from __future__ import annotations

from typing import Any

from lightning_gaudi_ds.precisions import ZERO


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
