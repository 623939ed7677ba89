"""Where Lightning's own DeepSpeed strategy fails and this one must not, as real multi-rank runs.

``--scenario``:

* ``fit``: ZeRO-3 fit, then ``trainer.save_checkpoint(<out>/zero3.ckpt)`` and validate/test/predict on the same
  Trainer (the metrics at the end of fit); records what ``model.state_dict()`` holds after fit.
* ``eval``: a new model and a new Trainer evaluate ``--ckpt`` (validate, test, predict with ``ckpt_path``), on
  any number of ranks; with ``--single-file``, also the checkpoint converted to one fp32 file, loaded with
  ``load_full_weights=True`` and, refused, without it.
* ``features``: in the same processes, fits without and with ``logging_batch_size_per_gpu`` (DeepSpeed's
  bookkeeping batch differs from the loader's), and a model whose blocks go through DeepSpeed's activation
  checkpointing without and with partitioned, contiguous, CPU-held checkpoints (validation included, which runs
  forwards without backward).

Each rank writes ``<out>/rank<N>.json``.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from common import INPUTS, OUTPUTS, RegressionData, RegressionModel, job_parser, start_process, write_result
from torch import nn

from lightning_gaudi_ds import HPUDeepSpeedStrategy, convert_zero_checkpoint_to_fp32_state_dict

EVAL_BATCH = 16  # the same global evaluation batches on 1 and 2 ranks: 256 samples split evenly


def _trainer(devices: int, strategy: HPUDeepSpeedStrategy, precision: str, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        **kwargs,
    )


def _evaluate(trainer: L.Trainer, model: L.LightningModule, data: L.LightningDataModule,
              ckpt_path: Optional[str] = None) -> dict[str, Any]:
    validate = trainer.validate(model, datamodule=data, ckpt_path=ckpt_path, verbose=False)[0]
    test = trainer.test(model, datamodule=data, ckpt_path=ckpt_path, verbose=False)[0]
    predictions = trainer.predict(model, datamodule=data, ckpt_path=ckpt_path)
    local = torch.cat([p.float() for p in predictions]).double()
    sums = torch.stack([local.sum(), local.abs().sum(), torch.tensor(float(local.shape[0]), dtype=torch.float64)])
    if trainer.world_size > 1:
        torch.distributed.all_reduce(sums)
    return {"val_loss": validate["val_loss"], "test_loss": test["test_loss"],
            "predict_sum": float(sums[0]), "predict_abs_sum": float(sums[1]), "predict_rows": int(sums[2])}


def fit_then_evaluate(args: Any) -> dict[str, Any]:
    model = RegressionModel(optimizer="adamw")
    data = RegressionData(batch_size=16, eval_batch_size=EVAL_BATCH // args.devices)
    trainer = _trainer(args.devices, HPUDeepSpeedStrategy(stage=3), args.precision, max_steps=6)
    trainer.fit(model, datamodule=data)
    state = model.state_dict()
    after_fit = {"state_dict_numel": sum(t.numel() for t in state.values()), "state_dict_tensors": len(state),
                 "model_numel": sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())}
    trainer.save_checkpoint(args.ckpt)
    return {"after_fit": after_fit, "end_of_fit": _evaluate(trainer, model, data), "global_step": trainer.global_step}


def evaluate_checkpoint(args: Any) -> dict[str, Any]:
    model = RegressionModel(optimizer="adamw")
    data = RegressionData(batch_size=16, eval_batch_size=EVAL_BATCH // args.devices)
    trainer = _trainer(args.devices, HPUDeepSpeedStrategy(stage=3), args.precision)
    out = {"from_checkpoint": _evaluate(trainer, model, data, ckpt_path=args.ckpt), "world_size": trainer.world_size}
    if args.single_file:  # the checkpoint as one fp32 file: loads with load_full_weights=True, and only so
        single = f"{args.out}/single.ckpt"
        if trainer.is_global_zero:
            convert_zero_checkpoint_to_fp32_state_dict(args.ckpt, single)
        trainer.strategy.barrier()
        trainer = _trainer(args.devices, HPUDeepSpeedStrategy(stage=3, load_full_weights=True), args.precision)
        out["single_file"] = _evaluate(trainer, RegressionModel(optimizer="adamw"), data, ckpt_path=single)
        trainer = _trainer(args.devices, HPUDeepSpeedStrategy(stage=3), args.precision)
        try:
            trainer.test(RegressionModel(optimizer="adamw"), datamodule=data, ckpt_path=single, verbose=False)
        except Exception as err:  # noqa: BLE001  (recorded for the test to check its type and message)
            out["single_file_sharded_loader"] = {"types": [c.__name__ for c in type(err).__mro__], "message": str(err)}
    return out


class CheckpointedModel(RegressionModel):
    """An input layer, then ``blocks`` blocks that go through ``deepspeed.checkpointing.checkpoint`` when
    ``checkpointed`` (the first checkpointed call gets a non-leaf input, as behind a transformer's embedding)."""

    def __init__(self, checkpointed: bool, blocks: int = 4, width: int = 64) -> None:
        super().__init__(width=width, optimizer="sgd")
        del self.net
        self.checkpointed = checkpointed
        self.inp = nn.Linear(INPUTS, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks))
        self.head = nn.Linear(width, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import deepspeed

        x = self.inp(x)
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.checkpointed else block(x)
        return self.head(x)


def _fit_losses(args: Any, model: RegressionModel, strategy: HPUDeepSpeedStrategy) -> dict[str, Any]:
    start_process()  # the same seed and data order for each fit
    data = RegressionData(batch_size=16, eval_batch_size=16)
    trainer = _trainer(args.devices, strategy, "32-true", max_steps=4, val_check_interval=2, limit_val_batches=4)
    trainer.fit(model, datamodule=data)
    assert isinstance(trainer.strategy.config, dict)
    engine = trainer.strategy.model
    return {"losses": model.step_losses, "val_loss": float(trainer.callback_metrics["val_loss"]),
            "config": trainer.strategy.config,
            "deepspeed_batch": {"micro": engine.train_micro_batch_size_per_gpu(), "train": engine.train_batch_size()}}


class NamedSchedulerModel(RegressionModel):
    """``configure_optimizers`` returns a scheduler config with a name and an interval, which must survive."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "name": "Sean", "interval": "step"}}


class ClipHookModel(RegressionModel):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


class SkipsBackwardModel(RegressionModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        return None


def lightning_behaviours(args: Any) -> dict[str, Any]:
    """Behaviours of Lightning's DeepSpeedStrategy this one inherits, checked on real engines."""
    import warnings

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    out: dict[str, Any] = {}
    start_process()
    monitor = LearningRateMonitor()
    model = NamedSchedulerModel(width=64)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=HPUDeepSpeedStrategy(stage=2),
                        max_steps=3, limit_val_batches=0, logger=CSVLogger(args.out), callbacks=[monitor],
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, datamodule=RegressionData(batch_size=16))
    config = trainer.lr_scheduler_configs[0]
    out["scheduler"] = {"name": config.name, "interval": config.interval, "type": type(config.scheduler).__name__,
                        "monitor": {k: [float(v) for v in vs] for k, vs in monitor.lrs.items()},
                        "inner_optimizer": type(getattr(trainer.optimizers[0], "optimizer", None)).__name__}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(args.devices, HPUDeepSpeedStrategy(stage=2), "32-true", max_steps=1, limit_val_batches=0)
        trainer.fit(ClipHookModel(width=64), datamodule=RegressionData(batch_size=16))
    out["clip_hook_warnings"] = [str(w.message) for w in caught if "gradient clipping" in str(w.message)]
    trainer = _trainer(args.devices, HPUDeepSpeedStrategy(stage=2), "32-true", max_steps=1, limit_val_batches=0)
    try:
        trainer.fit(SkipsBackwardModel(width=64), datamodule=RegressionData(batch_size=16))
    except Exception as err:  # noqa: BLE001  (recorded for the test to check its type and message)
        out["skip_backward"] = {"types": [c.__name__ for c in type(err).__mro__], "message": str(err)}
    return out


