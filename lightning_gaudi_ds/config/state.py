"""A strategy's DeepSpeed config across its life: loaded in ``__init__``, ``stage="auto"`` chosen at setup, and
resolved again whenever the facts it depends on change (a new Trainer, a fit after validate, ZeRO-3's second pass
once ``configure_model`` has built the parameters).

:class:`StrategyConfig` owns that state machine; the strategy holds one and calls it from Lightning's hooks. It reads
the facts from the strategy (its Trainer, module, precision plugin, devices), never the other way round.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gaudi_ds._compat import _format_precision_config, attached_trainer, train_dataloaders
from lightning_gaudi_ds.config.load import check_activation_checkpointing
from lightning_gaudi_ds.config.resolve import (
    AutoContext,
    ConfigResolver,
    drop_device_tuned,
    explicit_arguments,
    publish_resolved,
)
from lightning_gaudi_ds.config.sizing import hidden_size, mark_model_buckets, shared_batch_size
from lightning_gaudi_ds.config.validate import check_argument_config, check_arguments, check_offload
from lightning_gaudi_ds.devices import device_spec
from lightning_gaudi_ds.errors import ConfigError
from lightning_gaudi_ds.planning import auto

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from torch.nn import Module

    from lightning_gaudi_ds.planning.auto import AutoStage
    from lightning_gaudi_ds.planning.inputs import PlanInputs


class StrategyConfig(ConfigResolver):
    """The config's state for one strategy: where it came from, the explicit arguments, ``stage="auto"``'s
    arguments and choice, and what the last resolution was made for.

    ``explicit_args``: the strategy arguments the caller set; ``auto``: ``stage="auto"``'s arguments (None for a
    fixed stage).
    """

    def __init__(self, explicit_args: Mapping[str, Any], auto_stage: AutoStage | None) -> None:
        super().__init__(explicit_args)
        self.auto = auto_stage
        self.chosen: dict[str, Any] | None = None  # stage="auto": what setup chose
        # What the last resolution was made for: the Trainer (weakly: an id is reused after garbage collection),
        # its TrainerFn and whether the module had parameters yet.
        self._for: tuple[weakref.ref[pl.Trainer] | None, Any, bool] | None = None
        # Ranks per sequence (the strategy's sequence parallelism): DeepSpeed's data-parallel world is world / K.
        self.sequence_parallel_size = 1

    @classmethod
    def from_arguments(
        cls, strategy_cls: type, arguments: Mapping[str, Any], *, hpu_mode: Any, torch_compile: Any,
        measure_activations: Any, number_checkpoints: Any, device_memory: Any,
    ) -> tuple[StrategyConfig, Any]:
        """A strategy's arguments checked (:func:`~lightning_gaudi_ds.config.validate.check_arguments`), and its
        config state; returns it and the ``stage`` to hand to Lightning's ``__init__`` (2, a placeholder until
        setup, for ``stage="auto"``: Lightning builds its default config with it).

        ``arguments``: those named like Lightning's ``DeepSpeedStrategy`` arguments (``stage``, ``config``,
        offload, ``remote_device``, ...), the rest by keyword.
        """
        stage = arguments["stage"]
        auto_stage = check_arguments(
            stage=stage, hpu_mode=hpu_mode, torch_compile=torch_compile,
            offload_optimizer=arguments["offload_optimizer"], offload_parameters=arguments["offload_parameters"],
            measure_activations=measure_activations, number_checkpoints=number_checkpoints,
            remote_device=arguments["remote_device"], device_memory=device_memory, config=arguments["config"],
        )
        explicit = explicit_arguments(strategy_cls, {**arguments, "number_checkpoints": number_checkpoints})
        if auto_stage is not None:
            stage = 2
            explicit.pop("stage")
        return cls(explicit, auto_stage), stage

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

    def publish(self, trainer: pl.Trainer, *, rank_zero: bool) -> None:
        """At the start of training (not earlier: a file in the logger's directory before it makes CSVLogger warn
        that the directory is not empty), the last fit's resolved config logged and written beside the logs."""
        pending = self.take_unpublished()
        if pending is not None:
            publish_resolved(*pending, trainer.log_dir or trainer.default_root_dir, rank_zero=rank_zero)

    def adopt(self, config: dict[str, Any], *, user_config: bool, offload_parameters: bool) -> None:
        """After Lightning's ``__init__`` built or loaded ``config``: check it, and mark ``stage="auto"`` pending."""
        if self.source is None:  # Lightning's config from the arguments: checked as a user's config is
            check_argument_config(config)
        if self.auto is not None:
            auto.mark_pending(config, user_config, self.source)
        check_offload(config, self.explicit_args, offload_parameters, self.source)

    def check_activation_checkpointing(self, config: Mapping[str, Any]) -> None:
        check_activation_checkpointing(config, self.source or "built from HPUDeepSpeedStrategy's arguments")

    def ensure_resolved(self, strategy: DeepSpeedStrategy) -> dict[str, Any]:
        """``strategy.config``, with ``stage="auto"`` chosen and every ``"auto"`` filled for the Trainer attached now.

        Lightning formats once; this resolves again when a fit follows validate/test/predict or comes from a new
        Trainer, and when ZeRO-3's ``model_sharded_context`` resolved before ``configure_model`` built any parameter
        (bucket sizes come from the model).
        """
        self.choose(strategy)
        module = strategy.lightning_module
        trainer = attached_trainer(module)
        has_params = module is not None and any(True for _ in module.parameters())
        fn = trainer.state.fn if trainer is not None else None
        if self._for is not None:
            ref, last_fn, last_params = self._for
            last_trainer = ref() if ref is not None else None
            if (last_trainer is trainer and (ref is None) == (trainer is None) and last_fn == fn
                    and last_params == has_params):
                assert isinstance(strategy.config, dict)
                return strategy.config
        config = self.resolve_for(strategy)
        self._for = (weakref.ref(trainer) if trainer is not None else None, fn, has_params)
        return config

    def resolve_for(self, strategy: DeepSpeedStrategy) -> dict[str, Any]:
        """The unresolved config with every ``"auto"`` filled from the strategy's Trainer, module and devices."""
        module = strategy.lightning_module
        trainer = attached_trainer(module)
        fit = trainer if trainer is not None and trainer.state.fn == TrainerFn.FITTING else None
        total = None
        if fit is not None and "scheduler" in (strategy.config or {}):
            steps = fit.estimated_stepping_batches
            total = int(steps) if steps != float("inf") else None
        return self.resolve_with(
            strategy, module, strategy.precision_plugin.precision,
            accumulate_grad_batches=trainer.accumulate_grad_batches if trainer is not None else 1,
            micro_batch_size=shared_batch_size(train_dataloaders(fit)) if fit is not None else None,
            gradient_clip_val=trainer.gradient_clip_val if trainer is not None else None,
            hparams=dict(getattr(module, "hparams", None) or {}),
            total_steps=total,
            fitting=fit is not None,
        )

    def resolve_with(self, strategy: Any, module: Module | None, precision: str, **facts: Any) -> dict[str, Any]:
        """The unresolved config of ``strategy`` (Lightning's or Fabric's ``DeepSpeedStrategy``) with every
        ``"auto"`` filled from ``module``, ``precision``, the strategy's devices and ``facts`` (the
        :class:`AutoContext` fields a Trainer knows: batch sizes, accumulation, clipping, steps, hparams)."""
        assert isinstance(strategy.config, dict)
        hidden = hidden_size(module) if module is not None else None
        config = self.start(strategy.config, hidden)
        _format_precision_config(  # Lightning's fp16 block (loss-scale arguments) where the config has none
            config, precision, strategy.loss_scale, strategy.loss_scale_window, strategy.min_loss_scale,
            strategy.initial_scale_power, strategy.hysteresis,
        )
        spec = device_spec(strategy.root_device) if strategy.parallel_devices else None
        return self.resolve(config, AutoContext(
            world_size=max(1, strategy.world_size // self.sequence_parallel_size),  # sequences trained at once
            precision=precision, hidden_size=hidden,
            device_type=spec.device_type if spec is not None else None,
            zero_defaults=spec.zero_defaults if spec is not None else {}, **facts,
        ))

    def choose(self, strategy: Any, module: Module | None = None, precision: str | None = None) -> None:
        """stage='auto': plan for the real model and devices, agree on rank 0's choice, write it into the config.

        Runs before the config's first resolution: in ZeRO-3's ``model_sharded_context`` before ``configure_model``
        (the parameters are counted on a meta-device copy), else at ``setup``; under Fabric when the model is set
        up (``module`` and ``precision``: default, the Trainer's).
        """
        config = strategy.config
        module = module if module is not None else getattr(strategy, "lightning_module", None)
        if self.auto is None or not auto.pending(config) or module is None:
            return
        assert isinstance(config, dict)
        chosen_precision = precision or strategy.precision_plugin.precision
        decision = auto.decide(
            lambda: self.plan_inputs(strategy, module, chosen_precision), type(module).__name__
        ) if strategy.is_global_zero else auto.Decision()
        decision = strategy.broadcast(decision, src=0) if strategy.world_size > 1 else decision
        self.chosen = auto.adopt(decision, config)

    def plan_inputs(self, strategy: Any, module: Module, precision: str) -> PlanInputs:
        """What ``stage="auto"`` plans ``module`` with on ``strategy``'s devices (:func:`auto.inputs_for_module`):
        the config's bucket and communication settings as its resolution will start from them."""
        assert self.auto is not None and strategy.parallel_devices is not None and isinstance(strategy.config, dict)
        return auto.inputs_for_module(
            module, self.auto, device=strategy.root_device, devices=len(strategy.parallel_devices),
            nodes=strategy.num_nodes, precision=precision,
            zero_config=self.as_resolved(strategy.config).get("zero_optimization"),
            sequence_parallel_size=self.sequence_parallel_size,  # activations split K ways
        )

    def as_resolved(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` as its resolution starts (:meth:`ConfigResolver.start`), bucket sizes from the model unless set:
        for Lightning's default config, the device-tuned keys Lightning filled from its argument defaults
        (``overlap_comm=True``...) are dropped, so that the device's defaults apply, as they will."""
        if self.source is None:
            return mark_model_buckets(drop_device_tuned(config, self.explicit_args), self.explicit_args)
        return config
