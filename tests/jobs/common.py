"""What the job scripts share: one model, its data, the engine probe, and the arguments every job takes.

The jobs run as plain scripts (their folder is ``sys.path[0]`` under every launcher), so they import this as
``common``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

INPUTS, OUTPUTS = 32, 4


class RegressionModel(L.LightningModule):
    """``32 -> width -> width -> 4`` with tanh; ``optimizer`` names the recipe ``configure_optimizers`` returns.

    The default width of 512 (262k elements per layer) is above ZeRO-3's persistence threshold (1e5), so
    stage 3 partitions the large weights. ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``warmup_steps``
    are saved as hyperparameters, where a DeepSpeed config's "auto" values find them; ``None`` leaves the
    optimizer's default.
    """

    def __init__(
        self,
        width: int = 512,
        optimizer: str = "sgd",
        lr: Optional[float] = None,
        betas: Optional[tuple[float, float]] = None,
        eps: Optional[float] = None,
        weight_decay: Optional[float] = None,
        warmup_steps: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(INPUTS, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, OUTPUTS)
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

    def _adam_kwargs(self) -> dict[str, Any]:
        hp = self.hparams
        return {k: hp[k] for k in ("betas", "eps", "weight_decay") if hp[k] is not None}

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr or 0.05, momentum=0.9)
        if hp.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=hp.lr or 3e-3, **self._adam_kwargs())
        if hp.optimizer == "none":  # the DeepSpeed config's optimizer (and scheduler) sections are used
            return None
        if hp.optimizer == "adam_sched":  # torch Adam (L2 weight decay) with a per-step LambdaLR 1/(step+1)
            opt = torch.optim.Adam(self.parameters(), lr=hp.lr or 0.01, **self._adam_kwargs())
            sched: Any = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if hp.optimizer == "adamw_exp":  # a resume only matches if optimizer *and* scheduler state come back
            opt = torch.optim.AdamW(self.parameters(), lr=hp.lr or 0.01, **self._adam_kwargs())
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        raise ValueError(f"optimizer={hp.optimizer!r}: use sgd, adamw, none, adam_sched or adamw_exp")


def make_data(n: int = 256, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, INPUTS, generator=g)
    w = torch.randn(INPUTS, OUTPUTS, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, OUTPUTS, generator=g)
    return TensorDataset(x, y)


class RegressionData(L.LightningDataModule):
    """``make_data`` built in ``setup``: the train loader's batch size is only known once the fit loop ran it."""

    def __init__(self, batch_size: int = 16, eval_batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.dataset: Optional[TensorDataset] = None

    def setup(self, stage: str) -> None:
        self.dataset = make_data()

    def _loader(self, batch_size: int) -> DataLoader:
        assert self.dataset is not None, "setup() must run before the loaders are asked for"
        return DataLoader(self.dataset, batch_size=batch_size, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.eval_batch_size)


def basic_optimizer(trainer: L.Trainer) -> Any:
    """The torch (or DeepSpeed) optimizer inside the DeepSpeed engine's ZeRO wrapper; None without an engine."""
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    if engine is None:
        return None
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


class EngineProbe(L.Callback):
    """Records what each rank holds right before the first optimizer step (gradients reduced), the optimizer
    state after it, and the learning rate the engine's optimizer has after every batch."""

    def __init__(self) -> None:
        self.step_lrs: list[float] = []
        self.zero3_trace: list[str] = []  # ZeRO-3: the parameter coordinator's trace mode after each batch

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
        if engine is None:
            return
        self.step_lrs.append(float(engine.optimizer.param_groups[0]["lr"]))
        offload = getattr(engine.optimizer, "parameter_offload", None)
        if offload is not None:
            from lightning_gaudi_ds._compat import zero3_param_coordinator

            coordinator = zero3_param_coordinator(offload)  # the fork keeps one per mode
            self.zero3_trace.append("complete" if coordinator.is_complete_trace() else
                                    "invalid" if coordinator.is_invalid_trace() else "record")
        if "optimizer_state_numel_after_step" in pl_module.probe:
            return
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        pl_module.probe["optimizer_state_numel_after_step"] = sum(
            t.numel() for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        )


def job_parser(doc: Optional[str]) -> argparse.ArgumentParser:
    """The arguments every job takes: where each rank writes its results, and how many ranks on this node."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results folder: rank<N>.json")
    parser.add_argument("--devices", type=int, default=2)
    return parser


def start_process() -> None:
    """Every rank: one compute thread (the machine is shared), and the same seed."""
    torch.set_num_threads(1)
    L.seed_everything(42, workers=True)
    mark_first_step()


_first_step_marked: list[bool] = []  # one hook per process, however many fits it runs


def mark_first_step() -> None:
    """When the suite is timed (tests/procs.py sets ``LGDS_FIRST_STEP_FILE``), append this rank's wall-clock time at
    its first optimizer step there: the end of start-up in benchmarks/results/suite.md. Otherwise nothing."""
    path = os.environ.get("LGDS_FIRST_STEP_FILE")
    if not path or _first_step_marked:
        return
    _first_step_marked.append(False)
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def first_step(*_: Any) -> None:  # stays registered (removing it while torch iterates the hooks fails): a no-op
        if _first_step_marked[0]:
            return
        _first_step_marked[0] = True
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{time.time()}\n")

    register_optimizer_step_pre_hook(first_step)


def write_result(out: str | Path, rank: int, result: dict[str, Any]) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "host": socket.gethostname()}
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=repr))
    say(f"rank {rank} done pid={os.getpid()}")


def say(line: str) -> None:
    """Print one line in one write: ranks share the job's stdout pipe, and print()'s separate writes of the text and
    its newline interleave ("{'python': 2}exit-threads rank=0 {...}" seen in CI), which the tests' line regexes miss."""
    import sys

    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


class WireWindow(L.Callback):
    """A window of ``steps`` training steps after the first ``start`` (at least 1), marked for the link counters read
    outside the job (tests/multinode/wire.py): after step ``start`` and after the window's last step, every rank waits
    in a barrier while rank 0 writes ``<folder>/<name>.<phase>.ready`` and waits (up to ``timeout`` s) for
    ``<name>.<phase>.go``. Callbacks that time steps go before it in the Trainer's list."""

    def __init__(self, folder: str | Path, name: str, start: int, steps: int, timeout: float = 120) -> None:
        self.folder, self.name, self.start, self.steps, self.timeout = Path(folder), name, start, steps, timeout

    def _mark(self, trainer: L.Trainer, phase: str) -> None:
        import time

        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            (self.folder / f"{self.name}.{phase}.ready").write_text(str(time.time()))
            go, deadline = self.folder / f"{self.name}.{phase}.go", time.monotonic() + self.timeout
            while not go.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer to {go.name} within {self.timeout} s (no counter reader running?)")
                time.sleep(0.01)
        trainer.strategy.barrier()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        # both marks at the end of a step (the warm-up's last, the window's last): the window's steps are whole
        if trainer.global_step == self.start:
            self._mark(trainer, "start")
        elif trainer.global_step == self.start + self.steps:
            self._mark(trainer, "end")