def features(args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    out["batch_default"] = _fit_losses(args, RegressionModel(width=64), HPUDeepSpeedStrategy(stage=2))
    torch.manual_seed(0)
    out["batch_logging_10"] = _fit_losses(
        args, RegressionModel(width=64), HPUDeepSpeedStrategy(stage=2, logging_batch_size_per_gpu=10))
    torch.manual_seed(0)
    out["act_plain"] = _fit_losses(args, CheckpointedModel(False), HPUDeepSpeedStrategy(stage=2))
    torch.manual_seed(0)
    out["act_contiguous"] = _fit_losses(args, CheckpointedModel(True), HPUDeepSpeedStrategy(
        stage=2, partition_activations=True, cpu_checkpointing=True, contiguous_memory_optimization=True,
        number_checkpoints=4))
    out.update(lightning_behaviours(args))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--scenario", choices=("fit", "eval", "features"), required=True)
    parser.add_argument("--ckpt", default=None, help="the ZeRO-3 checkpoint: written by `fit`, read by `eval`")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--single-file", action="store_true", help="eval: also as one fp32 file (1 rank)")
    args = parser.parse_args(argv)
    start_process()
    run = {"fit": fit_then_evaluate, "eval": evaluate_checkpoint, "features": features}[args.scenario]
    result = run(args)
    write_result(args.out, int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0, result)


if __name__ == "__main__":
    main()
