"""``lightning-gaudi-ds env``: what a bug report needs (device, backend, versions, DeepSpeed ops, build locks).

Also ``--build-ops`` (build DeepSpeed's JIT ops now; what scripts/setup.sh runs) and ``--clear-stale-locks``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from lightning_gaudi_ds.jit_ops import build, locks, startup

_ENV_VARS = ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", startup.SHM_MODE_ENV, "LOCAL_SIZE", "CXX", "PT_HPU_LAZY_MODE",
             "DEEPSPEED_USE_HPU", "PL_DEEPSPEED_CONFIG_PATH", "OMP_NUM_THREADS")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--build-ops", nargs="*", metavar="OP", choices=list(build.OPS),
                        help=f"build DeepSpeed's JIT ops now (default: all of {', '.join(build.OPS)})")
    parser.add_argument("--clear-stale-locks", action="store_true",
                        help="remove build locks whose owner no longer exists (never a live build's)")


def run(args: argparse.Namespace) -> int:
    code = 0
    if args.clear_stale_locks:
        try:
            cleared = [i for i in locks.clear_stale_locks(tuple(build.OPS), print) if i.state == "stale"]
        except locks.BuildLockError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        if not cleared:
            print("no stale DeepSpeed build locks")
    if args.build_ops is not None:
        out = sys.stderr if args.json else sys.stdout  # keep --json output parseable
        code = build.print_build_results(build.build_ops(args.build_ops or tuple(build.OPS)), file=out)
        print(file=out)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return code


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


_FORK_RELEASE = re.compile(r"\+hpu\.synapse\.v(?P<release>[0-9][0-9.]*[0-9])")


def habana_fork_release(deepspeed_version: str | None) -> str | None:
    """The release of Habana's DeepSpeed fork (``"1.21.0"``) from its version string (``0.16.1+hpu.synapse.v1.21.0``:
    the fork's setup.py appends its build.txt), or None for upstream DeepSpeed."""
    match = _FORK_RELEASE.search(deepspeed_version or "")
    return match["release"] if match else None


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx.split()[0])
    if path is None:
        return f"{cxx}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        first = out.splitlines()[0] if out else "?"
    except (OSError, subprocess.SubprocessError):
        first = "?"
    return f"{path} ({first})"


def collect() -> dict[str, Any]:
    """Everything the report prints, as plain data."""
    import torch

    from lightning_gaudi_ds.devices import DEVICES, detect_device_type, habana_frameworks_installed

    device = detect_device_type()
    spec = DEVICES[device]
    info: dict[str, Any] = {
        "lightning_gaudi_ds": _version("lightning_gaudi_ds"),
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "device": device,
        "backend": spec.backend,
        "deepspeed_accelerator": spec.deepspeed_accelerator,
        "versions": {
            "torch": torch.__version__,
            "torch_build": "cuda " + torch.version.cuda if torch.version.cuda else ("rocm " + torch.version.hip
                                                                                     if torch.version.hip else "cpu"),
            "lightning": _version("lightning"),
            "deepspeed": _version("deepspeed"),
            "habana_deepspeed_fork": habana_fork_release(_version("deepspeed")),
            "habana_frameworks": (_version("habana-torch-plugin") or "installed") if habana_frameworks_installed()
            else None,
        },
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "compiler": _compiler(),
        "ninja": shutil.which("ninja"),
        "extensions_root": str(locks.extensions_root()),
        "shm_comm_mode": _safe(startup.shm_mode),
        "env": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
    }
    installed = build.installed_ops()
    info["ops"] = {}
    for name, spec_ in build.OPS.items():
        lib = build.built_library(name)
        if installed.get(name):
            state = "installed with DeepSpeed"
        elif lib is not None:
            state = "built"
        else:
            state = "not built"
        info["ops"][name] = {"state": state, "path": str(lib) if lib else None, "purpose": spec_.purpose}
    info["build_locks"] = [
        {"path": str(lock.path), "state": lock.state, "detail": lock.describe()} for lock in locks.scan_locks()
    ]
    return info


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except ValueError as err:  # a bad env value is worth reporting, not crashing the report
        return f"invalid: {err}"


def render(info: dict[str, Any]) -> str:
    v = info["versions"]
    lines = [
        f"lightning_gaudi_ds    {info['lightning_gaudi_ds']}",
        f"python                {info['python']}",
        f"platform              {info['platform']} ({info['cpus']} CPUs)",
        f"device                {info['device']}  (backend {info['backend']},"
        f" DeepSpeed accelerator {info['deepspeed_accelerator']})",
        f"torch                 {v['torch']} ({v['torch_build']})",
        f"lightning             {v['lightning']}",
        f"deepspeed             {v['deepspeed']}"
        + (f" (Habana's fork, release {v['habana_deepspeed_fork']})" if v["habana_deepspeed_fork"] else " (upstream)"),
        f"habana_frameworks     {v['habana_frameworks'] or 'not installed'}",
        f"C++ compiler          {info['compiler']}",
        f"ninja                 {info['ninja'] or 'not found'}",
        f"torch extensions dir  {info['extensions_root']}",
        f"shm comm mode         {info['shm_comm_mode']} ({startup.SHM_MODE_ENV}: off | on)",
        "DeepSpeed JIT ops:",
    ]
    for name, op in info["ops"].items():
        where = f"  {op['path']}" if op["path"] else ""
        lines.append(f"  {name:20s} {op['state']}{where}")
    if any(op["state"] == "not built" for op in info["ops"].values()):
        lines.append(f"  (build them ahead with `{build.BUILD_COMMAND}`)")
    if info["build_locks"]:
        lines.append("build locks:")
        for lock in info["build_locks"]:
            lines.append(f"  {lock['state'].upper():7s} {lock['detail']}")
        if any(lock["state"] == "stale" for lock in info["build_locks"]):
            lines.append(f"  fix stale locks: `{locks.FIX_COMMAND}`")
    else:
        lines.append("build locks:          none")
    if info["env"]:
        lines.append("environment:          " + " ".join(f"{k}={val}" for k, val in info["env"].items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_gaudi_ds.report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
