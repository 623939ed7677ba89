"""``HPUDeepSpeedStrategy`` for Lightning Fabric: Fabric's DeepSpeed strategy made device-neutral (HPU, CUDA, CPU).

Fabric's ``DeepSpeedStrategy`` refuses every accelerator but CUDA. This subclass overrides only what depends on the
device or on this package, and delegates as the Trainer strategy (:mod:`lightning_gaudi_ds.strategy`) does: argument
checks and the config with ``"auto"`` filled to :class:`lightning_gaudi_ds.config.StrategyConfig`, the device and the
process group to :mod:`lightning_gaudi_ds.engine.process` and :mod:`lightning_gaudi_ds.engine.device`. ``setup``,
``backward``, ``no_backward_sync``, ``all_reduce``, ``barrier``, ``broadcast``, ``init_module`` (ZeRO-3's
``zero.Init``) and ``save``/``load`` are Fabric's own.

    fabric = Fabric(accelerator="cpu", devices=2, strategy="hpu_deepspeed_stage_3", precision="bf16-mixed")
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_gaudi_ds import checkpoint as ckpt
from lightning_gaudi_ds._compat import _PATH, _move_state_into
from lightning_gaudi_ds.checkpoint.io import refusal_named
from lightning_gaudi_ds.config import ConfigError, StrategyConfig, offloads_optimizer
from lightning_gaudi_ds.devices import device_spec
from lightning_gaudi_ds.engine import checkpointing, inference, process, train
from lightning_gaudi_ds.engine.device import reduce_on_device
from lightning_gaudi_ds.engine.step import engine_call
from lightning_gaudi_ds.jit_ops.startup import SHM_MODE_ENV
from lightning_gaudi_ds.sequence import SequenceParallel
from lightning_gaudi_ds.strategy import HPUDeepSpeedStrategy as TrainerStrategy

if TYPE_CHECKING:
    import deepspeed


class HPUDeepSpeedStrategy(process.StrategyCommon, DeepSpeedStrategy):
    """DeepSpeed ZeRO stages 0-3 (with CPU/NVMe offload) for Lightning Fabric on Intel Gaudi, CUDA GPUs and CPUs.

    The arguments are those of the Trainer's :class:`lightning_gaudi_ds.HPUDeepSpeedStrategy`, documented there
    (one signature for both, checked with the same errors), less its inference-engine ones (``tensor_parallel``,
    ``dtype``, ``replace_with_kernel_inject``, ``injection_policy``, ``replace_method``, ``enable_cuda_graph``)
    and the fit loop's ``resume_data_position``, which are refused: ``stage`` (0-3 or ``"auto"``: chosen when
    ``fabric.setup`` sees the model), ``device_memory``, ``measure_activations``, ``config`` (path or dict,
    ``PL_DEEPSPEED_CONFIG_PATH`` when unset; its ``"auto"`` values are filled from Fabric's precision, world size
    and the model), offload, ``hpu_mode``, ``torch_compile``, ``number_checkpoints``, ``zero3_leaf_modules``,
    ``sequence_parallel_size`` and ``sequence_parallel_modules`` (the loaders of ``fabric.setup_dataloaders`` yield
    each rank's part of the sequences; ``strategy.sequence_parallel.shard(batch)`` splits another batch), and
    every other argument of :class:`lightning.fabric.strategies.DeepSpeedStrategy` by keyword.
    """

    @process.arguments_of(TrainerStrategy)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _TRAINER_ARGUMENTS.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.update(arguments.pop("kwargs"))
        inference = [name for name in _INFERENCE_ONLY if arguments.pop(name) is not None]
        if inference:
            raise ConfigError(
                f"HPUDeepSpeedStrategy for Fabric has no inference engine: {', '.join(inference)} configure"
                " the Trainer strategy's trainer.predict/validate/test; remove them (Fabric runs the model as trained)."
            )
        if arguments.pop("resume_data_position") is not True:
            raise ConfigError(
                "resume_data_position=False: Fabric has no fit loop whose data position the strategy restores (your"
                " loop reads its loader; keep the step in the state you fabric.save and skip to it). Remove it."
            )
        sequence = [arguments.pop(name) for name in _SEQUENCE]  # sequence parallelism
        own = {name: arguments.pop(name) for name in _PACKAGE_ONLY}
        leaf_modules = own.pop("zero3_leaf_modules")
        # Created before Fabric's __init__, which loads the config through _load_config.
        self._resolver, arguments["stage"] = StrategyConfig.from_arguments(type(self), arguments, **own)
        super().__init__(**arguments)
        self._adopt_arguments(config=arguments["config"], offload_parameters=arguments["offload_parameters"],
                              number_checkpoints=own["number_checkpoints"], hpu_mode=own["hpu_mode"],
                              torch_compile=own["torch_compile"], zero3_leaf_modules=leaf_modules)
        self._unresolved: ConfigError | None = None  # set up before the model: what only the model can resolve
        self._sequence = SequenceParallel.create(sequence[0], sequence[1], self.config)  # sequence parallelism
        self._resolver.sequence_parallel_size = self._sequence.size

    # ----------------------------------------------------------------------------------------- set-up
    @override
    def _configure_launcher(self) -> None:
        # Called by Fabric's constructor once accelerator and precision are known: checked before any process starts.
        process.before_launch(self, self._runtime, self._resolver, self.precision.precision)
        assert self.parallel_devices is not None
        self._sequence.before_launch(len(self.parallel_devices) * self.num_nodes)  # sequence parallelism
        super()._configure_launcher()
        process.after_launcher(self._launcher, self._runtime)

    @override
    def setup_environment(self) -> None:
        # Fabric's without its gate that refuses every accelerator but CUDA, plus the device's preparation.
        process.prepare_device(self, self._runtime, process.set_deepspeed_accelerator, self._set_world_ranks)
        DDPStrategy.setup_environment(self)

    @override
    def _setup_distributed(self) -> None:
        mode = inference.shm_comm_mode(None, self.world_size, os.environ.get(SHM_MODE_ENV))
        process.start_distributed(self, self._runtime, set_world_ranks=self._set_world_ranks,
                                  init=self._init_deepspeed_distributed, offload=offloads_optimizer(self.config),
                                  shm_comm=mode)
        self._sequence.start()  # sequence parallelism: its process groups
        self._format_config()
        self._config_initialized = True

    @override
    def _init_deepspeed_distributed(self) -> None:
        process.bounded_init(self, super()._init_deepspeed_distributed)

    @override
    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or device_spec(self.root_device).backend

    # ------------------------------------------------------ DeepSpeed JSON config: load, "auto", contradictions
    @override
    def _load_config(self, config: _PATH | dict[str, Any] | None) -> dict[str, Any] | None:
        return self._resolver.load(config)

    @override
    def _format_config(self) -> None:
        # Before the model exists (fabric.init_module's zero.Init reads it); resolved again with the model in setup.
        # An "auto" only the model can fill (bucket sizes) waits for setup, unless zero.Init needs it first.
        try:
            self.config = self._resolver.resolve_with(self, None, self.precision.precision)
            self._unresolved = None
        except ConfigError as error:
            self._unresolved = error

    # ------------------------------------------------------------------------------------- engine
    @override
    def _initialize_engine(
        self, model: Module, optimizer: Optimizer | None = None, scheduler: Any | None = None
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer, Any]:
        # Fabric's, with stage="auto" chosen and "auto" filled for this model, ZeRO-Offload's optimizer conversion,
        # the device rank from the local rank (CPU and HPU devices have no index), and the engine compiled if asked.
        precision = self.precision.precision
        self._resolver.choose(self, model, precision)
        _check_engine_inputs(model, optimizer, self.config)  # the stage is known: refused before any work
        self.config = self._resolver.resolve_with(self, model, precision)
        if optimizer is not None:
            # Fabric has no resolved-config log: the CPU default for the optimizer is said here
            device_type = device_spec(self.root_device).device_type
            optimizer, _ = train.optimizer_sources(self.config, optimizer, None, device_type, rank_zero_info,
                                                   fabric=True)
        self._runtime.before_engine(model, self.root_device)
        self._sequence.wrap(model)  # sequence parallelism: the all-to-all around attention
        engine, ds_optimizer, ds_scheduler = process.initialize(
            self, process.deepspeed_args(self.root_device, self.local_rank), model, optimizer, scheduler
        )
        self._runtime.compile_engine(engine)
        return engine, ds_optimizer, ds_scheduler

    @override
    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Fabric's version drops the number of checkpoints: DeepSpeed reads the whole section itself.
        assert isinstance(self.config, dict)
        checkpointing.configure(self.config)

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        # Under ZeRO-3, transformers is told too, so that `from_pretrained` inside fabric.init_module loads into the
        # partitions (lightning_gaudi_ds.hf).
        if self._unresolved is not None and self.zero_stage_3:
            raise self._unresolved
        start = functools.partial(self._sequence.sharded_context, super().module_sharded_context,  # mpu for zero.Init
                                  self.config, self.remote_device, enabled=self.zero_stage_3)
        return process.zero_init_context(self.config if self.zero_stage_3 else None, start)

    # ------------------------------------------------ sequence parallelism: what the loaders give each rank
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._sequence.sampler_kwargs(super().distributed_sampler_kwargs)  # a group reads the same samples

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        return self._sequence.process_dataloader(super().process_dataloader(dataloader))  # batches split

    # ------------------------------------------ engine calls: HPU lazy-mode graph breaks (engine.step)
    backward = engine_call(DeepSpeedStrategy.backward)
    optimizer_step = engine_call(DeepSpeedStrategy.optimizer_step)

    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor:
        return reduce_on_device(super().all_reduce, self, tensor, group, reduce_op)

    # ------------------------------------------- checkpoints: crash-safe saves, validation, resharding
    # As under the Trainer (lightning_gaudi_ds.checkpoint): saved into `<path>.partial` and renamed into place once
    # every rank wrote its shard; validated before DeepSpeed reads it, resharded when the world size changed.
    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the resolved DeepSpeed config (0-3)."""
        assert isinstance(self.config, dict)
        return int((self.config.get("zero_optimization") or {}).get("stage", 0))

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

    # ---------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        process.register(cls, strategy_registry)


_TRAINER_ARGUMENTS = inspect.signature(TrainerStrategy)
# The Trainer strategy's arguments that Fabric's refuses, and those of this package that Lightning's do not take.
_INFERENCE_ONLY = ("tensor_parallel", "dtype", "replace_with_kernel_inject", "injection_policy", "replace_method",
                   "enable_cuda_graph")
_PACKAGE_ONLY = ("device_memory", "measure_activations", "hpu_mode", "torch_compile", "number_checkpoints",
                 "zero3_leaf_modules")
_SEQUENCE = ("sequence_parallel_size", "sequence_parallel_modules")
_FABRIC_OPT_IN = "pass `weights_only=False` to fabric.load"


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
