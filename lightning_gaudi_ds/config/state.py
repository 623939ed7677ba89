"""A strategy's DeepSpeed config across its life: loaded in ``__init__``, ``stage="auto"`` chosen at setup, and
resolved again whenever the facts it depends on change (a new Trainer, a fit after validate, ZeRO-3's second pass
once ``configure_model`` has built the parameters).

:class:`StrategyConfig` owns that state machine; the strategy holds one and calls it from Lightning's hooks with the
facts as values (:class:`Placement`, :class:`LossScale`, the Trainer's facts): it never reads the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gaudi_ds._compat import _format_precision_config
from lightning_gaudi_ds.config import zeropp
from lightning_gaudi_ds.config.load import check_activation_checkpointing
from lightning_gaudi_ds.config.resolve import AutoContext, ConfigResolver, drop_device_tuned, publish_resolved
from lightning_gaudi_ds.config.sizing import hidden_size, mark_model_buckets
from lightning_gaudi_ds.config.validate import check_argument_config, check_offload
from lightning_gaudi_ds.devices import device_spec
from lightning_gaudi_ds.errors import ConfigError
from lightning_gaudi_ds.planning import auto

if TYPE_CHECKING:
    import torch
    from torch.nn import Module

    from lightning_gaudi_ds.checkpoint.io import RankZeroComm
    from lightning_gaudi_ds.planning.auto import AutoStage
    from lightning_gaudi_ds.planning.inputs import PlanInputs


@dataclass(frozen=True)
class Placement:
    """Where the strategy runs, as the config's resolution needs it: its root device (None before the Trainer or
    Fabric chose one), the processes in all, per node, and the nodes."""

    device: torch.device | None
    world_size: int
    devices: int
    nodes: int


@dataclass(frozen=True)
class LossScale:
    """Lightning's loss-scale arguments, for the fp16 block Lightning builds where a config has none."""

    loss_scale: float
    loss_scale_window: int
    min_loss_scale: int
    initial_scale_power: int
    hysteresis: int


