"""One case of ``scripts/device_check.sh``: the example GPT for a few steps at one ZeRO stage on CUDA, one JSON line.

    python scripts/device_check.py --stack                                # versions and GPUs (JSON line)
    python scripts/device_check.py --stage 2 --steps 5                   # every visible GPU (nccl)
    python scripts/device_check.py --stage 2 --accelerator cpu --devices 2   # the same case on CPU (gloo)

Rank 0 prints ``{"case": ...}``: the losses, step times, the process-group backend, the device DeepSpeed's engine
runs on next to the strategy's root device (DeepSpeed is given ``device_rank`` = the device index on CUDA), the
parameter dtype and, on CUDA, the peak memory per rank. ``ok`` is true only when every step ran with a finite loss
on the expected backend and device. A failure prints the same line with ``"ok": false`` and the error, and exits 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hpu_check import _example, _version  # noqa: E402  (the example GPT, loaded so Lightning's launcher can re-run it)

EXPECTED_BACKEND = {"cuda": "nccl", "cpu": "gloo"}


def stack() -> dict[str, Any]:
    """Versions and the GPUs torch sees."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"stack": {"python": sys.version.split()[0], "torch": _version("torch"), "cuda": torch.version.cuda,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
                      "lightning": _version("lightning"), "deepspeed": _version("deepspeed"),
                      "lightning_gaudi_ds": _version("lightning_gaudi_ds"), "gpus": gpus}}


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    example = _example()
    times: list[float] = []
    losses: list[float] = []
    seen: dict[str, Any] = {}

    class Record(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            engine = trainer.strategy.model
            seen.update(
                backend=dist.get_backend() if dist.is_initialized() else None,
                root_device=str(trainer.strategy.root_device),
                engine_device=str(torch.device(engine.device)),
                param_dtype=str(next(pl_module.parameters()).dtype).replace("torch.", ""),
            )

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
    strategy = HPUDeepSpeedStrategy(stage=args.stage)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, precision=args.precision, strategy=strategy,
        max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )
    trainer.fit(model, datamodule=data)
    on_cuda = trainer.strategy.root_device.type == "cuda"
    return {
        "world_size": trainer.world_size,
        "rank": trainer.global_rank,
        **seen,
        "steps": len(losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
        "first_step_s": round(times[0], 3) if times else None,
        "step_s_median_after_first": round(statistics.median(times[1:]), 4) if len(times) > 1 else None,
        "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if on_cuda else None,
    }


def verdict(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What is wrong with a case's result (empty: it passed)."""
    problems = []
    if result["steps"] != args.steps:
        problems.append(f"ran {result['steps']} of {args.steps} steps")
    if not result["finite"]:
        problems.append("a loss is not finite")
    wanted = EXPECTED_BACKEND.get(args.accelerator)
    if wanted and result.get("backend") != wanted:
        problems.append(f"process-group backend {result.get('backend')}, expected {wanted}")
    if args.accelerator == "cuda" and result.get("engine_device") != result.get("root_device"):
        problems.append(f"DeepSpeed's engine is on {result.get('engine_device')}, the strategy on {result.get('root_device')}")
    if args.precision.startswith("bf16") and result.get("param_dtype") != "bfloat16":
        problems.append(f"parameters are {result.get('param_dtype')} under {args.precision}")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="store_true", help="print versions and GPUs, then exit")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accelerator", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    if args.stack:
        print(json.dumps(stack()), flush=True)
        return 0
    case = {"case": f"zero{args.stage}-{args.precision}-{args.accelerator}", "stage": args.stage,
            "precision": args.precision, "accelerator": args.accelerator}
    args.devices = int(args.devices) if args.devices.isdigit() else args.devices
    try:
        result = run_case(args)
    except BaseException as err:  # noqa: BLE001  (the line must say what failed; the exit code carries it too)
        traceback.print_exc()
        print(json.dumps({**case, "ok": False, "error": f"{type(err).__name__}: {err}"}), flush=True)
        return 1
    problems = verdict(result, args)
    if result.pop("rank") == 0:
        print(json.dumps({**case, "ok": not problems, **({"problems": problems} if problems else {}), **result}),
              flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
