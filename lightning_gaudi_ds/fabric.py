"""``HPUDeepSpeedStrategy`` for Lightning Fabric: Fabric's DeepSpeed strategy made device-neutral (HPU, CUDA, CPU).

Fabric's ``DeepSpeedStrategy`` refuses every accelerator but CUDA. This thin adapter adds to what both strategies
share (:class:`lightning_gaudi_ds.core.base.DeepSpeedCore`) only Fabric's own hooks: the config resolved when
``fabric.setup`` sees the model, the optimizer given to ``fabric.setup`` (ZeRO-Offload's conversion), and
crash-safe, validated, resharded checkpoints through ``fabric.save``/``fabric.load``. ``setup``, ``backward``,
``no_backward_sync``, ``all_reduce``, ``barrier``, ``broadcast``, ``init_module`` (ZeRO-3's ``zero.Init``) are
Fabric's own. It depends on nothing of the Trainer's strategy.

    fabric = Fabric(accelerator="cpu", devices=2, strategy="hpu_deepspeed_stage_3", precision="bf16-mixed")
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

from lightning.fabric.accelerators import Accelerator
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_gaudi_ds import checkpoint as ckpt
from lightning_gaudi_ds import hpu
from lightning_gaudi_ds._compat import _PATH, _move_state_into
from lightning_gaudi_ds.checkpoint.io import refusal_named
from lightning_gaudi_ds.core.base import DeepSpeedCore
from lightning_gaudi_ds.core.options import Options
from lightning_gaudi_ds.engine import train
from lightning_gaudi_ds.engine.inference import INFERENCE_KEYS
from lightning_gaudi_ds.engine.step import engine_call
from lightning_gaudi_ds.errors import ConfigError

if TYPE_CHECKING:
    import deepspeed


class HPUDeepSpeedStrategy(DeepSpeedCore, DeepSpeedStrategy):
    """DeepSpeed ZeRO stages 0-3 (with CPU/NVMe offload) for Lightning Fabric on Intel Gaudi, CUDA GPUs and CPUs.

    The arguments are those of the Trainer's :class:`lightning_gaudi_ds.HPUDeepSpeedStrategy`, documented there,
    less its inference engine's and the fit loop's: ``stage`` (0-3 or ``"auto"``, chosen when ``fabric.setup`` sees
    the model), ``device_memory``, ``measure_activations``, ``config`` (path or dict, ``PL_DEEPSPEED_CONFIG_PATH``
    when unset; its ``"auto"`` values are filled from Fabric's precision, world size and the model), offload,
    ``hpu_mode``, ``torch_compile``, ``number_checkpoints``, ``zero3_leaf_modules``, ``hpz``,
    ``sequence_parallel_size`` and ``sequence_parallel_modules`` (the loaders of ``fabric.setup_dataloaders`` yield
    each rank's part of the sequences; ``strategy.sequence_parallel.shard(batch)`` splits another batch), and every
    other argument of :class:`lightning.fabric.strategies.DeepSpeedStrategy` by keyword.
    """

    def __init__(
        self,
        stage: int | Literal["auto"] = 2,
        *,
        device_memory: int | str | None = None,
        measure_activations: bool = False,
        accelerator: Accelerator | None = None,
        config: _PATH | dict[str, Any] | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        remote_device: str | None = None,
        nvme_path: str = "/local_nvme",
        process_group_backend: str | None = None,
        logging_level: int = logging.WARN,
        hpu_mode: hpu.Mode | None = None,
        torch_compile: bool | None = None,
        number_checkpoints: int | None = None,
        zero3_leaf_modules: Sequence[type[Module] | str] | None = None,
        hpz: bool = False,
        sequence_parallel_size: int | None = None,
        sequence_parallel_modules: Sequence[type[Module] | str] | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_trainer_only(kwargs)
        arguments = dict(
            stage=stage, accelerator=accelerator, config=config, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, remote_device=remote_device, nvme_path=nvme_path,
            process_group_backend=process_group_backend, logging_level=logging_level, **kwargs,
        )
        self._check_arguments(arguments, Options(
            device_memory=device_memory, measure_activations=measure_activations, hpu_mode=hpu_mode,
            torch_compile=torch_compile, number_checkpoints=number_checkpoints, zero3_leaf_modules=zero3_leaf_modules,
            hpz=hpz, sequence_parallel_size=sequence_parallel_size, sequence_parallel_modules=sequence_parallel_modules,
        ))
        super().__init__(**arguments)
        self._adopt_arguments(config=config, offload_parameters=offload_parameters)
        self._unresolved: ConfigError | None = None  # set up before the model: what only the model can resolve

    @property
    @override
    def _precision_name(self) -> str:
        return self.precision.precision

    # ----------------------------------------------------------------------------------------- set-up
    @override
    def setup_environment(self) -> None:
        # A copy of Fabric 2.6.6's without its CUDA-only gate, plus the device's preparation.
        self._prepare_device(self._set_world_ranks)
        DDPStrategy.setup_environment(self)

    @override
    def _setup_distributed(self) -> None:
        # A copy of Fabric 2.6.6's (DeepSpeedCore._start_distributed); the config resolved before the model exists.
        self._start_distributed(self._set_world_ranks)
        self._format_config()
        self._config_initialized = True

    # ------------------------------------------------------ DeepSpeed JSON config: load, "auto", contradictions
    @override
    def _load_config(self, config: _PATH | dict[str, Any] | None) -> dict[str, Any] | None:
        return self._resolver.load(config)

    @override
    def _format_config(self) -> None:
        # Before the model exists (fabric.init_module's zero.Init reads it); resolved again with the model in setup.
        # An "auto" only the model can fill (bucket sizes) waits for setup, unless zero.Init needs it first.
        try:
            self.config = self._resolve_config(None, self._precision_name)
            self._unresolved = None
        except ConfigError as error:
            self._unresolved = error

    # ------------------------------------------------------------------------------------- engine
    @override
    def _initialize_engine(
        self, model: Module, optimizer: Optimizer | None = None, scheduler: Any | None = None
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer, Any]:
        # A copy of Fabric 2.6.6's, with stage="auto" chosen and "auto" filled for this model, ZeRO-Offload's
        # optimizer conversion, the device rank for CPU and HPU devices, and the engine compiled if asked.
        precision = self._precision_name
        self._choose_stage(model, precision)
        _check_engine_inputs(model, optimizer, self.config)  # the stage is known: refused before any work
        self.config = self._resolve_config(model, precision)
        if optimizer is not None:  # Fabric has no resolved-config log: the CPU default for the optimizer is said here
            optimizer, _ = train.optimizer_sources(self.config, optimizer, None, self.device_spec.device_type,
                                                   rank_zero_info, fabric=True)
        self._runtime.before_engine(model, self.root_device)
        self._sequence.wrap(model)  # sequence parallelism: the all-to-all around attention
        return self._deepspeed_initialize(model, optimizer, scheduler)

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        # Under ZeRO-3, transformers is told too, so that `from_pretrained` inside fabric.init_module loads into the
        # partitions (lightning_gaudi_ds.hf).
        if self._unresolved is not None and self.zero_stage_3:
            raise self._unresolved
        return self._zero_init_context(super().module_sharded_context)

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        # sequence parallelism: the loaders of fabric.setup_dataloaders yield each rank's part of the sequences
        return self._sequence.process_dataloader(super().process_dataloader(dataloader))

    # ------------------------------------------ engine calls: HPU lazy-mode graph breaks (engine.step)
    backward = engine_call(DeepSpeedStrategy.backward)
    optimizer_step = engine_call(DeepSpeedStrategy.optimizer_step)

    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor:
        return self._reduce(super().all_reduce, tensor, group, reduce_op)

    # ------------------------------------------- checkpoints: crash-safe saves, validation, resharding
    # As under the Trainer (lightning_gaudi_ds.checkpoint): saved into `<path>.partial` and renamed into place once
    # every rank wrote its shard; validated before DeepSpeed reads it, resharded when the world size changed.
    @override
    def save_checkpoint(
        self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None or filter is not None or len(_engines(state)) != 1:  # Fabric's own errors
            return super().save_checkpoint(path, state, storage_options, filter)
        # The client state is whatever the user put in `state`: not claimed to load with weights_only=True.
        ckpt.save({}, path, self, functools.partial(super().save_checkpoint, state=state), lambda: self.zero_stage,
                  weights_only=False)

    @override
    def load_checkpoint(
        self, path: _PATH, state: Module | Optimizer | dict[str, Any] | None = None, strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        engines = _engines(state) if isinstance(state, dict) else []
        if len(engines) != 1 or (self.load_full_weights and self.zero_stage_3):  # Fabric's own paths and errors
            with refusal_named(path, _FABRIC_OPT_IN):  # a file torch.load refuses: named, with the opt-in
                return super().load_checkpoint(path, state, strict, weights_only)
        assert isinstance(state, dict)
        path = self.broadcast(path)
        engine = engines[0]
        loaded_by_deepspeed = []

        def deepspeed_load() -> dict[str, Any]:
            loaded_by_deepspeed.append(True)
            return super(HPUDeepSpeedStrategy, self).load_checkpoint(path, state, strict, weights_only)

        # The path is checked before the engine is read: an engine without `.module` yet meets the path's error first
        client_state = ckpt.load_checkpoint(
            path, self, zero_stage=self.zero_stage, module=getattr(engine, "module", None),
            fitting=getattr(engine, "optimizer", None) is not None,
            engine=engine, deepspeed_load=deepspeed_load, weights_only=weights_only, strict=strict,
            opt_in=_FABRIC_OPT_IN,
        )
        if not loaded_by_deepspeed:  # resharded: the user's other state goes back into `state` as Fabric's does
            keys = set(client_state) & set(state) - {"optimizer", "lr_scheduler"}
            _move_state_into(source=client_state, destination=state, keys=keys)
        return client_state


_FABRIC_OPT_IN = "pass `weights_only=False` to fabric.load"


def _refuse_trainer_only(kwargs: dict[str, Any]) -> None:
    """The Trainer strategy's arguments that have no meaning under Fabric, refused by name (rather than as an
    unexpected keyword of Fabric's DeepSpeedStrategy)."""
    serving = [name for name in INFERENCE_KEYS if kwargs.get(name) is not None]
    if serving:
        raise ConfigError(
            f"HPUDeepSpeedStrategy for Fabric has no inference engine: {', '.join(serving)} configure"
            " the Trainer strategy's trainer.predict/validate/test; remove them (Fabric runs the model as trained)."
        )
    for name in INFERENCE_KEYS:
        kwargs.pop(name, None)
    if "resume_data_position" in kwargs:
        raise ConfigError(
            f"resume_data_position={kwargs['resume_data_position']!r}: Fabric has no fit loop whose data position the"
            " strategy restores (your loop reads its loader; keep the step in the state you fabric.save and skip to"
            " it). Remove it."
        )


def _check_engine_inputs(model: Module, optimizer: Optimizer | None, config: dict[str, Any]) -> None:
    """Refuse, before DeepSpeed builds anything, what its engine would fail on later: ZeRO-1/2 without an optimizer
    (an AssertionError in DeepSpeed), and a module a ZeRO-3 engine already partitions (set up twice; an
    AttributeError in stage3's backward)."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    name = type(model).__name__
    if optimizer is None and stage in (1, 2) and not config.get("optimizer"):
        raise ConfigError(
            f"fabric.setup_module({name}) at ZeRO stage {stage}, without an optimizer: ZeRO stages 1 and 2 partition"
            f" an optimizer's states, and DeepSpeed refuses an engine without one (\"zero stage {stage} requires an"
            " optimizer\"). To train, set both up: `model, optimizer = fabric.setup(model, optimizer)`. For a model"
            " that only runs forward, use stage 0 or 3: `HPUDeepSpeedStrategy(stage=0)`."
        )
    if stage == 3 and hasattr(model, "ds_id"):  # DeepSpeed's stage-3 hooks number every module they partition
        raise ConfigError(
            f"fabric.setup got a {name} that a ZeRO-3 engine already partitions: this module was set up before, and"
            " DeepSpeed cannot partition it twice (its backward would fail inside stage 3). Use the model that the"
            " first fabric.setup returned, or build a new module (under `fabric.init_module()`) for a second model."
        )


def _engines(state: Any) -> list[Any]:
    from deepspeed import DeepSpeedEngine

    return [value for value in state.values() if isinstance(value, DeepSpeedEngine)]


# Defining the strategy registers its names with Fabric (lightning_gaudi_ds/__init__.py imports this module once
# Lightning is imported).
HPUDeepSpeedStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["HPUDeepSpeedStrategy"]
