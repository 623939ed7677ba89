"""A small, deterministic training job that the multi-process tests launch as a real script.

Run with plain python: Lightning's own launcher starts the other ranks. Each rank writes
``<out>/rank<N>.json`` with its per-step training losses, the metrics of validate/test after fit, the
number of predictions, and what the engine holds (partition sizes), so tests compare strategies.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gaudi_ds  # noqa: F401  (registers the strategy names)
from lightning_gaudi_ds import HPUDeepSpeedStrategy

HIDDEN = 512  # 512*512 = 262k elements per layer: above ZeRO-3's persistence threshold (1e5)


class RegressionModel(L.LightningModule):
    def __init__(self, lr: float | None = None, optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(32, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 4)
        )
        self.step_losses: list[float] = []
        self.probe: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y.float())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.step_losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr or 3e-3)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr or 0.05, momentum=0.9)


class EngineProbe(L.Callback):
    """Records what each rank holds right before the first optimizer step (gradients reduced)."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if pl_module.probe:
            return
        params = list(pl_module.parameters())
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        probe: dict[str, Any] = {"param_numel": sum(int(getattr(p, "ds_numel", p.numel())) for p in params)}
        probe["full_grad_numel"] = sum(p.grad.numel() for p in params if p.grad is not None)
        if engine is not None and hasattr(engine, "optimizer"):
            ds_opt = engine.optimizer
            inner = getattr(ds_opt, "optimizer", ds_opt)
            probe["optimizer_numel"] = sum(p.numel() for g in inner.param_groups for p in g["params"])
            partition_grads = getattr(ds_opt, "averaged_gradients", None) or {}
            probe["partition_grad_numel"] = sum(
                t.numel() for grads in partition_grads.values() for t in (grads or []) if torch.is_tensor(t)
            )
            large = [p for p in params if hasattr(p, "ds_tensor") and p.ds_numel > 100_000]
            if large:
                probe["stage3_large_numel"] = sum(int(p.ds_numel) for p in large)
                probe["stage3_large_local_numel"] = sum(p.ds_tensor.numel() for p in large)
            probe["zero_stage"] = int(engine.zero_optimization_stage())
        pl_module.probe = probe

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if engine is None or "optimizer_state_numel_after_step" in pl_module.probe:
            return
        ds_opt = engine.optimizer
        inner = getattr(ds_opt, "optimizer", ds_opt)
        pl_module.probe["optimizer_state_numel_after_step"] = sum(
            t.numel() for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        )


class Fault(L.Callback):
    """Launcher tests: rank ``rank`` (-1: every rank) raises, exits 3, kills itself or hangs at step ``step``."""

    def __init__(self, rank: int, step: int, mode: str) -> None:
        self.rank, self.step, self.mode = rank, step, mode

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.rank not in (-1, trainer.global_rank) or trainer.global_step != self.step:
            return
        print(f"rank {trainer.global_rank}: injecting fault {self.mode!r} at step {self.step}", flush=True)
        if self.mode == "raise":
            raise RuntimeError(f"injected fault on rank {trainer.global_rank}")
        if self.mode == "exit":
            os._exit(3)
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # "hang": ignores the SIGTERM Lightning only notes; needs SIGKILL


def make_data(n: int = 256, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 4, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="deepspeed", help="deepspeed | ddp | a registered name")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--offload-optimizer", action="store_true")
    parser.add_argument("--offload-parameters", action="store_true")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--no-eval", action="store_true")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--fault", default=None, help="launcher tests: RANK:STEP:raise|exit|kill|hang")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    L.seed_everything(42, workers=True)
    if args.strategy == "deepspeed":
        strategy: Any = HPUDeepSpeedStrategy(
            stage=args.stage, offload_optimizer=args.offload_optimizer, offload_parameters=args.offload_parameters
        )
    elif args.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="gloo")
    else:
        strategy = args.strategy
    model = RegressionModel(optimizer=args.optimizer)
    data = make_data()
    train = DataLoader(data, batch_size=args.batch_size, shuffle=False)
    val = DataLoader(data, batch_size=32)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=args.out,
        num_nodes=args.num_nodes,
        callbacks=[EngineProbe()] + ([Fault(int(r), int(s), m) for r, s, m in [args.fault.split(":")]] if args.fault else []),
    )
    trainer.fit(model, train, val)
    result: dict[str, Any] = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "cluster_environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "backend": getattr(trainer.strategy, "_process_group_backend", None),
        "precision": trainer.precision,
        "global_step": trainer.global_step,
        "step_losses": model.step_losses,
        "probe": model.probe,
        "param_dtype": str(next(model.parameters()).dtype),
    }
    if not args.no_eval:
        result["validate"] = trainer.validate(model, val, verbose=False)[0]
        result["test"] = trainer.test(model, val, verbose=False)[0]
        predictions = trainer.predict(model, DataLoader(data, batch_size=32))
        result["predict_rows"] = sum(p.shape[0] for p in predictions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    print(f"rank {trainer.global_rank} done pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
