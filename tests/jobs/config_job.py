"""A 2-rank training job driven by a DeepSpeed JSON config (tests/test_config_training.py launches it).

The data comes from a LightningDataModule whose ``setup`` builds the dataset, so the train loader's batch size is
only known once the fit loop has run ``setup``. Each rank writes ``<out>/rank<N>.json`` with the resolved
``strategy.config``, per-step losses and learning rates, and the optimizer the engine trains with.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gaudi_ds import HPUDeepSpeedStrategy

HIDDEN = 64  # largest 2-D parameter is 64 x 64: "hidden" = 64, reduce_bucket_size "auto" = 4096


class Model(L.LightningModule):
    def __init__(
        self,
        optimizer: str = "adamw",
        lr: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-7,
        weight_decay: float = 0.01,
        warmup_steps: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(32, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, 4))
        self.step_losses: list[float] = []
        self.step_lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.step_losses.append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.step_lrs.append(float(self.trainer.strategy.deepspeed_engine.optimizer.param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp.optimizer == "none":  # the config's optimizer/scheduler sections are used
            return None
        if hp.optimizer == "adam_sched":  # torch Adam (L2 weight decay) with a per-step scheduler
            opt = torch.optim.Adam(self.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr)
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.dataset: Optional[TensorDataset] = None

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(128, 32, generator=g)
        self.dataset = TensorDataset(x, torch.tanh(x @ torch.randn(32, 4, generator=g)))

    def train_dataloader(self) -> DataLoader:
        assert self.dataset is not None, "setup() must run before train_dataloader()"
        return DataLoader(self.dataset, batch_size=self.batch_size)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=None, help="JSON path; omit to use PL_DEEPSPEED_CONFIG_PATH or none")
    parser.add_argument("--stage", type=int, default=None, help="pass stage= to the strategy explicitly")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--csv-logger", action="store_true", help="log with CSVLogger under --out")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    L.seed_everything(42, workers=True)
    kwargs: dict[str, Any] = {} if args.stage is None else {"stage": args.stage}
    strategy = HPUDeepSpeedStrategy(config=args.config, **kwargs)
    model = Model(optimizer=args.optimizer)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(args.out) if args.csv_logger else False,
        default_root_dir=args.out,
    )
    trainer.fit(model, datamodule=Data(args.batch_size))
    log_dir = trainer.log_dir  # a broadcast: every rank asks
    engine = strategy.deepspeed_engine
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    result = {
        "rank": trainer.global_rank,
        "log_dir": log_dir,
        "global_step": trainer.global_step,
        "config": strategy.config,
        "step_losses": model.step_losses,
        "step_lrs": model.step_lrs,
        "basic_optimizer": type(basic).__name__,
        "adam_w_mode": getattr(basic, "adam_w_mode", None),
        "zero_stage": int(engine.zero_optimization_stage()),
        "gradient_clipping": engine.gradient_clipping(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=repr))
    print(f"rank {trainer.global_rank} done pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
