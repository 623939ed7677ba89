"""Strategy arguments and Trainer flags that DeepSpeed cannot honour, refused before any process starts: in the
strategy's ``__init__`` (:func:`check_arguments`), in the Trainer's constructor (:func:`check_before_launch`) and at
setup (:func:`check_trainer_flags`); from plain values (the strategy gathers them), as the exception types
Lightning raises in the same situation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds._compat import _validate_device_index_selection
from lightning_gaudi_ds.config import zeropp
from lightning_gaudi_ds.config.keys import AUTO, STRATEGY_ARG_KEYS, report
from lightning_gaudi_ds.config.keys import get as get_key
from lightning_gaudi_ds.config.load import ConfigError, check_activation_checkpointing, check_nvme, config_problems
from lightning_gaudi_ds.config.resolve import strategy_arg_values
from lightning_gaudi_ds.devices import hpu_available, validate_precision
from lightning_gaudi_ds.launch import envvars
from lightning_gaudi_ds.launch.environments import check_multi_node_environment
from lightning_gaudi_ds.planning import auto

if TYPE_CHECKING:
    import torch
    from lightning.fabric.plugins.environments import ClusterEnvironment

    from lightning_gaudi_ds.planning.auto import AutoStage


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


def check_trainer(trainer: Any, *, serving: bool) -> None:
    """:func:`check_trainer_flags` for the flags of ``trainer`` (None: not attached, nothing to check)."""
    if trainer is not None:
        check_trainer_flags(
            serving=serving, fitting=trainer.state.fn == TrainerFn.FITTING,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm, gradient_clip_val=trainer.gradient_clip_val,
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


def check_arguments(
    *, stage: Any, hpu_mode: Any, torch_compile: Any, offload_optimizer: Any, offload_parameters: Any,
    measure_activations: Any, number_checkpoints: Any, remote_device: Any, device_memory: Any, config: Any,
) -> AutoStage | None:
    """``HPUDeepSpeedStrategy``'s own arguments, refused in its ``__init__`` before anything is built; returns
    ``stage="auto"``'s arguments (None for a fixed stage)."""
    hpu.check_mode_name(hpu_mode, "`HPUDeepSpeedStrategy(hpu_mode={})`", ConfigError)
    if torch_compile not in (None, True, False):
        raise ConfigError(f"`HPUDeepSpeedStrategy(torch_compile={torch_compile!r})`: pass True, False or None"
                          " (None: on for HPUs in eager mode, off elsewhere).")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3, AUTO):
        raise ConfigError(
            f"`HPUDeepSpeedStrategy(stage={stage!r})` is not a ZeRO stage. Allowed: 0, 1, 2, 3"
            " (0: no sharding, 1: optimizer states, 2: + gradients, 3: + parameters) or 'auto' (the fastest"
            " that fits, chosen at setup)."
        )
    for name, flag in (("offload_optimizer", offload_optimizer), ("offload_parameters", offload_parameters),
                       ("measure_activations", measure_activations)):
        if not isinstance(flag, bool):  # the string "false" would count as true
            raise ConfigError(f"`HPUDeepSpeedStrategy({name}={flag!r})` is not a boolean; pass True or False.")
    if number_checkpoints is not None and (isinstance(number_checkpoints, bool)
                                           or not isinstance(number_checkpoints, int) or number_checkpoints < 1):
        raise ConfigError(
            f"`HPUDeepSpeedStrategy(number_checkpoints={number_checkpoints!r})`: pass the number of"
            " deepspeed.checkpointing.checkpoint calls in one forward pass, a whole number >= 1, or None."
        )
    check_remote_device(remote_device)
    auto_stage = auto.from_strategy_arguments(
        stage, device_memory, measure_activations, offload_optimizer=offload_optimizer,
        offload_parameters=offload_parameters,
    )
    if offload_parameters and stage != 3 and config is None:
        raise ConfigError(
            f"`HPUDeepSpeedStrategy(stage={stage}, offload_parameters=True)`: parameter offload needs ZeRO"
            " stage 3. Use stage=3, or offload_optimizer=True alone for stages 1-2."
        )
    return auto_stage


def check_device_indices(devices: Sequence[torch.device]) -> None:
    """Lightning's check, wherever devices have an index (CUDA; HPU and CPU devices have none): DeepSpeed takes
    the device index as the process's local rank, so `devices=[1]` or `[0, 2]` would fail inside it."""
    if all(device.index is not None for device in devices):
        _validate_device_index_selection(list(devices))


def check_before_launch(
    *, devices: Sequence[torch.device], precision: str, num_nodes: int, cluster_environment: ClusterEnvironment | None,
    auto_stage: AutoStage | None, config: Mapping[str, Any], config_source: str | None,
) -> None:
    """What the Trainer's constructor knows once accelerator and precision are chosen, checked before any process
    is started: the package's environment variables, precision on the device, ``stage="auto"``'s device memory, the
    multi-node environment, CUDA device indices and the config's activation checkpointing; warns when a visible
    Gaudi goes unused."""
    device_type = devices[0].type
    validate_precision(precision, devices[0])
    if auto_stage is not None:
        auto.check_device(auto_stage, device_type)
    envvars.check()  # a bad LIGHTNING_GAUDI_DS_* variable is refused before any process starts
    if num_nodes > 1:
        check_multi_node_environment(cluster_environment, num_nodes)
    check_device_indices(devices)
    check_activation_checkpointing(config, config_source or "built from HPUDeepSpeedStrategy's arguments")
    zeropp.check_before_launch(config, devices_per_node=len(devices), num_nodes=num_nodes, device_type=device_type,
                               source=config_source)
    if device_type == "cpu" and hpu_available():
        rank_zero_warn(
            "A Gaudi device is visible but the Trainer selected CPU (Lightning's accelerator='auto' does not"
            " look for HPUs). Pass `Trainer(accelerator='hpu')` to train on Gaudi."
        )
