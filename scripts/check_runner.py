"""What ``scripts/device_check.py`` (CUDA) and ``scripts/hpu_check.py`` (Gaudi) share: one case of the example GPT
for a few steps at one ZeRO stage, timed, reported by rank 0 as one JSON line.

An entry script gives its device's parts as a :class:`Check`: the stack report, the strategy's arguments, what it
records and what it requires of a result.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module  # Lightning's launcher re-runs this script; pickling needs the module name
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Check:
    """One device's check."""

    description: str  # the first line of the entry script's docstring
    accelerator: str  # the default --accelerator
    stack: Callable[[], dict[str, Any]]  # the --stack report
    # what is wrong with a case's result (empty: it passed)
    verdict: Callable[[dict[str, Any], argparse.Namespace], list[str]]
    stack_help: str = "print versions, then exit"
    accelerators: tuple[str, ...] | None = None  # allowed --accelerator values (None: any)
    case_names_accelerator: bool = False  # the case name ends with the accelerator
    strategy_kwargs: Callable[[argparse.Namespace], dict[str, Any]] = field(default=lambda args: {})
    # extra fields, from (trainer, strategy, model) after fit and from trainer.strategy at on_train_start
    after_fit: Callable[[Any, Any, Any], dict[str, Any]] = field(default=lambda trainer, strategy, model: {})
    at_train_start: Callable[[Any, Any], dict[str, Any]] | None = None


def run_case(check: Check, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    example = _example()
    times: list[float] = []
    losses: list[float] = []
    seen: dict[str, Any] = {}

    class Record(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if check.at_train_start is not None:
                seen.update(check.at_train_start(trainer, pl_module))

        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *_: Any) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            losses.append(float(loss.detach().float().cpu()))
            times.append(time.perf_counter() - self.start)

    L.seed_everything(42, workers=True)
    model = example.LitGPT(n_layer=args.layers, n_embd=args.hidden, n_head=4, block_size=args.block_size,
                           warmup_steps=1)
    data = example.TextDataModule(block_size=args.block_size, batch_size=args.batch_size)
    strategy = HPUDeepSpeedStrategy(stage=args.stage, **check.strategy_kwargs(args))
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, precision=args.precision, strategy=strategy,
        max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )
    trainer.fit(model, datamodule=data)
    return {
        "world_size": trainer.world_size,
        "rank": trainer.global_rank,
        **seen,
        **check.after_fit(trainer, strategy, model),
        "steps": len(losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
        "first_step_s": round(times[0], 3) if times else None,
        "step_s_median_after_first": round(statistics.median(times[1:]), 4) if len(times) > 1 else None,
    }


def common_problems(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What every device requires: every step ran, with finite losses."""
    problems = []
    if result["steps"] != args.steps:
        problems.append(f"ran {result['steps']} of {args.steps} steps")
    if not result["finite"]:
        problems.append("a loss is not finite")
    return problems


def main(check: Check, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=check.description)
    parser.add_argument("--stack", action="store_true", help=check.stack_help)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accelerator", default=check.accelerator, choices=check.accelerators)
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    if args.stack:
        print(json.dumps(check.stack()), flush=True)
        return 0
    name = f"zero{args.stage}-{args.precision}" + (f"-{args.accelerator}" if check.case_names_accelerator else "")
    case = {"case": name, "stage": args.stage, "precision": args.precision, "accelerator": args.accelerator}
    args.devices = int(args.devices) if args.devices.isdigit() else args.devices
    try:
        result = run_case(check, args)
    except BaseException as err:  # noqa: BLE001  (the line must say what failed; the exit code carries it too)
        traceback.print_exc()
        print(json.dumps({**case, "ok": False, "error": f"{type(err).__name__}: {err}"}), flush=True)
        return 1
    problems = check.verdict(result, args)
    if result.pop("rank") == 0:
        print(json.dumps({**case, "ok": not problems, **({"problems": problems} if problems else {}), **result}),
              flush=True)
    return 0 if not problems else 1
