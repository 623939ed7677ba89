"""``TensorParallelStrategy``: ``trainer.predict``, ``validate`` and ``test`` with the model split across ranks by
DeepSpeed's inference engine (``deepspeed.init_inference``, AutoTP or an injection policy), from the weights of a
checkpoint of any ZeRO stage.

The strategy is :class:`lightning_gaudi_ds.TensorParallelStrategy` (defined beside ``HPUDeepSpeedStrategy``, which
makes one when given ``tensor_parallel={"tp_size": N}`` or any of the inference engine's arguments or config keys):
:class:`TensorParallelServing` before ``HPUDeepSpeedStrategy``. This module holds the Trainer's hooks that differ
from training; the engine, its checks and the weights' loading are in :mod:`lightning_gaudi_ds.engine.inference`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module

from lightning_gaudi_ds._compat import _PATH, weights_only_dropped_by_lightning
from lightning_gaudi_ds.config.validate import check_trainer
from lightning_gaudi_ds.engine import inference
from lightning_gaudi_ds.jit_ops.startup import SHM_MODE_ENV

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_gaudi_ds.config.state import StrategyConfig
    from lightning_gaudi_ds.devices import DeviceSpec
    from lightning_gaudi_ds.engine.device import DeviceRuntime


class TensorParallelServing:
    """The serving hooks, as a mixin before the Trainer's ``HPUDeepSpeedStrategy`` (whose attributes it reads)."""

    _serves_tensor_parallel = True  # sequence parallelism is refused with it (lightning_gaudi_ds.sequence)

    if TYPE_CHECKING:
        _serving_arguments: dict[str, Any]
        _inference_config: dict[str, Any]
        _resolver: StrategyConfig
        _runtime: DeviceRuntime
        config: Any
        model: Any
        parallel_devices: list[torch.device] | None
        num_nodes: int
        world_size: int
        global_rank: int
        lightning_module: pl.LightningModule | None
        _precision_name: str
        device_spec: DeviceSpec

        def broadcast(self, obj: Any, src: int = 0) -> Any: ...
        def _before_launch(self) -> None: ...

    def _adopt_serving_arguments(self) -> None:
        # The end of __init__: the engine's settings from the arguments and the config's keys, checked.
        settings = inference.serving_settings(
            self._serving_arguments, self._inference_config, self._resolver.zero_arguments, self.config)
        # a TensorParallelStrategy() without any engine setting: one process per model, whole
        self._inference = settings if settings is not None else inference.InferenceSettings()
        self._inference_dtype: torch.dtype | None = None

    def _before_launch(self) -> None:  # type: ignore[no-redef]
        super()._before_launch()  # type: ignore[misc]
        assert self.parallel_devices is not None
        self._inference_dtype = inference.before_launch(self._inference, self.parallel_devices, self.num_nodes,
                                                        self._precision_name)

    def _check_trainer(self, trainer: pl.Trainer | None) -> None:
        check_trainer(trainer, serving=True)

    def _shm_comm(self) -> str | None:
        # Split layers sum through deepspeed.comm.inference_all_reduce, which the CPU shm op speeds up.
        return inference.shm_comm_mode(self._inference, self.world_size, os.environ.get(SHM_MODE_ENV))

    def _initialize_deepspeed_inference(self, model: Module) -> None:
        assert self._inference_dtype is not None
        with self._runtime.deepspeed_calls():
            self.model = inference.init_engine(model, self._inference, self._inference_dtype,
                                               self.device_spec.device_type, self.world_size)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return False  # the inference engine splits the weights it is given: load them first

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return inference.sampler_kwargs(self.world_size, self.global_rank, self._inference.tp_size)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.lightning_module is not None
        inference.load_weights(self.lightning_module, checkpoint, strict)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # Any ZeRO stage's shards, merged in memory, or one converted file.
        if weights_only is None:  # Lightning drops the Trainer's argument when restoring after setup
            weights_only = weights_only_dropped_by_lightning()
        return inference.load_full_state_dict(self.broadcast(str(checkpoint_path)), weights_only)


__all__ = ["TensorParallelServing"]
