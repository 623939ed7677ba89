"""Step time with the DeepSpeed engine compiled (``HPUDeepSpeedStrategy(torch_compile=True)``) against eager.

    python benchmarks/compile_speed.py                    # results in benchmarks/results/compile.{jsonl,md}
    python benchmarks/compile_speed.py --rounds 3 --steps 40 --stage 3

On Gaudi the strategy compiles the engine with ``hpu_backend`` by default; here, on CPU, the same path runs with
DeepSpeed's CPU compile backend (inductor). Each arm is a fresh single-process Lightning job (ZeRO on gloo,
world size 1, one torch thread) training the example GPT (tied embedding/head); the arms alternate, rounds
repeat. Per job: the median step time after ``--warmup`` steps (the first ones include compilation), and the
first step's time. The result is the ratio compiled / eager of the medians, in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import publish
from flags import non_negative_int, positive_float, positive_int

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def job(args: argparse.Namespace) -> None:
    import importlib.util

    import lightning as L
    import torch

    sys.path.insert(0, str(REPO))
    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    spec = importlib.util.spec_from_file_location("train_lm", REPO / "examples" / "train_lm.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = example
    spec.loader.exec_module(example)

    times: list[float] = []

    class Record(L.Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            times.append(time.perf_counter() - self.start)

    torch.set_num_threads(1)
    L.seed_everything(0)
    model = example.LitGPT(n_layer=args.layers, n_embd=args.hidden, n_head=4, block_size=args.block_size,
                           warmup_steps=1)
    data = example.TextDataModule(block_size=args.block_size, batch_size=args.batch_size)
    strategy = HPUDeepSpeedStrategy(stage=args.stage, torch_compile=args.compile, reduce_bucket_size=args.hidden**2,
                                    allgather_bucket_size=args.hidden**2)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=args.precision, strategy=strategy,
                        max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record()])
    trainer.fit(model, datamodule=data)
    compiled = bool(getattr(trainer.strategy.model, "is_compiled", False))
    Path(args.out).write_text(json.dumps({"compiled": compiled, "times": times}))


def run_arm(args: argparse.Namespace, compile_: bool, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--job", "--out", str(out), "--stage", str(args.stage),
           "--steps", str(args.steps), "--precision", args.precision, "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--block-size", str(args.block_size), "--batch-size", str(args.batch_size)]
    if compile_:
        cmd.append("--compile")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1")
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"arm compile={compile_} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    measured = data["times"][args.warmup:]
    return {"compile": compile_, "engine_compiled": data["compiled"], "first_step_s": round(data["times"][0], 3),
            "median_step_s": round(statistics.median(measured), 5), "steps_measured": len(measured),
            "job_s": round(time.perf_counter() - started, 1), "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--warmup", type=non_negative_int, default=5)
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2)
    parser.add_argument("--precision", choices=("bf16-mixed", "bf16-true", "32-true", "16-mixed"), default="bf16-mixed")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--hidden", type=positive_int, default=128)
    parser.add_argument("--block-size", type=positive_int, default=64)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--timeout", type=positive_float, default=600)
    args = parser.parse_args(argv)
    if args.job:
        return job(args)

    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for compile_ in order:
                row = run_arm(args, compile_, Path(tmp) / f"{round_}-{compile_}.json")
                rows.append({"round": round_, **row})
                print(json.dumps(rows[-1]), flush=True)
    eager = statistics.median(r["median_step_s"] for r in rows if not r["compile"])
    compiled = statistics.median(r["median_step_s"] for r in rows if r["compile"])
    summary = {
        "kind": "compile_ratio", "compiled_over_eager": round(compiled / eager, 3), "eager_median_step_s": eager,
        "compiled_median_step_s": compiled, "command": "python benchmarks/compile_speed.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
        "versions": {"torch": torch.__version__}, "settings": {k: v for k, v in vars(args).items()
                                                               if k not in ("job", "out", "compile")},
    }
    print(json.dumps(summary), flush=True)
    lines = [{"kind": "compile_arm", "date": summary["date"], **row} for row in rows] + [summary]
    publish.append_text(RESULTS / "compile.jsonl", "".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
