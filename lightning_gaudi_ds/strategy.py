"""``HPUDeepSpeedStrategy``: Lightning's DeepSpeed strategy made device-neutral (HPU, CUDA, CPU).

Lightning's hooks, which gather facts from the Trainer and delegate: the config and its resolution to
:class:`lightning_gaudi_ds.config.StrategyConfig`, checks to :mod:`lightning_gaudi_ds.config.validate`, the process
group and ``deepspeed.initialize`` to :mod:`lightning_gaudi_ds.engine.process`, the optimizer to
:mod:`lightning_gaudi_ds.engine.train`, each engine call's context to :mod:`lightning_gaudi_ds.engine.step`,
tensor-parallel serving to :mod:`lightning_gaudi_ds.engine.inference`, checkpoints to
:mod:`lightning_gaudi_ds.checkpoint`. Copies of Lightning's methods are hash-guarded in
:mod:`lightning_gaudi_ds._compat`. DeepSpeed is imported only inside the functions that use it: importing it picks
DeepSpeed's global accelerator, which must wait until ``setup_environment`` has chosen the Trainer's device.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
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
from lightning_gaudi_ds._compat import _PATH, _StrategyRegistry, attached_trainer, weights_only_dropped_by_lightning
from lightning_gaudi_ds.checkpoint import resume
from lightning_gaudi_ds.checkpoint.io import refusal_named
from lightning_gaudi_ds.config import StrategyConfig, load_config, offloads_optimizer
from lightning_gaudi_ds.config.validate import check_trainer
from lightning_gaudi_ds.devices import DeviceSpec, device_spec
from lightning_gaudi_ds.engine import checkpointing, inference, process, train
from lightning_gaudi_ds.engine.device import reduce_on_device
from lightning_gaudi_ds.engine.step import engine_call, third_party_deprecations_silenced
from lightning_gaudi_ds.errors import ConfigError
from lightning_gaudi_ds.jit_ops.startup import SHM_MODE_ENV
from lightning_gaudi_ds.sequence import SequenceParallel

if TYPE_CHECKING:
    import deepspeed


class HPUDeepSpeedStrategy(process.StrategyCommon, DeepSpeedStrategy):
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
            engine, the model split across N = devices x num_nodes ranks; every rank reads the same batches.
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
        resume_data_position: a fit resumed from a checkpoint saved mid-epoch goes on with the batch after the last
            one it consumed, the train loader skipping the epoch's first batches by sampler index (default);
            ``False``: Lightning's behaviour, a plain DataLoader re-reads the epoch from its start. See
            :mod:`lightning_gaudi_ds.checkpoint.data_position`.
        sequence_parallel_size: DeepSpeed-Ulysses sequence parallelism: ``K`` ranks share each sequence, each holding
            ``1/K`` of it (the batch is split along the sequence, attention runs after an all-to-all on ``1/K`` of the
            heads); ``world / K`` sequences train at once. Default: the config's ``sequence_parallel_size``, else 1.
            Hugging Face models need nothing else; see :mod:`lightning_gaudi_ds.sequence`.
        sequence_parallel_modules: with ``sequence_parallel_size``, your own attention module classes (or import
            paths): modules whose forward takes query, key and value of shape (batch, heads, sequence, head size)
            first and returns the attention output so shaped.
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
        resume_data_position: bool = True,
        sequence_parallel_size: int | None = None,
        sequence_parallel_modules: Sequence[type[Module] | str] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(resume_data_position, bool):
            raise ConfigError(f"resume_data_position={resume_data_position!r}: pass True (a mid-epoch resume goes on"
                              " with the next batch) or False (it re-reads the epoch from its start, as Lightning).")
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
        self._inference = inference.serving_settings(
            dict(tensor_parallel=tensor_parallel, dtype=dtype, replace_with_kernel_inject=replace_with_kernel_inject,
                 injection_policy=injection_policy, replace_method=replace_method, enable_cuda_graph=enable_cuda_graph),
            self._inference_config, self._resolver.zero_arguments, self.config,
        )
        self._inference_dtype: torch.dtype | None = None
        # sequence parallelism (lightning_gaudi_ds.sequence)
        self._sequence = SequenceParallel.create(sequence_parallel_size, sequence_parallel_modules, self.config,
                                                 serving=self._inference is not None)
        self._resolver.sequence_parallel_size = self._sequence.size
        self._preemption = resume.PreemptionWatch()
        self.resume_data_position = resume_data_position

    @property
    def device_spec(self) -> DeviceSpec:
        """The device-table row of this strategy's root device."""
        return device_spec(self.root_device)

    @override
    def _configure_launcher(self) -> None:
        # The Trainer's constructor, once accelerator and precision are known: checks before any process starts.
        process.before_launch(self, self._runtime, self._resolver, self.precision_plugin.precision)
        assert self.parallel_devices is not None
        self._inference_dtype = inference.before_launch(self._inference, self.parallel_devices, self.num_nodes,
                                                        self.precision_plugin.precision)
        self._sequence.before_launch(len(self.parallel_devices) * self.num_nodes)  # sequence parallelism
        super()._configure_launcher()
        process.after_launcher(self._launcher, self._runtime)

    @override
    def setup_environment(self) -> None:
        # A copy of Lightning 2.6.6's without its CUDA-only gate; Trainer flags checked and the device prepared first.
        check_trainer(attached_trainer(self.lightning_module), serving=self._inference is not None)
        self._sequence.check_trainer(attached_trainer(self.lightning_module))  # sequence parallelism
        process.prepare_device(self, self._runtime, self._select_deepspeed_accelerator, self.set_world_ranks)
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        # A copy of Lightning 2.6.6's (process.start_distributed); serving decides whether the CPU shm op is loaded.
        mode = inference.shm_comm_mode(self._inference, self.world_size, os.environ.get(SHM_MODE_ENV))
        process.start_distributed(self, self._runtime, set_world_ranks=self.set_world_ranks, shm_comm=mode,
                                  init=self._init_deepspeed_distributed, offload=offloads_optimizer(self.config))
        self._sequence.start()  # sequence parallelism: its process groups

    @override
    def _init_deepspeed_distributed(self) -> None:
        process.bounded_init(self, super()._init_deepspeed_distributed)

    @override
    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or self.device_spec.backend

    def _select_deepspeed_accelerator(self, spec: DeviceSpec) -> None:
        process.set_deepspeed_accelerator(spec)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._runtime.before_engine(self.lightning_module, self.root_device)
        self._sequence.wrap(trainer.lightning_module)  # sequence parallelism: the all-to-all around attention
        with third_party_deprecations_silenced():
            super().setup(trainer)

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        # Lightning's zero.Init, with transformers told (from_pretrained loads into the partitions, see hf); resolved
        # first, so that transformers is imported, if at all, before zero.Init patches module construction.
        self._init_config_if_needed()
        start = functools.partial(self._sequence.sharded_context, super().model_sharded_context,  # mpu for zero.Init
                                  self.config, self.remote_device, enabled=self.zero_stage_3)
        with process.zero_init_context(self.config if self.zero_stage_3 else None, start):
            yield

    def _deepspeed_args(self) -> argparse.Namespace:
        return process.deepspeed_args(self.root_device, self.local_rank)

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any | None = None
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer]:
        # A copy of Lightning 2.6.6's, with the device rank from _deepspeed_args (CPU and HPU devices have no index)
        engine, ds_optimizer, _ = process.initialize(self, self._deepspeed_args(), model, optimizer, lr_scheduler)
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        with self._runtime.deepspeed_calls():
            self.model = inference.initialize(self, model, self._inference, self._inference_dtype)

    @override
    def _initialize_deepspeed_train(self, model: Module) -> None:
        train.initialize_engine(self, model)

    @override
    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Lightning's drops the number of checkpoints and synchronize_checkpoint_boundary: DeepSpeed reads the section.
        assert isinstance(self.config, dict)
        checkpointing.configure(self.config)

    def _client_optimizer_and_scheduler(self) -> tuple[Optimizer | None, LRSchedulerConfig | None]:
        return train.client_optimizer_and_scheduler(self)

    @override
    def _init_optimizers(self) -> tuple[Optimizer, LRSchedulerConfig | None]:
        return train.init_optimizers(super()._init_optimizers, self.lightning_module, self.config)

    backward = engine_call(DeepSpeedStrategy.backward)
    training_step = engine_call(DeepSpeedStrategy.training_step, graph_break=False)
    optimizer_step = engine_call(DeepSpeedStrategy.optimizer_step)
    validation_step = engine_call(DeepSpeedStrategy.validation_step, evaluation=True)
    test_step = engine_call(DeepSpeedStrategy.test_step, evaluation=True)
    predict_step = engine_call(DeepSpeedStrategy.predict_step, evaluation=True)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # sequence parallelism: this rank's part of every sequence
        return self._sequence.shard(super().batch_to_device(batch, device, dataloader_idx))

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return reduce_on_device(super().reduce, self, tensor, group, reduce_op)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        train.warn_at_train_start(self.lightning_module, self.zero_stage_3)
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:  # after Lightning's own SIGTERM handler, which it registers before this
            self._preemption.install(self, trainer)
            self._resolver.publish(trainer, rank_zero=self.is_global_zero)  # trainer.log_dir: every rank calls it

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        train.warn_at_train_end(self.lightning_module, self.zero_stage_3)

    @override
    def teardown(self) -> None:
        try:
            resume.save_on_preemption(self, attached_trainer(self.lightning_module))
        finally:
            super().teardown()

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        resume.hook_trainer(self, attached_trainer(model))

    @override
    def _load_config(self, config: _PATH | dict[str, Any] | None) -> dict[str, Any] | None:
        # In Lightning's __init__. The inference engine's keys (tensor_parallel, dtype, ...) are not DeepSpeed's.
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
    def set_world_ranks(self) -> None:
        process.adopt_launcher(self)
        super().set_world_ranks()

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the resolved DeepSpeed config (0-3)."""
        assert isinstance(self.config, dict)
        return self._resolver.zero_stage(self.config)

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:  # Lightning's own error
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        checkpoint = hf.with_model_info(checkpoint, self.lightning_module)
        ckpt.save(checkpoint, filepath, self, functools.partial(super().save_checkpoint, checkpoint),
                  lambda: self.zero_stage)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self._inference is None  # the inference engine splits the weights it is given: load them first

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        if self._inference is None:  # with sequence parallelism, the K ranks of a group read the same samples
            return self._sequence.sampler_kwargs(super().distributed_sampler_kwargs)
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

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        process.register(cls, strategy_registry)


# Defining the strategy registers its names, however this module was reached (see lightning_gaudi_ds/__init__.py).
HPUDeepSpeedStrategy.register_strategies(StrategyRegistry)
