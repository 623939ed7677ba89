"""Checkpoint scenarios as one real multi-rank job (Lightning's own launcher starts the other ranks).

``--plan`` is a JSON list of fits, run in order in the same processes, each with a new model, strategy and
Trainer with ``ModelCheckpoint`` (keys: see ``DEFAULTS``; one epoch is ``epoch_steps`` optimizer steps of the
same global batch on any number of ranks, so runs on 1 and 2 ranks see the same batches).

``validate: true`` runs ``trainer.validate(ckpt_path=...)`` instead of a fit (the loaded weights, not resumed).

``predict: true`` runs ``trainer.predict(ckpt_path=...)`` with ``tensor_parallel={"tp_size": <devices>}`` (serving).
``load_weights_only`` is passed as ``weights_only=`` to that fit, validate or predict. ``expect_error: true`` records
the exception (type and message) instead of raising it, and the job goes on with the next entry.

``sampler``: the train loader's, ``null`` (Lightning gives its ``DistributedSampler(shuffle=True)``), ``"reversed"``
(the user's own sampler, which Lightning wraps in its ``DistributedSamplerWrapper``) or ``"unshuffled"`` (the user's
``DistributedSampler(shuffle=False)``, kept by Lightning); ``accumulate: N`` is ``accumulate_grad_batches`` (an epoch
is still ``epoch_steps`` optimizer steps),
``resume_data_position`` is the strategy's, and ``iterable: true`` feeds the data as an ``IterableDataset``.

``gather_rounds: N`` writes and reads the weights through ZeRO-3's ``GatheredParameters`` N times after a
validation and records the parameters that did not hold what rank 0 wrote.

``kill_at_save: N`` SIGKILLs rank ``kill_rank`` during its N-th checkpoint save of that fit, after the
model-state file and before its ZeRO optimizer shard is written: a deterministic half-written checkpoint.

``hpz: true`` trains with ZeRO++ hpZ (``HPUDeepSpeedStrategy(stage=3, hpz=True)``), ``zero`` adds
``zero_optimization`` keys (a config dict then drives the strategy), and ``wire: [start, steps]`` marks those steps for
the link counters read outside the job (``WireWindow``, ``--wire-dir``; tests/multinode/wire.py).

Each rank writes ``<out>/rank<N>.json``: per fit the loss, learning rate and epoch of every global step,
the model's outputs on a probe input and an optimizer-state fingerprint at train start and end, and the
checkpoint callback's paths.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import RegressionModel, WireWindow, job_parser, make_data, mark_first_step, say, write_result
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_gaudi_ds import HPUDeepSpeedStrategy

BATCH = 16


def gather_mismatches(module: torch.nn.Module, rounds: int) -> int:
    """ZeRO-3's ``GatheredParameters`` ``rounds`` times: rank 0 writes a value per parameter and round (every rank
    gets it on exit), then every rank gathers again and counts the parameters not holding it. A gather that returns
    before its all-gathers end (DeepSpeed 0.16.1 on gloo) shows as mismatches."""
    import deepspeed
    import torch.distributed as dist

    params, mismatches = list(module.parameters()), 0
    for round_ in range(rounds):
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                for i, param in enumerate(params):
                    param.fill_(round_ + i / 100)
        with deepspeed.zero.GatheredParameters(params):
            mismatches += sum(not bool((p == round_ + i / 100).all()) for i, p in enumerate(params))
    return mismatches


class CkptModel(RegressionModel):
    """The jobs' model with AdamW and a per-step ExponentialLR, recording every global step's loss, learning
    rate and epoch, and logging ``train_loss`` for ``ModelCheckpoint(monitor=...)``."""

    def __init__(self, gather_rounds: int = 0) -> None:
        super().__init__(optimizer="adamw_exp", lr=0.01)
        self.records: dict[int, dict[str, Any]] = {}
        self.gather_rounds, self.mismatches_in_configure_model = gather_rounds, -1

    def configure_model(self) -> None:
        # Overridden, so Lightning enters ZeRO-3's zero.Init around it in every fit, as for a model built here: with
        # hpZ, each fit's zero.Init makes its own hpZ group (tests/multinode/test_hpz.py runs four in one process)
        if self.gather_rounds:  # a module built here under ZeRO-3's zero.Init and written on rank 0, as transformers'
            # ZeRO-3 loading in from_pretrained does; not kept
            scratch = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
            self.mismatches_in_configure_model = gather_mismatches(scratch, self.gather_rounds)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.records[self.trainer.global_step + 1] = {"loss": float(loss.detach()), "lr": lr,
                                                      "epoch": self.trainer.current_epoch}
        self.log("train_loss", loss, sync_dist=True)
        return loss


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
    def __init__(self, kill_at_save: int = 0, kill_rank: int = -1, gather_rounds: int = 0) -> None:
        self.kill_at_save, self.kill_rank, self.saves = kill_at_save, kill_rank, 0
        self.gather_rounds = gather_rounds
        self.info: dict[str, Any] = {}

    def _outputs(self, pl_module: L.LightningModule) -> list[list[float]]:
        with torch.no_grad():
            param = next(pl_module.parameters())
            return pl_module(probe_input().to(param.device, param.dtype)).float().tolist()

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
                    say(f"rank {trainer.global_rank}: SIGKILL during save {self.saves}")
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)

            engine._save_zero_checkpoint = save_zero

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if "partition" in self.info:
            return
        # ZeRO-3: each rank's partition, and hpZ's secondary partition (built in forward, dropped by the step)
        params = [p for p in pl_module.parameters() if getattr(p, "ds_tensor", None) is not None]
        secondary = [p.ds_secondary_tensor for p in params if getattr(p, "ds_secondary_tensor", None) is not None]
        self.info["partition"] = {"primary_numel": sum(p.ds_tensor.numel() for p in params),
                                  "secondary_numel": sum(t.numel() for t in secondary),
                                  "secondary_params": len(secondary),
                                  "params_numel": sum(int(p.ds_numel) for p in params),
                                  "persistent_numel": sum(int(p.ds_numel) for p in params if p.ds_persist)}

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.info.setdefault("validation_start", {"outputs": self._outputs(pl_module)})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.gather_rounds:  # after validation: the rounds overwrite the weights
            self.info["gather_check"] = {"rounds": self.gather_rounds,
                                         "in_configure_model": pl_module.mismatches_in_configure_model,
                                         "in_the_engine": gather_mismatches(pl_module, self.gather_rounds)}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.info["end"] = {
            "global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "outputs": self._outputs(pl_module), "optimizer": optimizer_fingerprint(trainer),
        }


DEFAULTS: dict[str, Any] = {
    "stage": 2, "precision": "32-true", "max_steps": 8, "epoch_steps": 4, "ckpt_path": None, "every": 4,
    "save_top_k": -1, "save_last": True, "weights_only": False, "kill_at_save": 0, "kill_rank": 1,
    "validate": False,  # trainer.validate(ckpt_path=...) instead of fit
    "predict": False,  # trainer.predict(ckpt_path=...) with tensor-parallel serving instead of fit
    "load_weights_only": None, "expect_error": False,
    "sampler": None, "accumulate": 1, "resume_data_position": True, "iterable": False,
    "hpz": False, "zero": None, "wire": None,  # ZeRO++ hpZ, zero_optimization keys, a window for link counters
    "gather_rounds": 0,  # after validation, that many ZeRO-3 GatheredParameters write-and-read rounds
}


class Iterable(torch.utils.data.IterableDataset):
    """A dataset's samples in order, as an IterableDataset (no state: its position cannot be restored)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __iter__(self) -> Any:
        import torch.distributed as dist

        rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return (self.data[i] for i in range(rank, len(self.data), ranks))


