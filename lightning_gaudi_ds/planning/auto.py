"""``stage="auto"``: the fastest ZeRO configuration that fits the real model on the real devices.

Functions of a module and numbers: the strategy's config (:class:`~lightning_gaudi_ds.config.state.StrategyConfig`)
gathers the facts (devices, precision, memory) into :func:`inputs_for_module` (the inputs ``plan`` builds too),
rank 0 plans and chooses with :func:`decide`, the :class:`Decision` is broadcast, and every rank writes it into
its config with :func:`adopt`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_gaudi_ds.planning.inputs import PlanInputs, plan_rows
from lightning_gaudi_ds.planning.memory import DEFAULT_HEADROOM, ModelSpec
from lightning_gaudi_ds.planning.units import parse_bytes
from lightning_gaudi_ds.precisions import AUTO


@dataclass(frozen=True)
class AutoStage:
    """What ``HPUDeepSpeedStrategy(stage="auto", ...)`` was told: memory overrides and the activation opt-in."""

    device_memory: int | None = None
    host_memory: int | None = None
    measure_activations: bool = False
    headroom: float = DEFAULT_HEADROOM

    @classmethod
    def from_arguments(cls, device_memory: int | str | None, host_memory: int | str | None = None,
                       measure_activations: bool = False) -> AutoStage:
        return cls(
            device_memory=None if device_memory is None else parse_bytes(device_memory, "device_memory"),
            host_memory=None if host_memory is None else parse_bytes(host_memory, "host_memory"),
            measure_activations=bool(measure_activations),
        )


def builds_in_configure_model(module: nn.Module) -> bool:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return isinstance(module, pl.LightningModule) and is_overridden("configure_model", module, pl.LightningModule)


def module_spec(module: nn.Module) -> ModelSpec:
    """The parameters the module trains with: counted on a meta-device copy when ``configure_model`` builds them
    (so that ZeRO-3's ``zero.Init`` can still partition them), else on the module itself."""
    from lightning_gaudi_ds.planning.model import spec_before_configure_model, spec_from_module

    if builds_in_configure_model(module):
        return spec_before_configure_model(module)
    return spec_from_module(module)


def activation_bytes_of(module: nn.Module, precision: str, device: Any) -> int:
    """One forward/backward of a copy of ``module`` on ``module.example_input_array`` (one micro batch)."""
    import copy

    from lightning_gaudi_ds._compat import attached_trainer
    from lightning_gaudi_ds.errors import ConfigError
    from lightning_gaudi_ds.planning.activations import measure_activation_bytes

    inputs = getattr(module, "example_input_array", None)
    if inputs is None:
        raise ConfigError(
            f"measure_activations=True runs one micro batch through {type(module).__name__}, and it has no"
            " `example_input_array`. Set `self.example_input_array = <one micro batch>` in its __init__, or drop"
            " measure_activations."
        )
    trainer = attached_trainer(module)
    probe = copy.deepcopy(module, {id(trainer): None} if trainer is not None else {})
    if builds_in_configure_model(probe):
        probe.configure_model()  # type: ignore[operator]  # a LightningModule's hook
    try:
        return measure_activation_bytes(probe, inputs, precision, device)
    finally:
        del probe


def inputs_for_module(
    module: nn.Module,
    auto: AutoStage,
    *,
    device: Any,
    devices: int,
    nodes: int,
    precision: str,
    zero_config: Mapping[str, Any] | None = None,
    spec: ModelSpec | None = None,
    sequence_parallel_size: int = 1,
) -> PlanInputs:
    """What ``stage="auto"`` plans with (:class:`PlanInputs`, built as ``plan`` builds them): the module's
    parameters, ``device``'s type and memory (``auto``'s, else read from it), the host's memory, the activations
    of one micro batch when asked (``1/sequence_parallel_size`` of them per rank), and the buckets of
    ``zero_config`` (the section as the strategy starts resolving it)."""
    from lightning_gaudi_ds.planning.detect import detect_device_memory, detect_host_memory

    return PlanInputs.build(
        spec or module_spec(module), device_type=device.type, zero_config=zero_config, devices=devices, nodes=nodes,
        precision=precision,
        device_memory=auto.device_memory or detect_device_memory(device.type),
        host_memory=auto.host_memory or detect_host_memory(), headroom=auto.headroom,
        activation_bytes=activation_bytes_of(module, precision, device) if auto.measure_activations else None,
        sequence_parallel_size=sequence_parallel_size,
    )


def config_contradiction(config: Mapping[str, Any] | None, source: str | None) -> str | None:
    """Why a user config cannot go with ``stage="auto"`` (it sets the stage or an offload), or None."""
    zero = (config or {}).get("zero_optimization")
    if not isinstance(zero, Mapping):
        return None
    set_keys = [k for k in ("stage", "offload_optimizer", "offload_param") if k in zero and zero[k] != AUTO]
    if not set_keys:
        return None
    values = ", ".join(f"zero_optimization.{k}={zero[k]!r}" for k in set_keys)
    return (
        f"`HPUDeepSpeedStrategy(stage='auto')` chooses the ZeRO stage and offload, but the DeepSpeed config"
        f" ({source or 'dict'}) sets {values}. Either remove {'it' if len(set_keys) == 1 else 'them'} from the"
        f" config (or set \"auto\"), or pass the stage you want instead of 'auto'."
    )


def apply_choice(config: MutableMapping[str, Any], row: Mapping[str, Any]) -> None:
    """Write the chosen stage and offload into a DeepSpeed config (in place)."""
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = int(row["stage"])
    for key, on in (("offload_optimizer", row["offload_optimizer"]), ("offload_param", row["offload_parameters"])):
        if on:
            zero[key] = {"device": "cpu", "pin_memory": False}
        else:
            zero.pop(key, None)


def pending(config: Any) -> bool:
    """Whether ``config`` still waits for the planner's choice (its stage is ``"auto"``)."""
    return isinstance(config, Mapping) and (config.get("zero_optimization") or {}).get("stage") == AUTO


@dataclass(frozen=True)
class Decision:
    """Rank 0's choice, broadcast to every rank: the chosen stage, offload and label, or why none fits."""

    choice: dict[str, Any] | None = None
    error: str | None = None


def decide(inputs: Callable[[], PlanInputs], name: str) -> Decision:
    """Rank 0's choice for ``inputs()`` (:func:`inputs_for_module`), as a value to broadcast: the rows'
    :func:`~lightning_gaudi_ds.planning.memory.choose`, as ``plan`` prints it. Logs the plan's table and the
    choice."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from lightning_gaudi_ds.planning.memory import choose, format_table

    try:
        rows = plan_rows(inputs())
        row = choose(rows)
        rank_zero_info(format_table(rows, name) + f"\nstage='auto' chose {row['label']} (the fastest configuration"
                       " that fits)")
        return Decision(choice={k: row[k] for k in ("stage", "offload_optimizer", "offload_parameters", "label")})
    except ValueError as err:
        return Decision(error=str(err))


def adopt(decision: Decision, config: MutableMapping[str, Any]) -> dict[str, Any]:
    """Write rank 0's :func:`decide` into ``config`` and return the choice; its error is raised on every rank."""
    from lightning_gaudi_ds.errors import ConfigError

    if decision.error is not None:
        raise ConfigError(f"HPUDeepSpeedStrategy(stage='auto'): {decision.error}")
    assert decision.choice is not None
    apply_choice(config, decision.choice)
    return decision.choice


def from_strategy_arguments(
    stage: Any, device_memory: int | str | None, measure_activations: bool, *, offload_optimizer: bool,
    offload_parameters: bool,
) -> AutoStage | None:
    """The strategy's ``stage="auto"`` arguments (None for a fixed stage); refuses those that contradict it."""
    from lightning_gaudi_ds.errors import ConfigError

    if stage == AUTO:
        if offload_optimizer or offload_parameters:
            raise ConfigError(
                "`HPUDeepSpeedStrategy(stage='auto')` chooses offload itself; drop"
                f" offload_optimizer={offload_optimizer}/offload_parameters={offload_parameters}, or pass a"
                " stage instead of 'auto'."
            )
        return AutoStage.from_arguments(device_memory, measure_activations=measure_activations)
    if device_memory is not None or measure_activations:
        raise ConfigError(
            "`HPUDeepSpeedStrategy(device_memory=..., measure_activations=...)` only apply to stage='auto'"
            f" (the planner's choice); with stage={stage} drop them."
        )
    return None


def mark_pending(config: MutableMapping[str, Any], user_config: bool, source: str | None) -> None:
    """Set the config's stage to ``"auto"`` until setup chooses; refuses a user config that sets stage or offload."""
    from lightning_gaudi_ds.errors import ConfigError

    problem = config_contradiction(config if user_config else None, source)
    if problem:
        raise ConfigError(problem)
    config.setdefault("zero_optimization", {})["stage"] = AUTO


def check_device(auto: AutoStage, device_type: str) -> None:
    """Refuses, before any process starts, a device whose memory cannot be read (CPU) when none was given."""
    from lightning_gaudi_ds.errors import ConfigError

    if auto.device_memory is None and device_type == "cpu":
        raise ConfigError(
            "`HPUDeepSpeedStrategy(stage='auto')` on CPU needs the memory to plan for: pass device_memory"
            " (e.g. device_memory='24GiB'; on HPU and CUDA it is read from the device)."
        )
