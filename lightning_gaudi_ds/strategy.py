"""``HPUDeepSpeedStrategy``: Lightning's DeepSpeed strategy made device-neutral (HPU, CUDA, CPU).

Lightning's hooks, which gather facts from the Trainer and delegate: the DeepSpeed config and its resolution to
:class:`lightning_gaudi_ds.config.StrategyConfig`, argument and pre-launch checks to
:mod:`lightning_gaudi_ds.config.validate`, the optimizer policy to :mod:`lightning_gaudi_ds.engine.train`, what
surrounds each engine call to :mod:`lightning_gaudi_ds.engine.step`, what the device needs around the engine (Gaudi
execution mode, compile, graph breaks) to :mod:`lightning_gaudi_ds.engine.device`, ``stage="auto"`` to
:mod:`lightning_gaudi_ds.planning.auto`, checkpoints to :mod:`lightning_gaudi_ds.checkpoint`, JIT-built ops to
:mod:`lightning_gaudi_ds.jit_ops`. Six methods remain copies of Lightning's with a change (``setup_environment``,
``setup_distributed``, ``_initialize_deepspeed_train``, ``_initialize_deepspeed_inference``,
``_setup_model_and_optimizer``, ``_init_optimizers``), each hash-guarded in :mod:`lightning_gaudi_ds._compat`
(``COPIED_DEEPSPEED_STRATEGY_METHODS``). Everything else (precision plugin, checkpointing, ZeRO-3 ``zero.Init``,
optimizer wiring) is Lightning's own ``DeepSpeedStrategy``.

DeepSpeed itself is imported inside the methods that use it: importing it picks DeepSpeed's global accelerator by
auto-detection (and logs it), which must wait until ``setup_environment`` has chosen the Trainer's device; it
also adds about a second to ``import lightning_gaudi_ds``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT, LRSchedulerConfig
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gaudi_ds import checkpoint as ckpt
from lightning_gaudi_ds import hf, hpu
from lightning_gaudi_ds._compat import (
    _PATH,
    _init_optimizers_and_lr_schedulers,
    _StrategyRegistry,
    attached_trainer,
    hook_resume_path,
    weights_only_dropped_by_lightning,
)
from lightning_gaudi_ds.checkpoint import resume
from lightning_gaudi_ds.config import (
    ConfigError,
    StrategyConfig,
    load_config,
    offloads_optimizer,
    publish_resolved,
)
from lightning_gaudi_ds.config.validate import (
    check_trainer_flags,
)
from lightning_gaudi_ds.devices import DeviceSpec, device_spec
from lightning_gaudi_ds.engine import checkpointing, inference, process, train
from lightning_gaudi_ds.engine.device import hccl_reduce
from lightning_gaudi_ds.engine.step import step, third_party_deprecations_silenced
from lightning_gaudi_ds.jit_ops.startup import SHM_MODE_ENV
from lightning_gaudi_ds.launch._proc import NUM_NODES_ENV
from lightning_gaudi_ds.launch.environments import (
    check_launcher_world_size,
    launcher_num_nodes,
    resolve_environment,
)
from lightning_gaudi_ds.planning.auto import AUTO

if TYPE_CHECKING:
    import deepspeed

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


class HPUDeepSpeedStrategy(process.StrategyCommon, DeepSpeedStrategy):
    """DeepSpeed ZeRO stages 0-3 (with CPU/NVMe offload) for Lightning on Intel Gaudi, CUDA GPUs and CPUs.

    Args:
        stage: ZeRO stage: 0 (plain data parallel through DeepSpeed), 1 (optimizer states sharded),
            2 (+ gradients), 3 (+ parameters); ``"auto"``: at setup, the fastest configuration (lowest stage, no
            offload before offload) that the memory planner finds to fit the model on the devices.
        device_memory: with ``stage="auto"``, the memory of one device (``"24GiB"``, bytes); default: read from
            the HPU/CUDA device (required on CPU).
        measure_activations: with ``stage="auto"``, add the peak activation memory of one forward/backward of
            ``example_input_array`` on one device to the plan (else activations are not included).
        accelerator: an accelerator instance; by default the Trainer's ``accelerator`` flag decides
            (``"hpu"``, ``"cuda"``, ``"cpu"`` or ``"auto"``, which does not look for HPUs).
        config: a DeepSpeed config (JSON path or dict); ``PL_DEEPSPEED_CONFIG_PATH`` is read when unset.
        offload_optimizer: ZeRO-Offload of optimizer states (and the step) to CPU.
        offload_parameters: offload parameters too (stage 3).
        process_group_backend: overrides the device's backend (gloo on CPU, nccl on CUDA, hccl on HPU).
        hpu_mode: Gaudi execution mode, ``"eager"`` or ``"lazy"``; by default the mode ``habana_frameworks`` was
            imported with (``PT_HPU_LAZY_MODE``, eager when unset). The mode is fixed when the Gaudi stack is
            first imported, so a different one is refused: set it for the launcher instead
            (``lightning-gaudi-ds spawn --hpu_mode``).
        torch_compile: compile the DeepSpeed engine with ``torch.compile`` and DeepSpeed's accelerator backend
            (``hpu_backend`` on Gaudi, inductor on CPU). By default on for HPUs in eager mode, Habana's
            recommended path, and off elsewhere. Lazy mode cannot compile.
        number_checkpoints: how many ``deepspeed.checkpointing.checkpoint`` calls one forward pass makes; needed by
            ``contiguous_memory_optimization=True`` (the config's ``activation_checkpointing.number_checkpoints``).
        tensor_parallel: ``{"tp_size": N}`` serves ``trainer.predict/validate/test`` with DeepSpeed's inference
            engine, the model split across N ranks (N = devices x num_nodes); every rank reads the same batches.
        dtype: the engine's dtype; by default the Trainer's precision decides (they must agree).
        replace_with_kernel_inject: DeepSpeed's fused CUDA inference kernels instead of splitting the modules.
        injection_policy: ``{LayerClass: ("names", "of", "row-parallel", "linears")}`` for models AutoTP does
            not know (classes may be import paths); Hugging Face families such as Llama need none.
        replace_method: accepted for lightning-habana compatibility (``"auto"``); DeepSpeed ignores it.
        enable_cuda_graph: capture the forward as a CUDA graph (CUDA, tp_size 1) or an HPU graph (Gaudi).
            These six may also be keys of ``config``; see :mod:`lightning_gaudi_ds.engine.inference`.
        zero3_leaf_modules: under ZeRO-3, module classes (or their import paths) whose parameters are gathered
            all at once when the module runs, not per submodule: mixture-of-experts blocks such as
            ``"transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"``, whose experts run on some
            ranks and not others (DeepSpeed's ``set_z3_leaf_modules``). Ignored at stages 0-2.
        **kwargs: every other argument of :class:`lightning.pytorch.strategies.DeepSpeedStrategy`, such as
            ``logging_batch_size_per_gpu`` (DeepSpeed's micro batch for its throughput logging, as in Lightning).
    """

    strategy_name = "hpu_deepspeed"

    def __init__(
        self,
        stage: int | Literal["auto"] = 2,
        *,
        device_memory: int | str | None = None,
        measure_activations: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
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
        tensor_parallel: dict[str, Any] | None = None,
        dtype: torch.dtype | str | None = None,
        replace_with_kernel_inject: bool | None = None,
        injection_policy: dict[Any, Any] | None = None,
        replace_method: str | None = None,
        enable_cuda_graph: bool | None = None,
        zero3_leaf_modules: Sequence[type[Module] | str] | None = None,
        **kwargs: Any,
    ) -> None:
        arguments = dict(
            stage=stage, accelerator=accelerator, config=config, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, remote_device=remote_device, nvme_path=nvme_path,
            process_group_backend=process_group_backend, logging_level=logging_level, **kwargs,
        )
        # Created before Lightning's __init__, which loads the config through _load_config.
        self._resolver, arguments["stage"] = StrategyConfig.from_arguments(
            type(self), arguments, hpu_mode=hpu_mode, torch_compile=torch_compile,
            measure_activations=measure_activations, number_checkpoints=number_checkpoints,
            device_memory=device_memory,
        )
        self._inference_config: dict[str, Any] = {}  # the inference keys of `config`, set by _load_config
        # Each argument by name and `**kwargs` as such: jsonargparse (LightningCLI) follows `**kwargs` into
        # DeepSpeedStrategy's signature only when it is passed on unchanged.
        super().__init__(
            stage=arguments["stage"], accelerator=accelerator, config=config, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, remote_device=remote_device, nvme_path=nvme_path,
            process_group_backend=process_group_backend, logging_level=logging_level, **kwargs,
        )
        self._adopt_arguments(config=config, offload_parameters=offload_parameters,
                              number_checkpoints=number_checkpoints, hpu_mode=hpu_mode, torch_compile=torch_compile,
                              zero3_leaf_modules=zero3_leaf_modules)
        self._inference = inference.settings_from(
            dict(tensor_parallel=tensor_parallel, dtype=dtype, replace_with_kernel_inject=replace_with_kernel_inject,
                 injection_policy=injection_policy, replace_method=replace_method, enable_cuda_graph=enable_cuda_graph),
            self._inference_config,
        )
        if self._inference is not None:
            zero_args = {**self._resolver.explicit_args, **({"stage": AUTO} if self._resolver.auto is not None else {})}
            inference.check_zero_options(self._inference, zero_args, self.config)
        self._inference_dtype: torch.dtype | None = None
        self._preemption = resume.PreemptionWatch()

    # ----------------------------------------------------------------------------------------- set-up
    @property
    def device_spec(self) -> DeviceSpec:
        """The device-table row of this strategy's root device."""
        return device_spec(self.root_device)

    @override
    def _configure_launcher(self) -> None:
        # Called by the Trainer's constructor once accelerator and precision are known: the earliest point
        # at which a device/precision mismatch can be reported, before any process is started.
        process.before_launch(self, self._runtime, self._resolver, self.precision_plugin.precision)
        assert self.parallel_devices is not None
        if self._inference is not None:
            world = len(self.parallel_devices) * self.num_nodes
            inference.check_world(self._inference, world, self.parallel_devices[0].type)
            self._inference_dtype = inference.resolve_dtype(self._inference, self.precision_plugin.precision)
        super()._configure_launcher()
        process.after_launcher(self._launcher, self._runtime)

    @override
    def setup_environment(self) -> None:
        # A copy of Lightning 2.6.6's DeepSpeedStrategy.setup_environment without its gate that refuses every
        # accelerator but CUDA; plus the device's preparation before the process group starts.
        self._validate_trainer_flags()
        process.prepare_device(self, self._runtime, self._select_deepspeed_accelerator, self.set_world_ranks)
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        # A copy of Lightning 2.6.6's DeepSpeedStrategy.setup_distributed whose device-index check skips devices
        # without an index (CPU, HPU), plus the JIT-op start-up: on every rank, before DeepSpeed builds anything,
        # clear stale build locks and decide whether the CPU shm comm op is loaded (else plain torch.distributed
        # collectives).
        # Tensor parallelism decides whether DeepSpeed's CPU shm all-reduce is loaded (training leaves it off).
        mode = inference.shm_comm_mode(self._inference, self.world_size, os.environ.get(SHM_MODE_ENV))
        process.start_distributed(self, self._runtime, set_world_ranks=self.set_world_ranks,
                                  init=self._init_deepspeed_distributed,
                                  offload=offloads_optimizer(self.config), shm_comm=mode)

    @override
    def _init_deepspeed_distributed(self) -> None:
        process.bounded_init(self, super()._init_deepspeed_distributed)

    @override
    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or self.device_spec.backend

    def _select_deepspeed_accelerator(self, spec: DeviceSpec) -> None:
        """Make DeepSpeed's global accelerator match the Trainer's device (DS_ACCELERATOR may differ)."""
        process.set_deepspeed_accelerator(spec)

    def _validate_trainer_flags(self) -> None:
        """Trainer settings DeepSpeed cannot honour, reported before the process group starts."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:
            check_trainer_flags(
                serving=self._inference is not None, fitting=trainer.state.fn == TrainerFn.FITTING,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm, gradient_clip_val=trainer.gradient_clip_val,
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._runtime.before_engine(self.lightning_module, self.root_device)
        with third_party_deprecations_silenced():
            super().setup(trainer)

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        # Lightning's zero.Init; under ZeRO-3 transformers is told around it, so that `from_pretrained` in
        # configure_model loads into the partitions (lightning_gaudi_ds.hf). Resolved first (as Lightning's does),
        # so that transformers is imported, if at all, before zero.Init patches module construction.
        self._init_config_if_needed()
        with hf.zero3_loading(self.config if self.zero_stage_3 else None), super().model_sharded_context():
            yield

    # ------------------------------------------------------------------------------------- engine
    def _deepspeed_args(self) -> argparse.Namespace:
        return process.deepspeed_args(self.root_device, self.local_rank)

    @override
    def _setup_model_and_optimizer(
        self,
        model: Module,
        optimizer: Optimizer | None,
        lr_scheduler: Any | None = None,
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer]:
        # A copy of Lightning 2.6.6's DeepSpeedStrategy._setup_model_and_optimizer, with the device rank from
        # _deepspeed_args (CPU and HPU devices have no index), and a copy of the config: DeepSpeed 0.16 (Habana's
        # fork) pops keys out of the dict it is given (optimizer.params' torch_adam, adam_w_mode).
        self._mark_leaf_modules(model)
        assert isinstance(self.config, dict)
        engine, ds_optimizer, _ = process.initialize(self._runtime, self._deepspeed_args(), self.config, model,
                                                     optimizer, lr_scheduler)
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        with self._runtime.deepspeed_calls():
            self._init_inference_engine(model)

    def _init_inference_engine(self, model: Module) -> None:
        if self._inference is not None:
            assert self._inference_dtype is not None
            device = self.device_spec.device_type
            self.model = inference.init_engine(model, self._inference, self._inference_dtype, device, self.world_size)
            return
        assert isinstance(self.config, dict)
        self._mark_leaf_modules(model)
        self.model = inference.init_zero_engine(model, self.config, self._deepspeed_args(),
                                                zero_stage_3=self.zero_stage_3)

    @override
    def _initialize_deepspeed_train(self, model: Module) -> None:
        # A copy of Lightning 2.6.6's DeepSpeedStrategy._initialize_deepspeed_train, except that the optimizer and
        # the scheduler each come from the config *or* from configure_optimizers (Lightning ignores
        # configure_optimizers once the config has an optimizer), see engine.train.optimizer_sources.
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
        self._runtime.compile_engine(engine)

    @override
    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Lightning's version drops the number of checkpoints and synchronize_checkpoint_boundary: DeepSpeed reads
        # the whole section itself.
        assert isinstance(self.config, dict)
        checkpointing.configure(self.config)

    def _client_optimizer_and_scheduler(self) -> tuple[Optimizer | None, LRSchedulerConfig | None]:
        assert isinstance(self.config, dict)
        with warnings.catch_warnings():  # None: the config's optimizer is used, or optimizer_sources says what to do
            warnings.filterwarnings("ignore", message=".*configure_optimizers` returned `None`")
            optimizer, scheduler_config = self._init_optimizers()
        return train.optimizer_sources(self.config, optimizer, scheduler_config)

    @override
    def _init_optimizers(self) -> tuple[Optimizer, LRSchedulerConfig | None]:
        # A copy of Lightning 2.6.6's DeepSpeedStrategy._init_optimizers, with an error that names what was returned
        # and the check for Habana's fused optimizers.
        assert self.lightning_module is not None
        optimizer, scheduler_config = train.single_optimizer(*_init_optimizers_and_lr_schedulers(self.lightning_module))
        offload = isinstance(self.config, dict) and offloads_optimizer(self.config)
        problem = hpu.fused_optimizer_problem(optimizer, offload)
        if problem:
            raise ConfigError(problem)
        return optimizer, scheduler_config

    # ------------------------------------------ engine calls: HPU lazy-mode graph breaks (engine.step)
    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with step(self._runtime):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with step(self._runtime, graph_break=False):
            return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        with step(self._runtime):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with step(self._runtime, evaluation_config=self.config):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with step(self._runtime, evaluation_config=self.config):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with step(self._runtime, evaluation_config=self.config):
            return super().predict_step(*args, **kwargs)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if self._get_process_group_backend() != "hccl" or not isinstance(tensor, Tensor):
            return super().reduce(tensor, group, reduce_op)
        return hccl_reduce(super().reduce, tensor, group, reduce_op, self.root_device, self.world_size)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        module = self.lightning_module
        if self.zero_stage_3 and module is not None and any(_is_partition(p) for p in module.parameters()):
            rank_zero_warn(train.PARTITIONED_AFTER_FIT)

    @override
    def teardown(self) -> None:
        try:
            resume.save_on_preemption(self, attached_trainer(self.lightning_module))
        finally:
            super().teardown()

    # ----------------------------------- resuming: ckpt_path="last", restarts (lightning_gaudi_ds.checkpoint.resume)
    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        # Trainer._run connects first, before it restores from the path it made of ckpt_path: the moment to have
        # that Trainer resolve "last" (and a restart's default) with the crash-safe checkpoints.
        trainer = attached_trainer(model)
        if trainer is not None and trainer.strategy is self:
            hook_resume_path(trainer, functools.partial(resume.resolve_ckpt_path, trainer))

    # ------------------------------------------------------ DeepSpeed JSON config: load, "auto", contradictions
    # Lightning's __init__ calls _load_config; setup (and ZeRO-3's model_sharded_context) call _init_config_if_needed.
    # self._resolver (config.StrategyConfig) owns the config's state and resolution; these hooks delegate to it.
    @override
    def _load_config(self, config: _PATH | dict[str, Any] | None) -> dict[str, Any] | None:
        # The inference engine's keys (tensor_parallel, dtype, ...) are not DeepSpeed training-config keys.
        training, self._inference_config = inference.split_config(load_config(config)[0])
        return self._resolver.load(training if self._inference_config else config)

    @override
    def _init_config_if_needed(self) -> None:
        self.config = self._resolver.ensure_resolved(self)
        self._config_initialized = True

    @override
    def _format_config(self) -> None:
        self.config = self._resolver.resolve_for(self)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.zero_stage_3 and self.lightning_module is not None:
            warning = train.eval_mode_warning(self.lightning_module)
            if warning:
                rank_zero_warn(warning)
        # Published only now: a file in the logger's directory before training starts would make CSVLogger warn
        # that the directory "exists and is not empty".
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:  # after Lightning's own SIGTERM handler, which it registers before this
            self._preemption.install(self, trainer)
        pending = self._resolver.take_unpublished() if trainer is not None else None
        if trainer is not None and pending is not None:
            log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast: every rank calls it
            publish_resolved(*pending, log_dir, rank_zero=self.is_global_zero)

    # ------------------------------------------------ external launchers (torchrun, deepspeed, mpirun)
    @override
    def set_world_ranks(self) -> None:
        # The Trainer's constructor calls this right after it picked the cluster environment and before
        # `_configure_launcher`: adopt DeepSpeed's launcher (Lightning takes it for a single-node launch) and
        # refuse a launcher whose process count disagrees with devices x num_nodes, before anything starts.
        self.cluster_environment = resolve_environment(self.cluster_environment)
        nodes = launcher_num_nodes(self.num_nodes)
        if nodes != self.num_nodes:  # a restart on fewer hosts (spawn --min_nodes): the launcher's count wins
            rank_zero_info(f"{NUM_NODES_ENV}={nodes}: this restart runs on {nodes} node(s), not"
                           f" Trainer(num_nodes={self.num_nodes}); hosts were left out (spawn --min_nodes).")
            self._num_nodes = nodes
        if self.parallel_devices is not None:
            check_launcher_world_size(self.cluster_environment, self.num_processes, self.num_nodes)
        super().set_world_ranks()

    # ------------------------------------------- checkpoints: crash-safe saves, validation, resharding
    # Saves go to `<name>.partial`; rank 0 adds a manifest and renames it into place only after every rank wrote
    # its shard, so `<name>` (and ModelCheckpoint's "last") is always complete. Loads validate first and go through
    # a DeepSpeed universal checkpoint when the world size changed. The logic lives in lightning_gaudi_ds.checkpoint.
    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the resolved DeepSpeed config (0-3)."""
        assert isinstance(self.config, dict)
        stage = (self.config.get("zero_optimization") or {}).get("stage", 0)
        if stage == AUTO:
            raise MisconfigurationException(
                "stage='auto' is chosen when the Trainer sets the strategy up (fit, validate, test, predict);"
                " read `zero_stage` after that."
            )
        return int(stage)

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:  # Lightning's own error
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        models = hf.model_info(self.lightning_module) if self.lightning_module is not None else {}
        if models:  # what `lightning-gaudi-ds convert --to hf` needs besides the weights
            checkpoint = {**checkpoint, hf.HF_MODELS: models}
        ckpt.save(checkpoint, filepath, self, functools.partial(super().save_checkpoint, checkpoint),
                  lambda: self.zero_stage)

    # ------------------------------------------ tensor-parallel inference (lightning_gaudi_ds.engine.inference)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # The inference engine splits the weights it is given: load them whole before it is built.
        return self._inference is None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        if self._inference is None:
            return super().distributed_sampler_kwargs
        return inference.sampler_kwargs(self.world_size, self.global_rank, self._inference.tp_size)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._inference is None:
            return super().load_model_state_dict(checkpoint, strict)
        assert self.lightning_module is not None
        inference.load_weights(self.lightning_module, checkpoint, strict)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is None:  # Lightning drops the Trainer's argument when restoring after setup
            weights_only = weights_only_dropped_by_lightning()
        if self._inference is not None:  # any ZeRO stage's shards, merged in memory, or one converted file
            return inference.load_full_state_dict(self.broadcast(str(checkpoint_path)), weights_only)
        if self.load_full_weights and self.zero_stage_3:
            return super().load_checkpoint(checkpoint_path, weights_only)
        zero_stage = self.zero_stage
        trainer = attached_trainer(self.lightning_module)
        return ckpt.load_checkpoint(
            checkpoint_path, self, zero_stage=zero_stage, module=self.lightning_module,
            fitting=None if trainer is None else trainer.state.fn == TrainerFn.FITTING, engine=self.deepspeed_engine,
            deepspeed_load=functools.partial(super().load_checkpoint, checkpoint_path, weights_only),
            weights_only=weights_only,
        )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove_checkpoint(filepath)

    # ---------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, description, kwargs in _REGISTERED:
            strategy_registry.register(name, cls, description=description, override=True, **kwargs)


def _is_partition(param: Tensor) -> bool:
    """A ZeRO-3 parameter not gathered now: its values live in the ranks' partitions (DeepSpeed's own status)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(param, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE


# Defining the strategy registers its names, however this module was reached (lightning_gaudi_ds/__init__.py
# imports it once Lightning is imported).
HPUDeepSpeedStrategy.register_strategies(StrategyRegistry)
