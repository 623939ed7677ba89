"""``HPUDeepSpeedStrategy``: Lightning's DeepSpeed strategy made device-neutral (HPU, CUDA, CPU), for the Trainer.

A thin adapter: what both strategies share is :class:`lightning_gaudi_ds.core.base.DeepSpeedCore`; this class adds
the Trainer's own hooks, which gather facts from the Trainer and pass them down as values: the config resolved for
the Trainer attached, the optimizer chosen as Lightning chooses it (:mod:`lightning_gaudi_ds.engine.train`), each
engine call's context (:mod:`lightning_gaudi_ds.engine.step`), checkpoints (:mod:`lightning_gaudi_ds.checkpoint`),
restarts and mid-epoch resume (:mod:`lightning_gaudi_ds.checkpoint.resume`). Tensor-parallel serving is its own
class, :class:`TensorParallelStrategy` (its hooks in :mod:`lightning_gaudi_ds.serving`), which
``HPUDeepSpeedStrategy(tensor_parallel=...)`` makes. Copies of Lightning's methods are hash-guarded in
:mod:`lightning_gaudi_ds._compat`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gaudi_ds import checkpoint as ckpt
from lightning_gaudi_ds import hf, hpu
from lightning_gaudi_ds._compat import _PATH, attached_trainer, train_dataloaders, weights_only_dropped_by_lightning
from lightning_gaudi_ds.checkpoint import resume
from lightning_gaudi_ds.checkpoint.io import refusal_named
from lightning_gaudi_ds.config import load_config
from lightning_gaudi_ds.config.sizing import shared_batch_size
from lightning_gaudi_ds.config.validate import check_trainer
from lightning_gaudi_ds.core.base import DeepSpeedCore
from lightning_gaudi_ds.core.options import Options
from lightning_gaudi_ds.engine import inference, train
from lightning_gaudi_ds.engine.step import engine_call, third_party_deprecations_silenced
from lightning_gaudi_ds.errors import ConfigError
from lightning_gaudi_ds.serving import TensorParallelServing

if TYPE_CHECKING:
    import deepspeed


class HPUDeepSpeedStrategy(DeepSpeedCore, DeepSpeedStrategy):
    """DeepSpeed ZeRO stages 0-3 (with CPU/NVMe offload) for Lightning on Intel Gaudi, CUDA GPUs and CPUs.

    Args:
        stage: ZeRO stage: 0 (data parallel), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters);
            ``"auto"``: at setup, the fastest configuration (lowest stage, no offload first) the memory planner fits.
        device_memory: with ``stage="auto"``, one device's memory (``"24GiB"``, bytes); default: read from the
            HPU/CUDA device (required on CPU).
        measure_activations: with ``stage="auto"``, plan with the peak activation memory of one forward/backward of
            ``example_input_array`` (else activations are not included).
        accelerator: an accelerator instance; by default the Trainer's ``accelerator`` flag decides.
        config: a DeepSpeed config (JSON path or dict); ``PL_DEEPSPEED_CONFIG_PATH`` is read when unset.
        offload_optimizer: ZeRO-Offload of optimizer states (and the step) to CPU.
        offload_parameters: offload parameters too (stage 3).
        process_group_backend: overrides the device's backend (gloo on CPU, nccl on CUDA, hccl on HPU).
        hpu_mode: Gaudi execution mode, ``"eager"`` or ``"lazy"``; default: the mode ``habana_frameworks`` was
            imported with (``PT_HPU_LAZY_MODE``). A different one is refused: set it for the launcher instead
            (``lightning-gaudi-ds spawn --hpu_mode``).
        torch_compile: compile the engine with ``torch.compile`` and DeepSpeed's accelerator backend; default: on
            for HPUs in eager mode (Habana's recommended path), off elsewhere. Lazy mode cannot compile.
        number_checkpoints: ``deepspeed.checkpointing.checkpoint`` calls per forward pass, needed by
            ``contiguous_memory_optimization=True`` (the config's ``activation_checkpointing.number_checkpoints``).
        tensor_parallel: ``{"tp_size": N}`` serves ``trainer.predict/validate/test`` with DeepSpeed's inference
            engine, the model split across N = devices x num_nodes ranks; every rank reads the same batches. With it
            (or any of the five below, as arguments or config keys) the strategy is a
            :class:`~lightning_gaudi_ds.serving.TensorParallelStrategy`.
        dtype: the engine's dtype; by default the Trainer's precision decides (they must agree).
        replace_with_kernel_inject: DeepSpeed's fused CUDA inference kernels instead of splitting the modules.
        injection_policy: ``{LayerClass: ("names", "of", "row-parallel", "linears")}`` for models AutoTP does
            not know (classes may be import paths); Hugging Face families such as Llama need none.
        replace_method: accepted for lightning-habana compatibility (``"auto"``); DeepSpeed ignores it.
        enable_cuda_graph: capture the forward as a CUDA graph (CUDA, tp_size 1) or an HPU graph (Gaudi). These six
            may also be keys of ``config``; see :mod:`lightning_gaudi_ds.engine.inference`.
        zero3_leaf_modules: under ZeRO-3, module classes (or import paths) whose parameters are gathered at once when
            the module runs: mixture-of-experts blocks, whose experts run on some ranks only (DeepSpeed's
            ``set_z3_leaf_modules``). A class the model lacks is a ``ConfigError`` naming close ones; ignored at
            stages 0-2, with one warning.
        hpz: ZeRO++ hierarchical partitioning with ``stage=3`` across nodes: each rank also keeps a secondary partition
            of the parameters over the devices of its node, so that the backward all-gather stays inside the node
            (``zero_optimization.zero_hpz_partition_size``, "auto": the devices per node). Refused below stage 3, on
            one node, or where DeepSpeed lacks it; see :mod:`lightning_gaudi_ds.config.zeropp`.
        sequence_parallel_size: DeepSpeed-Ulysses sequence parallelism: ``K`` ranks share each sequence, each holding
            ``1/K`` of it (the batch is split along the sequence, attention runs after an all-to-all on ``1/K`` of the
            heads); ``world / K`` sequences train at once. Default: the config's ``sequence_parallel_size``, else 1.
            Hugging Face models need nothing else; see :mod:`lightning_gaudi_ds.sequence`.
        sequence_parallel_modules: with ``sequence_parallel_size``, your own attention module classes (or import
            paths): modules whose forward takes query, key and value of shape (batch, heads, sequence, head size)
            first and returns the attention output so shaped.
        resume_data_position: a fit resumed from a checkpoint saved mid-epoch goes on with the batch after the last
            one it consumed, the train loader skipping the epoch's first batches by sampler index (default);
            ``False``: Lightning's behaviour, a plain DataLoader re-reads the epoch from its start. See
            :mod:`lightning_gaudi_ds.checkpoint.data_position`.
        **kwargs: every other argument of :class:`lightning.pytorch.strategies.DeepSpeedStrategy`.
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
        hpz: bool = False,
        sequence_parallel_size: int | None = None,
        sequence_parallel_modules: Sequence[type[Module] | str] | None = None,
        resume_data_position: bool = True,
        **kwargs: Any,
    ) -> None:
        if type(self) is HPUDeepSpeedStrategy and inference.serving_requested(dict(
                config=config, tensor_parallel=tensor_parallel, dtype=dtype, injection_policy=injection_policy,
                replace_with_kernel_inject=replace_with_kernel_inject, replace_method=replace_method,
                enable_cuda_graph=enable_cuda_graph)):
            # The inference engine's arguments (or config keys) make it the serving strategy, a class of its own.
            self.__class__ = TensorParallelStrategy
        if not isinstance(resume_data_position, bool):
            raise ConfigError(f"resume_data_position={resume_data_position!r}: pass True (a mid-epoch resume goes on"
                              " with the next batch) or False (it re-reads the epoch from its start, as Lightning).")
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
        self._inference_config: dict[str, Any] = {}  # the inference keys of `config`, set by _load_config
        # Each argument by name and `**kwargs` as such: jsonargparse (LightningCLI) follows `**kwargs` into
        # DeepSpeedStrategy's signature only when it is passed on unchanged.
        super().__init__(
            stage=arguments["stage"], accelerator=accelerator, config=config, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, remote_device=remote_device, nvme_path=nvme_path,
            process_group_backend=process_group_backend, logging_level=logging_level, **kwargs,
        )
        self._adopt_arguments(config=config, offload_parameters=offload_parameters)
        self._serving_arguments = dict(
            tensor_parallel=tensor_parallel, dtype=dtype, replace_with_kernel_inject=replace_with_kernel_inject,
            injection_policy=injection_policy, replace_method=replace_method, enable_cuda_graph=enable_cuda_graph,
        )
        self._adopt_serving_arguments()
        self._preemption = resume.PreemptionWatch()
        self.resume_data_position = resume_data_position

    def _adopt_serving_arguments(self) -> None:
        # The serving class takes them; a training strategy (a user's subclass of this one, which is not made a
        # serving one) must not drop them silently.
        given = [k for k, v in self._serving_arguments.items() if v is not None] + sorted(self._inference_config)
        if given:
            raise ConfigError(
                f"{type(self).__name__}({', '.join(given)}): these configure DeepSpeed's inference engine, which"
                " lightning_gaudi_ds.TensorParallelStrategy runs (HPUDeepSpeedStrategy(tensor_parallel=...)"
                " returns one). Subclass TensorParallelStrategy to serve, or remove them to train."
            )

    @property
    @override
    def _precision_name(self) -> str:
        return self.precision_plugin.precision

    @override
    def setup_environment(self) -> None:
        # A copy of Lightning 2.6.6's without its CUDA-only gate; Trainer flags checked and the device prepared first.
        self._check_trainer(attached_trainer(self.lightning_module))
        self._prepare_device(self.set_world_ranks)
        DDPStrategy.setup_environment(self)

    def _check_trainer(self, trainer: pl.Trainer | None) -> None:
        check_trainer(trainer, serving=False)
        self._sequence.check_trainer(trainer)  # sequence parallelism: trainer.predict refused

    @override
    def setup_distributed(self) -> None:
        # A copy of Lightning 2.6.6's (DeepSpeedCore._start_distributed).
        self._start_distributed(self.set_world_ranks)

    @override
    def set_world_ranks(self) -> None:
        self._adopt_launcher()
        super().set_world_ranks()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._runtime.before_engine(self.lightning_module, self.root_device)
        assert trainer.lightning_module is not None
        self._sequence.wrap(trainer.lightning_module)  # sequence parallelism: the all-to-all around attention
        with third_party_deprecations_silenced():
            super().setup(trainer)

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        # Lightning's zero.Init, with transformers told (from_pretrained loads into the partitions, see hf); resolved
        # first, so that transformers is imported, if at all, before zero.Init patches module construction.
        self._init_config_if_needed()
        with self._zero_init_context(super().model_sharded_context):
            yield

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any | None = None
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer]:
        # A copy of Lightning 2.6.6's, with the device rank for CPU and HPU devices (DeepSpeedCore).
        engine, ds_optimizer, _ = self._deepspeed_initialize(model, optimizer, lr_scheduler)
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_train(self, model: Module) -> None:
        # A copy of Lightning 2.6.6's, with the optimizer and the scheduler chosen as Lightning chooses them and a
        # warning where the config and configure_optimizers both give one (train.optimizer_sources).
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

    def _client_optimizer_and_scheduler(self) -> tuple[Optimizer | None, LRSchedulerConfig | None]:
        """What configure_optimizers returned against the config's sections, as Lightning chooses between them
        (:func:`train.optimizer_sources`): the optimizer and scheduler ``deepspeed.initialize`` gets."""
        assert isinstance(self.config, dict)
        with warnings.catch_warnings():  # None: the config's optimizer is used, or optimizer_sources says what to do
            warnings.filterwarnings("ignore", message=".*configure_optimizers` returned `None`")
            returned, scheduler_config = self._init_optimizers()
        return train.optimizer_sources(self.config, returned, scheduler_config, self.device_spec.device_type,
                                       self._resolver.add_filled)

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        # A copy of Lightning 2.6.6's (engine.inference.init_zero_engine), with the device rank for CPU and HPU.
        assert isinstance(self.config, dict)
        self._mark_leaf_modules(model)
        with self._runtime.deepspeed_calls():
            self.model = inference.init_zero_engine(model, self.config, self._deepspeed_args(),
                                                    zero_stage_3=self.zero_stage_3)

    @override
    def _init_optimizers(self) -> tuple[Optimizer, LRSchedulerConfig | None]:
        return train.init_optimizers(super()._init_optimizers, self.lightning_module, self.config)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # sequence parallelism: this rank's part of every sequence
        return self._sequence.shard(super().batch_to_device(batch, device, dataloader_idx))

    backward = engine_call(DeepSpeedStrategy.backward)
    training_step = engine_call(DeepSpeedStrategy.training_step, graph_break=False)
    optimizer_step = engine_call(DeepSpeedStrategy.optimizer_step)
    validation_step = engine_call(DeepSpeedStrategy.validation_step, evaluation=True)
    test_step = engine_call(DeepSpeedStrategy.test_step, evaluation=True)
    predict_step = engine_call(DeepSpeedStrategy.predict_step, evaluation=True)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return self._reduce(super().reduce, tensor, group, reduce_op)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        train.warn_at_train_start(self.lightning_module, self.zero_stage_3)
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:  # after Lightning's own SIGTERM handler, which it registers before this
            self._preemption.install(trainer, resume.RankFacts(self.world_size, self.global_rank, self.local_rank,
                                                               self.launcher, self.cluster_environment))
            # trainer.log_dir: every rank calls it
            self._resolver.publish(trainer.log_dir or trainer.default_root_dir, rank_zero=self.is_global_zero)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        train.warn_at_train_end(self.lightning_module, self.zero_stage_3)

    @override
    def teardown(self) -> None:
        try:
            resume.save_on_preemption(attached_trainer(self.lightning_module), has_engine=self.model is not None,
                                      watch=self._preemption)
        finally:
            super().teardown()

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        trainer = attached_trainer(model)
        if trainer is not None and trainer.strategy is self:
            resume.hook_trainer(trainer, data_position=self.resume_data_position)

    # ------------------------------------------------------ DeepSpeed JSON config: load, "auto", contradictions
    @override
    def _load_config(self, config: _PATH | dict[str, Any] | None) -> dict[str, Any] | None:
        # In Lightning's __init__. The inference engine's keys (tensor_parallel, dtype, ...) are not DeepSpeed's.
        training, self._inference_config = inference.split_config(load_config(config)[0])
        return self._resolver.load(training if self._inference_config else config)

    @override
    def _init_config_if_needed(self) -> None:
        # stage="auto" chosen; every "auto" filled for the Trainer attached now, again whenever that changed.
        module = self.lightning_module
        self._choose_stage(module, self.precision_plugin.precision)
        trainer = attached_trainer(module)
        made_for = (weakref.ref(trainer) if trainer is not None else None,
                    trainer.state.fn if trainer is not None else None,
                    module is not None and any(True for _ in module.parameters()))
        assert isinstance(self.config, dict)
        self.config = self._resolver.ensure_resolved(self.config, made_for, self._resolved_for_trainer)
        self._config_initialized = True

    @override
    def _format_config(self) -> None:
        self.config = self._resolved_for_trainer()

    def _resolved_for_trainer(self) -> dict[str, Any]:
        """The config with every ``"auto"`` filled from the Trainer attached, the module and the devices."""
        module = self.lightning_module
        trainer = attached_trainer(module)
        fit = trainer if trainer is not None and trainer.state.fn == TrainerFn.FITTING else None
        total = None
        if fit is not None and "scheduler" in (self.config or {}):
            steps = fit.estimated_stepping_batches
            total = int(steps) if steps != float("inf") else None
        return self._resolve_config(
            module, self.precision_plugin.precision,
            accumulate_grad_batches=trainer.accumulate_grad_batches if trainer is not None else 1,
            micro_batch_size=shared_batch_size(train_dataloaders(fit)) if fit is not None else None,
            gradient_clip_val=trainer.gradient_clip_val if trainer is not None else None,
            hparams=dict(getattr(module, "hparams", None) or {}),
            total_steps=total,
            fitting=fit is not None,
        )

    # ------------------------------------------- checkpoints: crash-safe saves, validation, resharding
    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:  # Lightning's own error
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        checkpoint = hf.with_model_info(checkpoint, self.lightning_module)
        ckpt.save(checkpoint, filepath, self, functools.partial(super().save_checkpoint, checkpoint),
                  lambda: self.zero_stage)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is None:  # Lightning drops the Trainer's argument when restoring after setup
            weights_only = weights_only_dropped_by_lightning()
        if self.load_full_weights and self.zero_stage_3:  # one file, torch.load's: its refusal names the file
            with refusal_named(checkpoint_path):
                return super().load_checkpoint(checkpoint_path, weights_only)
        zero_stage, trainer = self.zero_stage, attached_trainer(self.lightning_module)
        return ckpt.load_checkpoint(
            checkpoint_path, self, zero_stage=zero_stage, module=self.lightning_module, engine=self.deepspeed_engine,
            fitting=None if trainer is None else trainer.state.fn == TrainerFn.FITTING, weights_only=weights_only,
            deepspeed_load=functools.partial(super().load_checkpoint, checkpoint_path, weights_only))

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove_checkpoint(filepath)


class TensorParallelStrategy(TensorParallelServing, HPUDeepSpeedStrategy):
    """Serves a model split across ranks by DeepSpeed's inference engine: ``trainer.predict``, ``validate`` and
    ``test`` (``fit`` is refused). Every rank of a tensor-parallel group reads the same batches; with
    ``tp_size`` < devices x num_nodes the groups are data-parallel replicas. The arguments are
    :class:`HPUDeepSpeedStrategy`'s, which makes one of these when given any of the engine's: ``tensor_parallel``,
    ``dtype``, ``replace_with_kernel_inject``, ``injection_policy``, ``replace_method`` and ``enable_cuda_graph``
    (see :mod:`lightning_gaudi_ds.engine.inference`; the hooks are :mod:`lightning_gaudi_ds.serving`'s)."""


# Defining the strategy registers its names, however this module was reached (see lightning_gaudi_ds/__init__.py).
HPUDeepSpeedStrategy.register_strategies(StrategyRegistry)
