"""A fit that a test interrupts, started by ``lightning-gaudi-ds spawn`` (torchrun, 2 ranks), for restarts.

It passes no ``ckpt_path``: under a restart (``LIGHTNING_GAUDI_DS_RESTART`` > 0) the strategy resumes from "last".
Each rank trains on one fixed batch of its own (the loader only paces the steps), and each step's loss is scaled by
a function of the global step, so a run's final weights depend on which steps ran, once each, and not on where a
resumed epoch reads its data: Lightning re-reads a plain DataLoader's epoch from its start when it resumes from a
checkpoint saved mid-epoch (its warning says so; a resumable loader, with ``state_dict``, avoids it).

``--kill "attempt:step:rank:signal"`` (repeatable): on that start of the job (0: the first), when ``global_step``
is ``step`` in ``training_step``, that rank (``all``: every rank) sends itself the signal (``KILL``, ``TERM``, or
``STOP``: it freezes, for a test to take its host down).
``--data``: train on the loader's batches instead, ``steps`` batches of distinct samples per rank in one epoch: the
final weights then depend on where a resumed epoch reads its data (the strategy's mid-epoch skip).
``--every K``: a checkpoint every K steps (default 2); ``--num_nodes 2``: one rank on each of two hosts (a restart
that ``--min_nodes`` moved to one host runs there with one rank: the strategy takes the runner's node count).
``--pace "attempt:seconds"`` (repeatable): on that start, every training step sleeps that long, so that a test can
signal the job mid-fit. Under srun (SLURM) the start is ``SLURM_RESTART_COUNT`` (how often the job was requeued).

Each rank writes ``<out>/attempt<A>-rank<R>.json``: the global steps its ``training_step`` saw and when (``times``,
``killed_at``: when it signalled itself; ``started``: when the process did), the checkpoint it resumed from, and
(rank 0 of a fit that completed) ``<out>/weights.pt``, the final fp32 weights.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import torch
from common import RegressionModel, say, start_process
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_gaudi_ds import HPUDeepSpeedStrategy

ATTEMPT = int(os.environ.get("LIGHTNING_GAUDI_DS_RESTART") or os.environ.get("SLURM_RESTART_COUNT") or "0")


class StepModel(RegressionModel):
    def __init__(self, kills: list[str], out: str, data: bool = False, pace: float = 0.0) -> None:  # plain types
        super().__init__(width=32, optimizer="adamw_exp", lr=0.01)  # (they go into hparams)
        self.kills, self.out, self.seen, self.lrs, self.losses = kills, Path(out), [], [], []
        self.pace = pace
        self.data = data
        self.sums: list[float] = []
        self.batches: list[float] = []
        self.times: list[float] = []
        self.killed_at: float | None = None
        self.fixed: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def on_fit_start(self) -> None:
        g = torch.Generator().manual_seed(3 + self.global_rank)  # each rank its own batch, the same every step
        self.fixed = (torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g))
        self.start_sum = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        loss = self._loss(batch if self.data else self.fixed)  # see the module's docstring
        self.seen.append(step)
        self.times.append(time.time())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.losses.append(float(loss.detach()))
        self.batches.append(float(batch[0].double().sum()))  # what the loader gave (recorded, not trained on)
        self._record()
        say(f"step {step} rank {self.global_rank}")
        for kill in self.kills:
            attempt, at, rank, sig = kill.split(":")
            if int(attempt) == ATTEMPT and int(at) == step and rank in ("all", str(self.global_rank)):
                self.killed_at = time.time()
                self._record()
                os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
        time.sleep(self.pace)
        return loss * (1.0 + 0.25 * (step % 3))

    def _weights_sum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.parameters()))

    def on_train_start(self) -> None:
        self.start_sum = self._weights_sum()

    def on_train_batch_end(self, *args: Any) -> None:
        self.sums.append(self._weights_sum())

    def _record(self, **extra: Any) -> None:
        path = self.out / f"attempt{ATTEMPT}-rank{self.global_rank}.json"
        loader = self.trainer.train_dataloader
        record = {"steps": self.seen, "lrs": self.lrs, "losses": self.losses, "sums": self.sums,
                  "batches": self.batches, "times": self.times, "killed_at": self.killed_at,
                  "started": psutil.Process().create_time(),
                  "sampler": repr(loader.sampler) if loader is not None else None,
                  "start_sum": self.start_sum, "resumed_from": self.trainer.ckpt_path and str(self.trainer.ckpt_path),
                  "world_size": self.trainer.world_size, "num_nodes": self.trainer.num_nodes,
                  "host": socket.gethostname(), "strategy": type(self.trainer.strategy).__name__,
                  "environment": type(self.trainer.strategy.cluster_environment).__name__,
                  **extra}
        path.write_text(json.dumps(record))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--every", type=int, default=2, help="ModelCheckpoint(every_n_train_steps=...)")
    parser.add_argument("--data", action="store_true", help="train on the loader's batches: one epoch, distinct")
    parser.add_argument("--num_nodes", type=int, default=1, help="2: one rank on each of two hosts")
    parser.add_argument("--pace", action="append", default=[], help="attempt:seconds: sleep per step on that start")
    args = parser.parse_args()
    start_process()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
    data = TensorDataset(x.repeat(4, 1), y.repeat(4, 1))  # 2 ranks x 8: 2 steps per epoch, every batch the same
    if args.data:  # one epoch of `steps` steps, every batch its own samples
        n = 16 * args.steps
        data = TensorDataset(torch.randn(n, 32, generator=g), torch.randn(n, 4, generator=g))
    pace = {int(a): float(s) for a, s in (p.split(":") for p in args.pace)}.get(ATTEMPT, 0.0)
    model = StepModel(args.kill, str(out), args.data, pace)
    trainer = L.Trainer(
        accelerator="cpu", devices=2 // args.num_nodes, num_nodes=args.num_nodes,
        strategy=HPUDeepSpeedStrategy(stage=2), max_steps=args.steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=args.every, save_top_k=-1,
                                   save_last=True)],
    )
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False))
    model._record(done=True, global_step=trainer.global_step)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().float().clone() for k, v in model.state_dict().items()}, out / "weights.pt")


if __name__ == "__main__":
    main()
