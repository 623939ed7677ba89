"""One case of ``scripts/hpu_check.sh``: the example GPT for a few steps at one ZeRO stage, one JSON line out.

    python scripts/hpu_check.py --stack                      # versions, device and execution mode (JSON line)
    python scripts/hpu_check.py --stage 2 --steps 5          # one case on every visible HPU
    python scripts/hpu_check.py --stage 2 --accelerator cpu --devices 1   # the same case on CPU

Rank 0 prints ``{"case": ...}`` with the losses, step times, execution mode, whether the engine was compiled and
whether the tied embedding/head weights were still one parameter after set-up. A failure prints the same line
with ``"ok": false`` and the error, and exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]


def _version(dist: str) -> Optional[str]:
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


def stack() -> dict[str, Any]:
    """Versions, device and execution mode, as the ranks will see them."""
    from lightning_gaudi_ds import hpu

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "lightning": _version("lightning"),
        "deepspeed": _version("deepspeed"),
        "lightning_gaudi_ds": _version("lightning_gaudi_ds"),
        "habana_frameworks": None,
        "PT_HPU_LAZY_MODE": os.environ.get(hpu.LAZY_MODE_ENV),
    }
    if hpu.habana_frameworks_installed():
        import habana_frameworks.torch  # noqa: F401  (fixes the execution mode, as in every rank)

        info.update(habana_frameworks=hpu.stack_version() or "installed", mode=hpu.imported_mode(),
                    device=hpu.device_name(), devices=hpu.device_count())
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        info.update(deepspeed_accelerator=accelerator._name, compile_backend=accelerator.get_compile_backend())
    return {"stack": info}


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    example = _example()
    times: list[float] = []
    losses: list[float] = []

    class Record(L.Callback):
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
    strategy = HPUDeepSpeedStrategy(stage=args.stage, reduce_bucket_size=args.hidden**2,
                                    allgather_bucket_size=args.hidden**2)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, precision=args.precision, strategy=strategy,
        max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )
    trainer.fit(model, datamodule=data)
    net = model.model
    tied = net is not None and net.lm_head.weight is net.wte.weight
    return {
        "world_size": trainer.world_size,
        "rank": trainer.global_rank,
        "device": str(trainer.strategy.root_device),
        "mode": getattr(strategy, "hpu_mode", None),
        "compiled": bool(getattr(trainer.strategy.model, "is_compiled", False)),
        "steps": len(losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
        "first_step_s": round(times[0], 3) if times else None,
        "step_s_median_after_first": round(statistics.median(times[1:]), 4) if len(times) > 1 else None,
        "tied_weights_kept": tied,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="store_true", help="print versions, device and mode, then exit")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accelerator", default="hpu")
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
    case = {"case": f"zero{args.stage}-{args.precision}", "stage": args.stage, "precision": args.precision,
            "accelerator": args.accelerator}
    devices = args.devices
    args.devices = int(devices) if devices.isdigit() else devices
    try:
        result = run_case(args)
    except BaseException as err:  # noqa: BLE001  (the line must say what failed; the exit code carries it too)
        traceback.print_exc()
        print(json.dumps({**case, "ok": False, "error": f"{type(err).__name__}: {err}"}), flush=True)
        return 1
    ok = result["steps"] == args.steps and result["finite"] and result["tied_weights_kept"]
    if result.pop("rank") == 0:
        print(json.dumps({**case, "ok": ok, **result}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