class StrategyConfig(ConfigResolver):
    """The config's state for one strategy: where it came from, the explicit arguments, ``stage="auto"``'s
    arguments and choice, and what the last resolution was made for.

    ``explicit_args``: the strategy arguments the caller set; ``auto``: ``stage="auto"``'s arguments (None for a
    fixed stage).
    """

    def __init__(self, explicit_args: Mapping[str, Any], auto_stage: AutoStage | None, hpz: bool = False) -> None:
        super().__init__(explicit_args)
        self.auto = auto_stage
        self.hpz = hpz  # HPUDeepSpeedStrategy(hpz=True): ZeRO++ hpZ over the devices of one node (zeropp.py)
        # Ranks per sequence (the strategy's sequence parallelism): DeepSpeed's data-parallel world is world / K.
        self.sequence_parallel_size = 1
        self.chosen: dict[str, Any] | None = None  # stage="auto": what setup chose
        self._for: Hashable | None = None  # what the last resolution was made for (see ensure_resolved)

    @property
    def zero_arguments(self) -> dict[str, Any]:
        """The explicit arguments, ``stage="auto"`` included."""
        return {**self.explicit_args, **({"stage": auto.AUTO} if self.auto is not None else {})}

    def load(self, config: Any) -> dict[str, Any] | None:
        loaded = super().load(config)
        if loaded is not None:
            rank_zero_info(f"DeepSpeed config: {self.source}")
        return loaded

    def zero_stage(self, config: Mapping[str, Any]) -> int:
        """The ZeRO stage of the resolved ``config`` (0-3); refused while ``stage="auto"`` is not chosen yet."""
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        if stage == auto.AUTO:
            raise ConfigError(
                "stage='auto' is chosen when the Trainer sets the strategy up (fit, validate, test, predict);"
                " read `zero_stage` after that."
            )
        return int(stage)

    def publish(self, log_dir: str, *, rank_zero: bool) -> None:
        """At the start of training (not earlier: a file in the logger's directory before it makes CSVLogger warn
        that the directory is not empty), the last fit's resolved config logged and written into ``log_dir``."""
        pending = self.take_unpublished()
        if pending is not None:
            publish_resolved(*pending, log_dir, rank_zero=rank_zero)

    def adopt(self, config: dict[str, Any], *, user_config: bool, offload_parameters: bool) -> None:
        """After Lightning's ``__init__`` built or loaded ``config``: check it, and mark ``stage="auto"`` pending."""
        if self.source is None:  # Lightning's config from the arguments: checked as a user's config is
            check_argument_config(config)
        if self.auto is not None:
            auto.mark_pending(config, user_config, self.source)
        check_offload(config, self.explicit_args, offload_parameters, self.source)
        zeropp.adopt(config, self.hpz, self.source)

    def check_activation_checkpointing(self, config: Mapping[str, Any]) -> None:
        check_activation_checkpointing(config, self.source or "built from HPUDeepSpeedStrategy's arguments")

    def ensure_resolved(
        self, config: dict[str, Any], made_for: Hashable, resolve: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """``config`` as it is when the last resolution was ``made_for`` the same facts (the Trainer, its TrainerFn,
        whether the module has parameters yet), else ``resolve()``'s.

        Lightning formats once; the Trainer strategy resolves again when a fit follows validate/test/predict or
        comes from a new Trainer, and when ZeRO-3's ``model_sharded_context`` resolved before ``configure_model``
        built any parameter (bucket sizes come from the model).
        """
        if self._for is not None and self._for == made_for:
            return config
        resolved = resolve()
        self._for = made_for
        return resolved

    def resolve_with(
        self, config: dict[str, Any], module: Module | None, precision: str, placement: Placement,
        loss_scale: LossScale, **facts: Any,
    ) -> dict[str, Any]:
        """The unresolved ``config`` with every ``"auto"`` filled from ``module``, ``precision``, the
        ``placement`` and ``facts`` (the :class:`AutoContext` fields a Trainer knows: batch sizes, accumulation,
        clipping, steps, hparams)."""
        hidden = hidden_size(module) if module is not None else None
        config = self.start(config, hidden)
        _format_precision_config(  # Lightning's fp16 block (loss-scale arguments) where the config has none
            config, precision, loss_scale.loss_scale, loss_scale.loss_scale_window, loss_scale.min_loss_scale,
            loss_scale.initial_scale_power, loss_scale.hysteresis,
        )
        spec = device_spec(placement.device) if placement.device is not None else None
        return self.resolve(config, AutoContext(
            world_size=max(1, placement.world_size // self.sequence_parallel_size),  # sequences trained at once
            precision=precision, hidden_size=hidden,
            device_type=spec.device_type if spec is not None else None,
            zero_defaults=spec.zero_defaults if spec is not None else {},
            devices_per_node=placement.devices or None, **facts,
        ))

    def choose(
        self, config: dict[str, Any], module: Module | None, precision: str, placement: Placement, comm: RankZeroComm
    ) -> None:
        """stage='auto': plan for the real model and devices, agree on rank 0's choice (``comm``), write it into
        ``config``.

        Runs before the config's first resolution: in ZeRO-3's ``model_sharded_context`` before ``configure_model``
        (the parameters are counted on a meta-device copy), else at ``setup``; under Fabric when the model is set
        up.
        """
        if self.auto is None or not auto.pending(config) or module is None:
            return
        decision = auto.decide(
            lambda: self.plan_inputs(config, module, precision, placement), type(module).__name__
        ) if comm.is_global_zero else auto.Decision()
        decision = comm.broadcast(decision, src=0) if placement.world_size > 1 else decision
        self.chosen = auto.adopt(decision, config)

    def plan_inputs(self, config: dict[str, Any], module: Module, precision: str, placement: Placement) -> PlanInputs:
        """What ``stage="auto"`` plans ``module`` with on the ``placement``'s devices
        (:func:`auto.inputs_for_module`): the config's bucket and communication settings as its resolution will
        start from them."""
        assert self.auto is not None and placement.device is not None
        return auto.inputs_for_module(
            module, self.auto, device=placement.device, devices=placement.devices, nodes=placement.nodes,
            precision=precision, zero_config=self.as_resolved(config).get("zero_optimization"),
            sequence_parallel_size=self.sequence_parallel_size,  # activations split K ways
        )

    def as_resolved(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` as its resolution starts (:meth:`ConfigResolver.start`), bucket sizes from the model unless set:
        for Lightning's default config, the device-tuned keys Lightning filled from its argument defaults
        (``overlap_comm=True``...) are dropped, so that the device's defaults apply, as they will."""
        if self.source is None:
            return mark_model_buckets(drop_device_tuned(config, self.explicit_args), self.explicit_args)
        return config
