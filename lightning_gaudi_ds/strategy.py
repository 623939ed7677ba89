"""``HPUDeepSpeedStrategy``: Lightning's DeepSpeed strategy made device-neutral (HPU, CUDA, CPU).

Only the device-dependent hooks are overridden; everything else (precision plugin, checkpointing, ZeRO-3
``zero.Init``, optimizer wiring) is Lightning's own ``DeepSpeedStrategy``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds.devices import DeviceSpec, device_spec, hpu_available, validate_precision

if TYPE_CHECKING:
    import deepspeed

log = logging.getLogger(__name__)

# (name, description, kwargs): the registered strategy names, as lightning-habana documented them.
_REGISTERED: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("hpu_deepspeed", "DeepSpeed (ZeRO stage 2) on HPU, CUDA or CPU", {}),
    ("hpu_deepspeed_stage_1", "DeepSpeed ZeRO stage 1", {"stage": 1}),
    ("hpu_deepspeed_stage_2", "DeepSpeed ZeRO stage 2", {"stage": 2}),
    ("hpu_deepspeed_stage_2_offload", "DeepSpeed ZeRO stage 2, optimizer offloaded to CPU",
     {"stage": 2, "offload_optimizer": True}),
    ("hpu_deepspeed_stage_3", "DeepSpeed ZeRO stage 3", {"stage": 3}),
    ("hpu_deepspeed_stage_3_offload", "DeepSpeed ZeRO stage 3, optimizer and parameters offloaded to CPU",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    ("hpu_deepspeed_stage_3_offload_nvme", "DeepSpeed ZeRO stage 3, optimizer and parameters offloaded to NVMe",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True, "remote_device": "nvme",
      "offload_params_device": "nvme", "offload_optimizer_device": "nvme"}),
)


def _records_explicit_args(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``__init__`` to remember the arguments the caller set (``self._explicit_args``): a set argument can
    contradict a config, a default cannot. An argument passed with its default value counts as not set:
    LightningCLI/jsonargparse passes every argument, defaults included, so it cannot be told apart there.
    ``functools.wraps`` keeps the real signature visible to ``inspect`` and jsonargparse (a ``__new__(*args,
    **kwargs)`` would hide it)."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = dict(inspect.signature(init).bind_partial(self, *args, **kwargs).arguments)
        except TypeError:
            bound = {}  # __init__ reports the bad call
        explicit = bound.pop("kwargs", {})
        explicit.update({k: v for k, v in bound.items() if k != "self"})
        defaults = _init_defaults(type(self))
        self._explicit_args = {k: v for k, v in explicit.items() if not _is_default(v, defaults.get(k, _NO_DEFAULT))}
        init(self, *args, **kwargs)

    return wrapper


_NO_DEFAULT = object()


def _init_defaults(cls: type) -> dict[str, Any]:
    """Default values of every ``__init__`` along ``cls``'s MRO (the most derived class wins)."""
    defaults: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for name, param in inspect.signature(inspect.unwrap(init)).parameters.items():
            if param.default is not inspect.Parameter.empty:
                defaults[name] = param.default
    return defaults


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001  (an exotic __eq__: count the argument as set)
        return False


class HPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO stages 0-3 (with CPU/NVMe offload) for Lightning on Intel Gaudi, CUDA GPUs and CPUs.

    Args:
        stage: ZeRO stage: 0 (plain data parallel through DeepSpeed), 1 (optimizer states sharded),
            2 (+ gradients), 3 (+ parameters).
        accelerator: an accelerator instance; by default the Trainer's ``accelerator`` flag decides
            (``"hpu"``, ``"cuda"``, ``"cpu"`` or ``"auto"``, which does not look for HPUs).
        config: a DeepSpeed config (JSON path or dict); ``PL_DEEPSPEED_CONFIG_PATH`` is read when unset.
        offload_optimizer: ZeRO-Offload of optimizer states (and the step) to CPU.
        offload_parameters: offload parameters too (stage 3).
        process_group_backend: overrides the device's backend (gloo on CPU, nccl on CUDA, hccl on HPU).
        **kwargs: every other argument of :class:`lightning.pytorch.strategies.DeepSpeedStrategy`.
    """

    strategy_name = "hpu_deepspeed"

    @_records_explicit_args
    def __init__(
        self,
        stage: int = 2,
        *,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,  # noqa: F821
        config: Optional[Union[_PATH, dict[str, Any]]] = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        remote_device: Optional[str] = None,
        nvme_path: str = "/local_nvme",
        process_group_backend: Optional[str] = None,
        logging_level: int = logging.WARN,
        **kwargs: Any,
    ) -> None:
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(
                f"`HPUDeepSpeedStrategy(stage={stage!r})` is not a ZeRO stage. Allowed: 0, 1, 2, 3"
                " (0: no sharding, 1: optimizer states, 2: + gradients, 3: + parameters)."
            )
        if offload_parameters and stage != 3 and config is None:
            raise ValueError(
                f"`HPUDeepSpeedStrategy(stage={stage}, offload_parameters=True)`: parameter offload needs ZeRO"
                " stage 3. Use stage=3, or offload_optimizer=True alone for stages 1-2."
            )
        super().__init__(
            accelerator=accelerator,
            stage=stage,
            config=config,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            remote_device=remote_device,
            nvme_path=nvme_path,
            process_group_backend=process_group_backend,
            logging_level=logging_level,
            **kwargs,
        )
        self._mark_step: Optional[Callable[[], None]] = None
        self._owns_local_size = False

    # ----------------------------------------------------------------------------------------- set-up
    @property
    def device_spec(self) -> DeviceSpec:
        """The device-table row of this strategy's root device."""
        return device_spec(self.root_device)

    @override
    def _configure_launcher(self) -> None:
        # Called by the Trainer's constructor once accelerator and precision are known: the earliest point
        # at which a device/precision mismatch can be reported, before any process is started.
        validate_precision(self.precision_plugin.precision, self.parallel_devices[0])
        if self.parallel_devices[0].type == "cpu" and hpu_available():
            rank_zero_warn(
                "A Gaudi device is visible but the Trainer selected CPU (Lightning's accelerator='auto' does not"
                " look for HPUs). Pass `Trainer(accelerator='hpu')` to train on Gaudi."
            )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._validate_trainer_flags()
        # Lightning's DeepSpeedStrategy refuses every accelerator but CUDA here; skip that gate only.
        spec = self.device_spec
        if spec.device_type == "hpu":
            hpu.prepare_environment()
        elif spec.device_type == "cpu" and "LOCAL_SIZE" not in os.environ:
            # DeepSpeed's CPU accelerator counts devices from LOCAL_SIZE (its launcher sets it) and otherwise runs
            # `numactl --hardware` in a subprocess on every call: ZeRO-3 calls it for every reduce bucket.
            # Removed again in teardown, so a later Trainer in this process never reads it as a launcher's.
            os.environ["LOCAL_SIZE"] = str(self.num_processes)
            self._owns_local_size = True
        self._select_deepspeed_accelerator(spec)
        if spec.device_type == "hpu":  # HCCL is prepared before the device is touched
            self.set_world_ranks()
            hpu.init_distributed(self.world_size, self.global_rank, self.local_rank)
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        # Lightning's version validates CUDA device indices, which CPU/HPU devices do not have.
        reset_seed()
        self.set_world_ranks()
        # Issue 8 (lightning_gaudi_ds/ops.py): on every rank, before DeepSpeed JIT-builds anything, clear stale
        # build locks and decide whether the CPU shm comm op is loaded (else plain torch.distributed collectives).
        from lightning_gaudi_ds.ops import prepare_startup

        prepare_startup(self.device_spec.deepspeed_accelerator, self.config, self.world_size)
        self._init_deepspeed_distributed()

    @override
    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or self.device_spec.backend

    def _select_deepspeed_accelerator(self, spec: DeviceSpec) -> None:
        """Make DeepSpeed's global accelerator match the Trainer's device (DS_ACCELERATOR may differ)."""
        import deepspeed.accelerator as ds_acc

        current = ds_acc.get_accelerator()
        if current._name == spec.deepspeed_accelerator:
            return
        deterministic_before = torch.are_deterministic_algorithms_enabled()
        if spec.deepspeed_accelerator == "cpu":
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Cls
        elif spec.deepspeed_accelerator == "cuda":
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Cls
        else:
            from deepspeed.accelerator.hpu_accelerator import HPU_Accelerator as Cls
        rank_zero_info(f"DeepSpeed accelerator: {spec.deepspeed_accelerator} (was {current._name})")
        ds_acc.set_accelerator(Cls())
        if spec.device_type == "hpu":
            hpu.warn_if_deterministic_forced(deterministic_before)

    def _validate_trainer_flags(self) -> None:
        """Trainer settings DeepSpeed cannot honour, reported before the process group starts."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "`Trainer(gradient_clip_algorithm='value')` is not supported by DeepSpeed, which clips by norm only."
                f" Use `Trainer(gradient_clip_val={trainer.gradient_clip_val}, gradient_clip_algorithm='norm')`."
            )

    @override
    def setup(self, trainer: "pl.Trainer") -> None:  # noqa: F821
        if self.device_spec.device_type == "hpu":
            self._mark_step = hpu.mark_step_fn()
            if self.lightning_module is not None:
                self.lightning_module.to(self.root_device)  # HPU: the engine expects the model on the card
        super().setup(trainer)

    # ------------------------------------------------------------------------------------- engine
    def _deepspeed_args(self) -> argparse.Namespace:
        # Lightning passes root_device.index, which is None on CPU and HPU; DeepSpeed needs the local rank.
        index = self.root_device.index
        return argparse.Namespace(device_rank=self.local_rank if index is None else index)

    @override
    def _setup_model_and_optimizer(
        self,
        model: Module,
        optimizer: Optional[Optimizer],
        lr_scheduler: Optional[Any] = None,
    ) -> tuple["deepspeed.DeepSpeedEngine", Optimizer]:
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        import deepspeed

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config.get("zero_allow_untested_optimizer", True)
            inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

    @override
    def _init_optimizers(self) -> tuple[Optimizer, Optional[LRSchedulerConfig]]:
        from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

        assert self.lightning_module is not None
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        if len(optimizers) != 1 or len(schedulers) > 1:
            names = [type(o).__name__ for o in optimizers]
            raise ValueError(
                f"`configure_optimizers` returned {len(optimizers)} optimizers {names} and {len(schedulers)}"
                " schedulers; DeepSpeed takes exactly one optimizer and at most one scheduler. Return a single"
                " optimizer (use parameter groups for different settings)."
            )
        optimizer = optimizers[0]
        if hpu.is_fused_adam(optimizer):
            raise ValueError(
                f"`configure_optimizers` returned Habana's fused optimizer {type(optimizer).__qualname__}, which"
                " does not work with DeepSpeed. Return a regular optimizer such as torch.optim.AdamW; DeepSpeed"
                " runs its own optimizer step."
            )
        return optimizer, schedulers[0] if schedulers else None

    # ------------------------------------------------------------------- HPU lazy-mode graph breaks
    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._graph_break()
        return loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._graph_break()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, *args, **kwargs)

    def _evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._graph_break()
        output = step(*args, **kwargs)
        self._graph_break()
        return output

    def _graph_break(self) -> None:
        if self._mark_step is not None:
            self._mark_step()

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        # HCCL reduces with sum/min/max only: do "mean" as sum / (ranks in the group) there.
        if self._get_process_group_backend() == "hccl" and isinstance(tensor, Tensor) and _is_mean(reduce_op):
            size = torch.distributed.get_world_size(group) if group is not None else self.world_size
            return super().reduce(tensor, group, "sum") / size
        return super().reduce(tensor, group, reduce_op)

    @override
    def teardown(self) -> None:
        super().teardown()
        if self._owns_local_size:
            os.environ.pop("LOCAL_SIZE", None)
            self._owns_local_size = False

    # -------------------------------------------- DeepSpeed JSON config (issue 3): load, "auto", contradictions
    # Lightning's __init__ calls _load_config; setup (and ZeRO-3's model_sharded_context) call _init_config_if_needed
    # -> _format_config, which fills every "auto" with lightning_gaudi_ds.config.resolve_config. The strategy only
    # gathers the facts (train loader batch size, Trainer flags, module hparams, model hidden size).
    @override
    def _load_config(self, config: Optional[Union[_PATH, dict[str, Any]]]) -> Optional[dict[str, Any]]:
        from lightning_gaudi_ds.config import load_config, validate_config

        loaded, source = load_config(config)
        if loaded is not None:
            validate_config(loaded, source or "dict")
            rank_zero_info(f"DeepSpeed config: {source}")
        self._config_source: Optional[str] = source  # None: Lightning's default config, built from the arguments
        self._raw_config: Optional[dict[str, Any]] = None  # snapshot of `config` before the first resolution
        self._config_resolved_for: Optional[tuple[int, Any]] = None
        return loaded

    @override
    def _init_config_if_needed(self) -> None:
        # Lightning formats once; resolve again when a fit follows validate/test/predict or comes from a new Trainer.
        trainer = getattr(self.lightning_module, "_trainer", None)
        # ZeRO-3's model_sharded_context resolves before configure_model has built any parameter: resolve again
        # at setup once the model exists, so bucket sizes come from it.
        has_params = self.lightning_module is not None and any(True for _ in self.lightning_module.parameters())
        key = (id(trainer), trainer.state.fn if trainer is not None else None, has_params)
        if not self._config_initialized or key != self._config_resolved_for:
            self._format_config()
            self._config_initialized = True
            self._config_resolved_for = key

    @override
    def _format_config(self) -> None:
        import copy

        from lightning.fabric.strategies.deepspeed import _format_precision_config
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_gaudi_ds import config as dsc

        assert isinstance(self.config, dict)
        if self._raw_config is None:
            self._raw_config = copy.deepcopy(self.config)
        raw, source = self._raw_config, self._config_source
        explicit = getattr(self, "_explicit_args", {})  # set by the __init__ wrapper; a subclass may bypass it
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        hidden = dsc.hidden_size(module) if module is not None else None
        if source is None and hidden:  # no user config: size the buckets from the model, not Lightning's 2e8
            raw = dsc.mark_model_buckets(raw, explicit)
        raw = copy.deepcopy(raw)  # Lightning's fp16 block (loss-scale arguments) where the config has none
        _format_precision_config(
            raw, self.precision_plugin.precision, self.loss_scale, self.loss_scale_window, self.min_loss_scale,
            self.initial_scale_power, self.hysteresis,
        )
        micro = self._train_loader_batch_size(trainer) if fitting else None
        total = None
        if fitting and "scheduler" in raw:
            steps = trainer.estimated_stepping_batches
            total = int(steps) if steps != float("inf") else None
        ctx = dsc.AutoContext(
            world_size=self.world_size,
            accumulate_grad_batches=trainer.accumulate_grad_batches if trainer is not None else 1,
            micro_batch_size=micro,
            gradient_clip_val=trainer.gradient_clip_val if trainer is not None else None,
            precision=self.precision_plugin.precision,
            hparams=dict(getattr(module, "hparams", None) or {}),
            total_steps=total,
            hidden_size=hidden,
            strategy_args=explicit if source is not None else {},
            fitting=fitting,
        )
        resolved = dsc.resolve_config(raw, ctx, source or "built from HPUDeepSpeedStrategy's arguments")
        self.config = resolved.config
        if fitting:  # published at on_train_start: a file in the logger's directory before it starts would make
            # CSVLogger warn that the directory "exists and is not empty"
            self._config_to_publish = (resolved, dsc.bucket_hints(raw, hidden) if source is not None else [])

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        pending = getattr(self, "_config_to_publish", None)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if pending is not None and trainer is not None:
            self._config_to_publish = None
            self._publish_config(pending[0], trainer, pending[1])

    @staticmethod
    def _train_loader_batch_size(trainer: "pl.Trainer") -> Optional[int]:  # noqa: F821
        """The train DataLoader's batch size, building the loader as Trainer.estimated_stepping_batches does (after
        LightningDataModule.setup has run); the fit loop then reuses it."""
        loop = trainer.fit_loop
        if loop._combined_loader is None:
            loop.setup_data()
        if loop._combined_loader is None:
            return None
        sizes = set()
        for loader in loop._combined_loader.flattened:
            size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
            sizes.add(size if isinstance(size, int) else None)
        return sizes.pop() if len(sizes) == 1 else None

    def _publish_config(self, resolved: Any, trainer: "pl.Trainer", hints: list[str]) -> None:  # noqa: F821
        """Log the resolved config once (rank 0) and write it next to the run's logs, to reproduce the run."""
        import json
        from pathlib import Path

        from lightning_gaudi_ds.config import CONFIG_FILENAME

        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast: every rank calls it
        if not self.is_global_zero:
            return
        text = json.dumps(resolved.config, indent=2, default=repr)
        path = Path(log_dir) / CONFIG_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        filled = "".join(f"\n  {line}" for line in resolved.filled)
        rank_zero_info(f"DeepSpeed config resolved (written to {path}); filled:{filled or ' nothing'}\n{text}")
        for hint in hints:
            rank_zero_info(hint)

    @override
    def _initialize_deepspeed_train(self, model: Module) -> None:
        # Lightning's version, except that the optimizer and scheduler may come from the config *or* from
        # configure_optimizers (never both), and a torch Adam/AdamW becomes DeepSpeedCPUAdam under ZeRO-Offload.
        optimizer, scheduler_config = self._client_optimizer_and_scheduler()
        scheduler = scheduler_config.scheduler if scheduler_config is not None else None
        engine, ds_optimizer = self._setup_model_and_optimizer(model, optimizer, scheduler)
        self._set_deepspeed_activation_checkpointing()
        self.optimizers = [ds_optimizer]
        if engine.lr_scheduler is not None:
            ds_scheduler, engine.lr_scheduler = engine.lr_scheduler, None  # Lightning steps the scheduler
            if scheduler_config is None:
                scheduler_config = LRSchedulerConfig(ds_scheduler, interval="step")
            else:
                scheduler_config.scheduler = ds_scheduler
            self.lr_scheduler_configs = [scheduler_config]
        self.model = engine

    def _client_optimizer_and_scheduler(self) -> tuple[Optional[Optimizer], Optional[LRSchedulerConfig]]:
        import warnings

        from lightning.pytorch.core.optimizer import _MockOptimizer

        from lightning_gaudi_ds import optim

        assert isinstance(self.config, dict)
        with warnings.catch_warnings():  # None: the config's optimizer is used, or the error below says what to do
            warnings.filterwarnings("ignore", message=".*configure_optimizers` returned `None`")
            optimizer, scheduler_config = self._init_optimizers()
        client: Optional[Optimizer] = None if isinstance(optimizer, _MockOptimizer) else optimizer
        both = [
            f"`{section}` section ({(self.config[section] or {}).get('type')}) and configure_optimizers returned"
            f" {type(obj).__name__}"
            for section, obj in (("optimizer", client), ("scheduler", getattr(scheduler_config, "scheduler", None)))
            if section in self.config and obj is not None
        ]
        if both:
            raise ValueError(
                f"The DeepSpeed config has an {' and an '.join(both)}; DeepSpeed takes each from one place. Remove"
                " the section from the config, or return nothing for it from configure_optimizers"
                " (`return None` to use the config's optimizer)."
            )
        if client is None and "optimizer" not in self.config:
            raise ValueError(
                "configure_optimizers returned None and the DeepSpeed config has no `optimizer` section, so there is"
                ' nothing to train with. Return an optimizer, or add e.g. "optimizer": {"type": "AdamW", "params":'
                ' {"lr": "auto"}} to the config.'
            )
        if client is not None and self._offloads_optimizer() and self.config.get("zero_force_ds_cpu_optimizer", True):
            if not optim.is_convertible(client):
                raise ValueError(
                    f"ZeRO-Offload steps the optimizer on the CPU with DeepSpeedCPUAdam, and configure_optimizers"
                    f" returned {type(client).__qualname__}, which DeepSpeed refuses with offload. Return"
                    " torch.optim.AdamW or torch.optim.Adam (converted for you), put an `optimizer` section in the"
                    ' config, or set "zero_force_ds_cpu_optimizer": false to keep it (slow).'
                )
            before = type(client).__name__
            client = optim.to_cpu_adam(client, getattr(scheduler_config, "scheduler", None))
            rank_zero_info(
                f"ZeRO-Offload: training with DeepSpeedCPUAdam (adamw_mode={client.adam_w_mode}) in place of the"
                f" torch.optim.{before} from configure_optimizers, with the same parameter groups and hyperparameters;"
                " DeepSpeed refuses a torch optimizer with offload."
            )
        return client, scheduler_config

    def _offloads_optimizer(self) -> bool:
        zero = self.config.get("zero_optimization") if isinstance(self.config, dict) else None
        offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
        return isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")

    # ------------------------------------------------ external launchers (issue 4: torchrun, deepspeed, mpirun)
    @override
    def set_world_ranks(self) -> None:
        # The Trainer's constructor calls this right after it picked the cluster environment and before
        # `_configure_launcher`: adopt DeepSpeed's launcher (Lightning takes it for a single-node launch) and
        # refuse a launcher whose process count disagrees with devices x num_nodes, before anything starts.
        from lightning_gaudi_ds.environments import check_launcher_world_size, resolve_environment

        self.cluster_environment = resolve_environment(self.cluster_environment)
        if self.parallel_devices is not None:
            check_launcher_world_size(self.cluster_environment, self.num_processes, self.num_nodes)
        super().set_world_ranks()

    # ------------------------------------------- checkpoints (issue 5: crash-safe saves, validation, resharding)
    # Saves go to `<name>.partial`; rank 0 adds a manifest and renames it into place only after every rank wrote
    # its shard, so `<name>` (and ModelCheckpoint's "last") is always complete. Loads validate first and go through
    # a DeepSpeed universal checkpoint when the world size changed. The logic lives in lightning_gaudi_ds.checkpoint.
    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the resolved DeepSpeed config (0-3)."""
        assert isinstance(self.config, dict)
        return int((self.config.get("zero_optimization") or {}).get("stage", 0))

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        from lightning_gaudi_ds import checkpoint as ckpt

        if storage_options is not None:  # Lightning's own error
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        final = self.broadcast(str(filepath))
        staging = ckpt.partial_path(final)
        ckpt.on_rank_zero(self, f"Preparing {staging}", lambda: ckpt.prepare_save(final))
        super().save_checkpoint(checkpoint, str(staging))
        self.barrier("lightning_gaudi_ds.save_checkpoint.written")  # every rank has written its shard
        weights_only = "lr_schedulers" not in checkpoint
        ckpt.on_rank_zero(self, f"Committing checkpoint {final}", lambda: ckpt.commit_save(
            staging, final, self.zero_stage, self.world_size, weights_only))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.load_full_weights and self.zero_stage_3:
            return super().load_checkpoint(checkpoint_path, weights_only)
        from lightning_gaudi_ds import checkpoint as ckpt

        info = ckpt.validate_checkpoint(checkpoint_path, zero_stage=self.zero_stage)
        if info.world_size == self.world_size or info.zero_stage == 0:  # stage 0: DeepSpeed's own loader
            return super().load_checkpoint(checkpoint_path, weights_only)
        return ckpt.load_resharded(self, info)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        from lightning_gaudi_ds import checkpoint as ckpt

        if self.is_global_zero:
            ckpt.remove_checkpoint(filepath)

    # ---------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, description, kwargs in _REGISTERED:
            strategy_registry.register(name, cls, description=description, override=True, **kwargs)


def _is_mean(reduce_op: Any) -> bool:
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    from torch.distributed import ReduceOp

    return reduce_op == ReduceOp.AVG
