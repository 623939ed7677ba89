"""Strategy arguments and Trainer flags that DeepSpeed cannot honour, refused before any process starts; from plain
values (the strategy gathers them), as the exception types Lightning raises in the same situation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_gaudi_ds.config.keys import AUTO
from lightning_gaudi_ds.config.keys import get as get_key
from lightning_gaudi_ds.config.load import ConfigError, check_nvme
from lightning_gaudi_ds.config.resolve import strategy_arg_values


def check_offload(
    config: Mapping[str, Any], explicit: Mapping[str, Any], offload_parameters: bool, source: str | None
) -> None:
    """What the config and the offload arguments add up to, refused at construction where DeepSpeed would train
    without offloading (parameters below stage 3) or fail minutes in (NVMe without a usable path or libaio).

    ``explicit``: the strategy arguments the user passed; ``source``: where the config came from (None: built from
    the arguments).
    """
    if offload_parameters and source is not None:
        stage = get_key(config, "zero_optimization.stage", None)
        stage = explicit.get("stage", 0) if stage is None else stage
        if stage != AUTO and stage != 3:
            raise ConfigError(
                f"`HPUDeepSpeedStrategy(offload_parameters=True)` with the DeepSpeed config ({source}) at ZeRO"
                f" stage {stage}: parameter offload needs stage 3, and stage {stage} would train without"
                " offloading anything. Set the config's zero_optimization.stage to 3, or use"
                " offload_optimizer=True alone."
            )
    check_nvme(config, strategy_arg_values(explicit) if source is not None else {}, source)


def check_trainer_flags(
    *, serving: bool, fitting: bool, gradient_clip_algorithm: str | None, gradient_clip_val: Any
) -> None:
    """Trainer settings DeepSpeed cannot honour. ``serving``: the strategy was given inference-engine arguments."""
    if serving and fitting:
        raise MisconfigurationException(
            "HPUDeepSpeedStrategy(tensor_parallel=..., dtype=..., ...) serves a model with DeepSpeed's inference"
            " engine: trainer.predict, trainer.validate and trainer.test. Train with a strategy without these"
            " arguments (e.g. HPUDeepSpeedStrategy(stage=3)), then serve its checkpoint with `ckpt_path=`."
        )
    if gradient_clip_algorithm == "value":
        raise ConfigError(
            "DeepSpeed does not support clipping gradients by value (`Trainer(gradient_clip_algorithm='value')`);"
            f" it clips by norm only. Use `Trainer(gradient_clip_val={gradient_clip_val},"
            " gradient_clip_algorithm='norm')`."
        )
