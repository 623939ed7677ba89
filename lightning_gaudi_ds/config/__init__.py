"""DeepSpeed JSON configs, as pure ``dict -> dict`` functions: nothing here starts or queries ``torch.distributed``
or knows the strategy.

- :mod:`.load`: read a path, dict or ``$PL_DEEPSPEED_CONFIG_PATH``; check keys against DeepSpeed's own.
- :mod:`.resolve`: fill every ``"auto"`` from the facts the strategy gathers (:class:`AutoContext`), one function
  per config section; :class:`ConfigResolver` keeps a strategy's config across Trainer calls.
- :mod:`.sizing`: the model's hidden size and the bucket sizes it implies.
- :mod:`.validate`: the strategy's arguments, offload against the config, Trainer flags DeepSpeed cannot honour,
  the checks before any process starts.
- :mod:`.state`: :class:`StrategyConfig`, a strategy's config across Trainer calls (load, ``stage="auto"``,
  resolution); it reads the facts from the strategy, the only module here that does.

DeepSpeed's config schema is read inside the functions that need it: importing DeepSpeed selects its global
accelerator, which the strategy does only once the Trainer has chosen the device.
"""

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
from lightning_gaudi_ds.config.state import StrategyConfig

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
