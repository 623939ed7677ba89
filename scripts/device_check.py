"""One case of ``scripts/device_check.sh``: the example GPT for a few steps at one ZeRO stage on CUDA, one JSON line.

    python scripts/device_check.py --stack                                # versions and GPUs (JSON line)
    python scripts/device_check.py --stage 2 --steps 5                   # every visible GPU (nccl)
    python scripts/device_check.py --stage 2 --accelerator cpu --devices 2   # the same case on CPU (gloo)

Rank 0 prints ``{"case": ...}``: the losses, step times, the process-group backend, the device DeepSpeed's engine
runs on next to the strategy's root device (DeepSpeed is given ``device_rank`` = the device index on CUDA), the
parameter dtype and, on CUDA, the peak memory per rank. ``ok`` is true only when every step ran with a finite loss
on the expected backend and device. A failure prints the same line with ``"ok": false`` and the error, and exits 1.
The runner is ``scripts/check_runner.py``, shared with ``scripts/hpu_check.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_runner import Check, _version, common_problems, main  # noqa: E402  (a script next to this one)

EXPECTED_BACKEND = {"cuda": "nccl", "cpu": "gloo"}


def stack() -> dict[str, Any]:
    """Versions and the GPUs torch sees."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"stack": {"python": sys.version.split()[0], "torch": _version("torch"), "cuda": torch.version.cuda,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
                      "lightning": _version("lightning"), "deepspeed": _version("deepspeed"),
                      "lightning_gaudi_ds": _version("lightning_gaudi_ds"), "gpus": gpus}}


def _at_train_start(trainer: Any, pl_module: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    return dict(
        backend=dist.get_backend() if dist.is_initialized() else None,
        root_device=str(trainer.strategy.root_device),
        engine_device=str(torch.device(trainer.strategy.model.device)),
        param_dtype=str(next(pl_module.parameters()).dtype).replace("torch.", ""),
    )


def _after_fit(trainer: Any, strategy: Any, model: Any) -> dict[str, Any]:
    import torch

    on_cuda = trainer.strategy.root_device.type == "cuda"
    return {"peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if on_cuda else None}


def verdict(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What is wrong with a case's result (empty: it passed)."""
    problems = common_problems(result, args)
    wanted = EXPECTED_BACKEND.get(args.accelerator)
    if wanted and result.get("backend") != wanted:
        problems.append(f"process-group backend {result.get('backend')}, expected {wanted}")
    if args.accelerator == "cuda" and result.get("engine_device") != result.get("root_device"):
        problems.append(f"DeepSpeed's engine is on {result.get('engine_device')}, the strategy on {result.get('root_device')}")
    if args.precision.startswith("bf16") and result.get("param_dtype") != "bfloat16":
        problems.append(f"parameters are {result.get('param_dtype')} under {args.precision}")
    return problems


CHECK = Check(
    description=__doc__.splitlines()[0], accelerator="cuda", accelerators=("cuda", "cpu"), stack=stack,
    verdict=verdict, stack_help="print versions and GPUs, then exit", case_names_accelerator=True,
    at_train_start=_at_train_start, after_fit=_after_fit,
)

if __name__ == "__main__":
    sys.exit(main(CHECK))
