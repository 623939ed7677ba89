"""Strategy arguments and Trainer flags that DeepSpeed cannot honour, refused before any process starts; from plain
values (the strategy gathers them), as the exception types Lightning raises in the same situation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_gaudi_ds.config.keys import AUTO, STRATEGY_ARG_KEYS, report
from lightning_gaudi_ds.config.keys import get as get_key
from lightning_gaudi_ds.config.load import ConfigError, check_nvme, config_problems
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
        raise ConfigError(
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


# Config keys Lightning's default config fills from arguments of another name (the rest: the key's last part).
_ARGUMENT_OF_KEY = {
    **{key: name for name, key in STRATEGY_ARG_KEYS.items()},
    "zero_optimization.offload_optimizer.device": "offload_optimizer_device",
    "zero_optimization.offload_optimizer.buffer_count": "optimizer_buffer_count",
    "zero_optimization.offload_param.device": "offload_params_device",
    "zero_optimization.offload_param.buffer_count": "params_buffer_count",
    "zero_optimization.offload_param.buffer_size": "params_buffer_size",
}


def check_argument_config(config: Mapping[str, Any]) -> None:
    """Validate the config built from ``HPUDeepSpeedStrategy``'s arguments as a user's config is
    (:func:`~lightning_gaudi_ds.config.load.validate_config`), each problem named by the argument that set it."""
    problems = []
    for problem in config_problems(config):
        key, sep, rest = problem.partition(": ")
        value = get_key(config, key, None) if sep else None
        if not sep or value is None or isinstance(value, Mapping):
            problems.append(problem)
            continue
        name = _ARGUMENT_OF_KEY.get(key, key.rsplit(".", 1)[-1])
        problems.append(f"HPUDeepSpeedStrategy({name}={value!r}) ({key}): {rest}")
    if problems:
        raise ConfigError(report("HPUDeepSpeedStrategy's arguments are invalid", problems))


def check_remote_device(remote_device: Any) -> None:
    """ZeRO-3 builds the parameters on the training device (None), on CPU or on NVMe (DeepSpeed's offload devices)."""
    if remote_device not in (None, "none", "cpu", "nvme"):
        raise ConfigError(
            f"HPUDeepSpeedStrategy(remote_device={remote_device!r}) is not a device ZeRO-3 can create the parameters"
            " on. Allowed: None (the training device, the default), 'cpu' or 'nvme'."
        )
