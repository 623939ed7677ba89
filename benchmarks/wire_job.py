"""One rank of ``benchmarks/wire.py``'s job: every arm (a JSON list, ``--arms``) trained in turn in the same
processes, each a fit of the benchmark's model (bench_model.py) with a window of ``--steps`` steps after ``--warmup``
marked for the link counters read outside the job (``WireWindow``, tests/jobs/common.py; tests/multinode/wire.py).

Inside the window each rank also counts the ``torch.distributed`` collectives Python issues (benchmarks/meter.py:
calls and payload bytes per operation; Lightning DDP's C++ reducer is not seen) and times its steps. Rank 0 of each
host writes ``<out>/<arm>.rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "jobs"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from bench_model import BenchModule, ModelSize, ZeroSettings, deepspeed_config, make_dataset, make_loader  # noqa: E402
from common import WireWindow  # noqa: E402
from meter import CollectiveCounter, delta  # noqa: E402

from lightning_gaudi_ds import HPUDeepSpeedStrategy  # noqa: E402


class StepClock(L.Callback):
    """Wall time and the process's CPU time (user + system, every thread) of each step in the window, and the
    collectives issued there."""

    def __init__(self, counter: CollectiveCounter, start: int, steps: int) -> None:
        self.counter, self.start, self.steps = counter, start, steps
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.collectives: dict[str, Any] = {}
        self._t = self._cpu = 0.0
        self._snap: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.start:
            self._snap = self.counter.snapshot()
        self._t, self._cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.start < trainer.global_step <= self.start + self.steps:
            self.times.append(time.perf_counter() - self._t)
            self.cpu_times.append(time.process_time() - self._cpu)
        if trainer.global_step == self.start + self.steps and self._snap is not None:
            self.collectives = delta(self.counter.snapshot(), self._snap)


def strategy_for(arm: dict[str, Any], size: ModelSize, batch_size: int) -> Any:
    if arm["stage"] is None:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    config = deepspeed_config(arm["stage"], ZeroSettings.for_hidden(size.hidden), arm.get("offload_optimizer", False),
                              arm.get("offload_parameters", False), tuple((arm.get("zero") or {}).items()))
    config["train_micro_batch_size_per_gpu"] = batch_size
    return HPUDeepSpeedStrategy(stage=arm["stage"], config=config, hpz=arm.get("hpz", False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--wire-dir", required=True)
    parser.add_argument("--arms", required=True, help="JSON list of {name, stage, hpz, offload_*, zero}")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counter = CollectiveCounter().install()
    size = ModelSize(args.hidden, args.layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = args.devices * args.num_nodes
    for arm in json.loads(args.arms):
        L.seed_everything(1234, workers=True)
        clock = StepClock(counter, args.warmup, args.steps)
        trainer = L.Trainer(
            accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
            strategy=strategy_for(arm, size, args.batch_size), precision=args.precision,
            max_steps=args.warmup + args.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[clock, WireWindow(args.wire_dir, arm["name"], args.warmup, args.steps, timeout=300)],
        )
        samples = args.batch_size * world * (args.warmup + args.steps)
        trainer.fit(BenchModule(size), make_loader(make_dataset(size, samples), args.batch_size))
        config = getattr(trainer.strategy, "config", None)
        if trainer.local_rank == 0:
            record = {"arm": arm["name"], "rank": trainer.global_rank, "host": os.uname().nodename,
                      "step_seconds": clock.times, "step_cpu_seconds": clock.cpu_times,
                      "collectives": clock.collectives,
                      "zero_optimization": (config or {}).get("zero_optimization")}
            (out / f"{arm['name']}.rank{trainer.global_rank}.json").write_text(json.dumps(record, default=repr))
        print(f"rank {trainer.global_rank}: {arm['name']} done, steps {[round(t, 3) for t in clock.times]}",
              flush=True)


if __name__ == "__main__":
    main()
