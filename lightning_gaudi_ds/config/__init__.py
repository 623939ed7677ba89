"""DeepSpeed JSON configs, as pure ``dict -> dict`` functions: nothing here starts or queries ``torch.distributed``
or knows the strategy.

- :mod:`.load`: read a path, dict or ``$PL_DEEPSPEED_CONFIG_PATH``; check keys against DeepSpeed's own.
- :mod:`.resolve`: fill every ``"auto"`` from the facts the strategy gathers (:class:`AutoContext`), one function
  per config section; :class:`ConfigResolver` keeps a strategy's config across Trainer calls.
- :mod:`.sizing`: the model's hidden size and the bucket sizes it implies.
- :mod:`.validate`: the strategy's arguments, offload against the config, Trainer flags DeepSpeed cannot honour,
  the checks before any process starts.
- :mod:`.state`: :class:`StrategyConfig`, a strategy's config across Trainer calls (load, ``stage="auto"``,
  resolution), given the facts as values.

DeepSpeed's config schema is read inside the functions that need it: importing DeepSpeed selects its global
accelerator, which the strategy does only once the Trainer has chosen the device. The names below load on first
use, so that importing the constants of :mod:`.keys` imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gaudi_ds.config.keys import (
        AUTO,
        AUTO_KEYS,
        BUCKET_KEYS,
        CONFIG_FILENAME,
        STRATEGY_ARG_KEYS,
        TRAINER_KEYS,
        ZERO,
        offloads_optimizer,
        offloads_parameters,
    )
    from lightning_gaudi_ds.config.load import (
        ENV_VAR,
        INLINE_KEYS,
        READ_BY_THE_PACKAGE,
        ConfigError,
        ConfigNotFoundError,
        check_activation_checkpointing,
        check_nvme,
        iter_auto,
        known_keys,
        load_config,
        validate_config,
    )
    from lightning_gaudi_ds.config.resolve import (
        AutoContext,
        ConfigResolver,
        Resolved,
        explicit_arguments,
        publish_resolved,
        resolve_config,
        strategy_arg_values,
        write_resolved,
    )
    from lightning_gaudi_ds.config.sizing import (
        bucket_hints,
        bucket_sizes,
        hidden_size,
        mark_model_buckets,
        shared_batch_size,
    )
    from lightning_gaudi_ds.config.state import (
        StrategyConfig,
    )

__all__ = [
    "AUTO",
    "AUTO_KEYS",
    "BUCKET_KEYS",
    "CONFIG_FILENAME",
    "ENV_VAR",
    "INLINE_KEYS",
    "READ_BY_THE_PACKAGE",
    "STRATEGY_ARG_KEYS",
    "TRAINER_KEYS",
    "ZERO",
    "AutoContext",
    "ConfigError",
    "ConfigNotFoundError",
    "ConfigResolver",
    "Resolved",
    "StrategyConfig",
    "bucket_hints",
    "bucket_sizes",
    "check_activation_checkpointing",
    "check_nvme",
    "explicit_arguments",
    "hidden_size",
    "iter_auto",
    "known_keys",
    "publish_resolved",
    "load_config",
    "mark_model_buckets",
    "offloads_optimizer",
    "offloads_parameters",
    "resolve_config",
    "shared_batch_size",
    "strategy_arg_values",
    "validate_config",
    "write_resolved",
]

# Public name -> the module of this package that defines it; imported on first access.
_EXPORTS = {
    "AUTO": "keys",
    "AUTO_KEYS": "keys",
    "AutoContext": "resolve",
    "BUCKET_KEYS": "keys",
    "CONFIG_FILENAME": "keys",
    "ConfigError": "load",
    "ConfigNotFoundError": "load",
    "ConfigResolver": "resolve",
    "ENV_VAR": "load",
    "INLINE_KEYS": "load",
    "READ_BY_THE_PACKAGE": "load",
    "Resolved": "resolve",
    "STRATEGY_ARG_KEYS": "keys",
    "StrategyConfig": "state",
    "TRAINER_KEYS": "keys",
    "ZERO": "keys",
    "bucket_hints": "sizing",
    "bucket_sizes": "sizing",
    "check_activation_checkpointing": "load",
    "check_nvme": "load",
    "explicit_arguments": "resolve",
    "hidden_size": "sizing",
    "iter_auto": "load",
    "known_keys": "load",
    "load_config": "load",
    "mark_model_buckets": "sizing",
    "offloads_optimizer": "keys",
    "offloads_parameters": "keys",
    "publish_resolved": "resolve",
    "resolve_config": "resolve",
    "shared_batch_size": "sizing",
    "strategy_arg_values": "resolve",
    "validate_config": "load",
    "write_resolved": "resolve",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
