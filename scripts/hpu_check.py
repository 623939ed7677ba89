"""One case of ``scripts/hpu_check.sh``: the example GPT for a few steps at one ZeRO stage, one JSON line out.

    python scripts/hpu_check.py --stack                      # versions, device and execution mode (JSON line)
    python scripts/hpu_check.py --stage 2 --steps 5          # one case on every visible HPU
    python scripts/hpu_check.py --stage 2 --accelerator cpu --devices 1   # the same case on CPU

Rank 0 prints ``{"case": ...}`` with the losses, step times, execution mode, whether the engine was compiled and
whether the tied embedding/head weights were still one parameter after set-up. A failure prints the same line
with ``"ok": false`` and the error, and exits 1. The runner is ``scripts/check_runner.py``, shared with
``scripts/device_check.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_runner import Check, _version, common_problems, main  # noqa: E402  (a script next to this one)


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


def _after_fit(trainer: Any, strategy: Any, model: Any) -> dict[str, Any]:
    net = model.model
    return {
        "device": str(trainer.strategy.root_device),
        "mode": getattr(strategy, "hpu_mode", None),
        "compiled": bool(getattr(trainer.strategy.model, "is_compiled", False)),
        "tied_weights_kept": net is not None and net.lm_head.weight is net.wte.weight,
    }


def verdict(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What is wrong with a case's result (empty: it passed)."""
    problems = common_problems(result, args)
    if not result["tied_weights_kept"]:
        problems.append("the tied embedding and head weights became two parameters")
    return problems


CHECK = Check(
    description=__doc__.splitlines()[0], accelerator="hpu", stack=stack, verdict=verdict,
    stack_help="print versions, device and mode, then exit", after_fit=_after_fit,
    strategy_kwargs=lambda args: {"reduce_bucket_size": args.hidden**2, "allgather_bucket_size": args.hidden**2},
)

if __name__ == "__main__":
    sys.exit(main(CHECK))