class Reversed(torch.utils.data.Sampler):
    """A deterministic sampler of the user's own: the dataset backwards."""

    def __init__(self, data: Any) -> None:
        self.size = len(data)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:
        return iter(range(self.size - 1, -1, -1))


def make_sampler(kind: str | None, data: Any) -> Any:
    if kind == "unshuffled":
        from torch.utils.data.distributed import DistributedSampler

        return DistributedSampler(data, shuffle=False)
    return Reversed(data) if kind == "reversed" else None


def fit(spec: dict[str, Any], devices: int, pg_timeout: float, num_nodes: int = 1, wire_dir: str | None = None
        ) -> dict[str, Any]:
    """One Trainer.fit as described by ``spec`` (keys of DEFAULTS plus ``name`` and ``dir``)."""
    spec = {**DEFAULTS, **spec}
    if spec["expect_error"]:
        try:
            return {"returned": fit({**spec, "expect_error": False}, devices, pg_timeout, num_nodes, wire_dir)}
        except Exception as err:  # noqa: BLE001  (the test reads what was raised)
            return {"error": type(err).__name__, "bases": [c.__name__ for c in type(err).__mro__],
                    "message": str(err)}
    L.seed_everything(42, workers=True)
    model = CkptModel(spec["gather_rounds"])
    data = make_data(n=spec["epoch_steps"] * spec["accumulate"] * BATCH * 2)  # `epoch_steps` steps of one global batch
    ckpt_dir = Path(spec["dir"])
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, filename="{epoch}-{step}", every_n_train_steps=spec["every"], save_last=spec["save_last"],
        save_top_k=spec["save_top_k"], monitor="train_loss" if spec["save_top_k"] > 0 else None,
        save_weights_only=spec["weights_only"],
    )
    recorder = Recorder(spec["kill_at_save"], spec["kill_rank"], spec["gather_rounds"])
    serving = {"tensor_parallel": {"tp_size": devices}} if spec["predict"] else {
        "stage": spec["stage"], "resume_data_position": spec["resume_data_position"]}
    if spec["hpz"]:
        serving["hpz"] = True
    if spec["zero"]:
        serving["config"] = {"zero_optimization": {"stage": spec["stage"], **spec["zero"]}}
    strategy = HPUDeepSpeedStrategy(**serving, timeout=timedelta(seconds=pg_timeout))
    windows = [WireWindow(wire_dir, spec["name"], *spec["wire"])] if spec["wire"] and wire_dir else []
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, precision=spec["precision"],
        max_steps=spec["max_steps"], accumulate_grad_batches=spec["accumulate"],
        limit_val_batches=2 if spec["validate"] else 0, num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint, recorder, *windows],
    )
    per_rank_batch = BATCH * 2 // (devices * num_nodes)  # the same global batch on 1 and 2 ranks
    started = time.monotonic()
    load = {"ckpt_path": spec["ckpt_path"], "weights_only": spec["load_weights_only"]}
    if spec["predict"]:
        predictions = trainer.predict(model, DataLoader(data, batch_size=per_rank_batch), **load)
        return {"predictions": len(predictions), "seconds": time.monotonic() - started}
    if spec["validate"]:
        loader = DataLoader(data, batch_size=per_rank_batch)
        metrics = trainer.validate(model, loader, verbose=False, **load)[0]
        return {"val_loss": metrics["val_loss"], **recorder.info, "seconds": time.monotonic() - started}
    if spec["iterable"]:
        train: Any = DataLoader(Iterable(data), batch_size=per_rank_batch)
    else:
        train = DataLoader(data, batch_size=per_rank_batch, sampler=make_sampler(spec["sampler"], data))
    trainer.fit(model, train, **load)
    return {
        "records": {str(k): v for k, v in sorted(model.records.items())},
        "global_step": trainer.global_step, "epoch": trainer.current_epoch, **recorder.info,
        "shuffled": bool(getattr(getattr(trainer.train_dataloader, "sampler", None), "shuffle", False)),
        "sampler": type(getattr(trainer.train_dataloader, "sampler", None)).__name__,
        "last_model_path": checkpoint.last_model_path, "best_model_path": checkpoint.best_model_path,
        "best_k_models": sorted(checkpoint.best_k_models),
        "ckpt_dir_listing": sorted(os.listdir(ckpt_dir)) if ckpt_dir.exists() else [],
        "seconds": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--plan", required=True, help="JSON list of fit specs (see DEFAULTS), run in order")
    parser.add_argument("--pg-timeout", type=float, default=60, help="process-group timeout, seconds")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes of the job (the multi-node tier)")
    parser.add_argument("--wire-dir", default=None, help="folder of the link-counter windows' marks (spec 'wire')")
    args = parser.parse_args(argv)
    mark_first_step()  # timed suite only (benchmarks/suite.py)

    torch.set_num_threads(1)
    results = {spec["name"]: fit(spec, args.devices, args.pg_timeout, args.num_nodes, args.wire_dir)
               for spec in json.loads(args.plan)}
    local = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
    rank = os.environ.get("RANK", "0") if args.num_nodes > 1 else local
    write_result(args.out, int(rank), results)


if __name__ == "__main__":
    main()
