"""Checkpoint scenarios as a real multi-rank job (Lightning's own launcher starts the other ranks).

For every ``--stages`` entry, in the same processes:

* ``full``: train ``2 * steps`` steps from scratch with ``ModelCheckpoint`` (one epoch = ``steps`` steps);
* ``resumed`` (``--parity``): a new Trainer and model resume from the step-``steps`` checkpoint of ``full``
  and train to ``2 * steps``: its losses must equal ``full``'s;
* ``--resume-from TEMPLATE`` (``{stage}`` is substituted): one fit resumed from that checkpoint instead of
  ``full``, for ``steps`` more steps (world-size changes).

``--kill-at-save N --kill-rank R`` SIGKILLs rank R during its N-th checkpoint save, after the model-state
file and before its ZeRO shard is written: deterministic half-written checkpoints.

Each rank writes ``<out>/rank<N>.json``: per fit the losses, learning rates and epochs per global step,
the model's outputs on a probe input and an optimizer-state fingerprint at train start and end, and the
checkpoint callback's paths.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_job import RegressionModel, make_data  # noqa: E402

import lightning_gaudi_ds  # noqa: F401,E402  (registers the strategy names)
from lightning_gaudi_ds import HPUDeepSpeedStrategy  # noqa: E402

BATCH = 16


class CkptModel(RegressionModel):
    """AdamW with a per-step ExponentialLR: resumes only match if optimizer *and* scheduler state come back."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr=lr, optimizer="adamw")
        self.records: dict[int, dict[str, Any]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.records[self.trainer.global_step + 1] = {"loss": float(loss.detach()), "lr": lr,
                                                      "epoch": self.trainer.current_epoch}
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def probe_input() -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(7))


def optimizer_fingerprint(trainer: L.Trainer) -> dict[str, float]:
    """World-size independent summary of the optimizer state: sums over all ranks' partitions."""
    ds_opt = trainer.strategy.deepspeed_engine.optimizer
    inner = getattr(ds_opt, "optimizer", ds_opt)
    sums = torch.zeros(2, dtype=torch.float64)
    step = 0.0
    for state in inner.state.values():
        for key, value in state.items():
            if key == "exp_avg":
                sums[0] += value.double().pow(2).sum()
            elif key == "exp_avg_sq":
                sums[1] += value.double().sum()
            elif key == "step":
                step = max(step, float(value))
    if trainer.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(sums)
    return {"exp_avg_sumsq": float(sums[0]), "exp_avg_sq_sum": float(sums[1]), "adam_step": step}


class Recorder(L.Callback):
    def __init__(self, kill_at_save: int = 0, kill_rank: int = -1) -> None:
        self.kill_at_save, self.kill_rank, self.saves = kill_at_save, kill_rank, 0
        self.info: dict[str, Any] = {}

    def _outputs(self, pl_module: L.LightningModule) -> list[list[float]]:
        with torch.no_grad():
            return pl_module(probe_input().to(pl_module.device)).float().tolist()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.info["start"] = {
            "global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "outputs": self._outputs(pl_module), "optimizer": optimizer_fingerprint(trainer),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "sched_last_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        }
        if self.kill_at_save and trainer.global_rank == self.kill_rank:
            engine = trainer.strategy.deepspeed_engine
            original = engine._save_zero_checkpoint

            def save_zero(*args: Any, **kwargs: Any) -> Any:
                self.saves += 1
                if self.saves == self.kill_at_save:
                    print(f"rank {trainer.global_rank}: SIGKILL during save {self.saves}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)

            engine._save_zero_checkpoint = save_zero

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.info["end"] = {
            "global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "outputs": self._outputs(pl_module), "optimizer": optimizer_fingerprint(trainer),
        }


def make_strategy(args: argparse.Namespace, stage: int) -> HPUDeepSpeedStrategy:
    return HPUDeepSpeedStrategy(stage=stage, timeout=__import__("datetime").timedelta(seconds=args.pg_timeout))


def fit(args: argparse.Namespace, stage: int, name: str, max_steps: int, ckpt_dir: Path,
        ckpt_path: Optional[str] = None, kill: bool = False) -> dict[str, Any]:
    L.seed_everything(42, workers=True)
    model = CkptModel()
    # one epoch = `steps` optimizer steps on the global batch, whatever the world size
    data = make_data(n=args.steps * BATCH * 2)
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, filename="{epoch}-{step}", every_n_train_steps=args.every, save_last=args.save_last,
        save_top_k=args.save_top_k, monitor="train_loss" if args.save_top_k > 0 else None,
        save_weights_only=args.weights_only,
    )
    recorder = Recorder(args.kill_at_save if kill else 0, args.kill_rank)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=make_strategy(args, stage), precision=args.precision,
        max_steps=max_steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint, recorder],
    )
    per_rank_batch = BATCH * 2 // args.devices  # same global batch on 1 and 2 ranks
    trainer.fit(model, DataLoader(data, batch_size=per_rank_batch, shuffle=False), ckpt_path=ckpt_path)
    return {
        "records": {str(k): v for k, v in sorted(model.records.items())},
        "global_step": trainer.global_step, "epoch": trainer.current_epoch, **recorder.info,
        "last_model_path": checkpoint.last_model_path, "best_model_path": checkpoint.best_model_path,
        "best_k_models": sorted(checkpoint.best_k_models),
        "ckpt_dir_listing": sorted(os.listdir(ckpt_dir)) if ckpt_dir.exists() else [],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=4, help="k: steps per epoch and before the resume point")
    parser.add_argument("--every", type=int, default=None, help="every_n_train_steps (default: steps)")
    parser.add_argument("--save-top-k", type=int, default=-1)
    parser.add_argument("--save-last", default="true", choices=["true", "false", "link"])
    parser.add_argument("--weights-only", action="store_true")
    parser.add_argument("--parity", action="store_true")
    parser.add_argument("--resume-from", default=None, help="checkpoint path template with {stage}")
    parser.add_argument("--kill-at-save", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--pg-timeout", type=float, default=60)
    args = parser.parse_args(argv)
    args.every = args.every or args.steps
    args.save_last = {"true": True, "false": False, "link": "link"}[args.save_last]

    torch.set_num_threads(1)
    out = Path(args.out)
    results: dict[str, Any] = {}
    for stage in args.stages:
        base = out / f"stage{stage}"
        if args.resume_from:
            results[f"stage{stage}/resumed"] = fit(args, stage, "resumed", 2 * args.steps, base / "resumed",
                                                   ckpt_path=args.resume_from.format(stage=stage))
            continue
        results[f"stage{stage}/full"] = fit(args, stage, "full", 2 * args.steps, base / "full",
                                            kill=bool(args.kill_at_save))
        if args.parity:
            resume = str(base / "full" / f"epoch=0-step={args.steps}.ckpt")
            results[f"stage{stage}/resumed"] = fit(args, stage, "resumed", 2 * args.steps, base / "resumed",
                                                   ckpt_path=resume)
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    print(f"rank {rank} done pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
