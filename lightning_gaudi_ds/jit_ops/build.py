"""Building DeepSpeed's JIT ops ahead of time, and loading one without ever waiting on a dead build.

On CPU, ``deepspeed.init_distributed`` JIT-builds the shared-memory communication op (``deepspeed_shm_comm``,
``ShareMemCommBuilder``) and ZeRO-Offload builds ``cpu_adam`` (``CPUAdamBuilder``, on first ``DeepSpeedCPUAdam``),
each on first use. ``lightning-gaudi-ds env --build-ops`` (what scripts/setup.sh runs) builds them now.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds.errors import SetupError
from lightning_gaudi_ds.jit_ops.locks import (
    build_dir,
    clear_stale_lock,
    clear_stale_locks,
    inspect_lock,
    lock_path,
    op_cache,
)
from lightning_gaudi_ds.launch import _proc

SHM_COMM = "deepspeed_shm_comm"
CPU_ADAM = "cpu_adam"
ASYNC_IO = "async_io"
BUILD_COMMAND = "lightning-gaudi-ds env --build-ops"


@dataclass(frozen=True)
class OpSpec:
    """A DeepSpeed op that is compiled on first use."""

    name: str  # torch extension name = build directory name
    builder: str  # DeepSpeed builder class, resolved through the active DeepSpeed accelerator
    purpose: str
    optional: str = ""  # what is missing without it, when training goes on without it (no failure then)


OPS: dict[str, OpSpec] = {
    SHM_COMM: OpSpec(SHM_COMM, "ShareMemCommBuilder",
                     "CPU shared-memory all-reduce (deepspeed.comm.inference_all_reduce)"),
    CPU_ADAM: OpSpec(CPU_ADAM, "CPUAdamBuilder", "DeepSpeedCPUAdam, the optimizer step of ZeRO-Offload"),
    ASYNC_IO: OpSpec(ASYNC_IO, "AsyncIOBuilder", "asynchronous file I/O of ZeRO-Infinity's NVMe offload",
                     optional="NVMe offload (offload_param/offload_optimizer device 'nvme') needs libaio-dev"),
}


def built_library(name: str) -> Path | None:
    """The JIT-built shared library of op ``name``, if present."""
    lib = build_dir(name) / f"{name}.so"
    return lib if lib.is_file() else None


def installed_ops() -> dict[str, bool]:
    """Ops compiled into the DeepSpeed wheel at install time (``DS_BUILD_OPS=1``): no JIT build needed."""
    try:
        from deepspeed.git_version_info import installed_ops as ops

        return dict(ops)
    except ImportError as err:  # a DeepSpeed built without git_version_info: no op was installed with it
        if err.name != "deepspeed.git_version_info":  # a broken DeepSpeed install: its own error, not JIT builds
            raise
        return {}


def say(message: str) -> None:
    """One line on stderr, with the rank when there is one (every rank of a job may be building)."""
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
    _proc.say(message, f"[lightning_gaudi_ds rank {rank}]" if rank is not None else "[lightning_gaudi_ds]")


# ---------------------------------------------------------------------------------------- loading
class _LockWatch(threading.Thread):
    """While this process loads an op: clear the lock if its owner dies, and say who is being waited on."""

    def __init__(self, path: Path, say: Callable[[str], None], poll_s: float = 0.5, first_report_s: float = 5.0,
                 report_s: float = 30.0) -> None:
        super().__init__(name=f"lgds-lock-watch-{path.parent.name}", daemon=True)
        self.path, self.say, self.poll_s, self.report_s = path, say, poll_s, report_s
        self.first_report_s = first_report_s
        self.stop = threading.Event()
        self.cleared = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        next_report = start + self.first_report_s
        while not self.stop.wait(self.poll_s):
            now = time.monotonic()
            try:
                info = inspect_lock(self.path)
                if info.state == "stale":
                    info = clear_stale_lock(self.path)
                    if info.state == "stale":
                        self.cleared.set()
                        self.say(f"the build this process waited on died; removed its lock {info.describe()}")
                elif info.state in ("live", "unknown") and os.getpid() not in info.holders and now >= next_report:
                    self.say(f"waiting {now - start:.0f} s for another process's build of {self.path.parent.name}:"
                             f" {info.describe()}")
                    next_report = now + self.report_s
            except Exception as err:  # e.g. a stale lock this user cannot remove: keep saying so, keep watching
                if now >= next_report:
                    self.say(f"still waiting on {self.path}: {err}")
                    next_report = now + self.report_s


def load_op(name: str, builder: Any, say: Callable[[str], None] = say) -> Any:
    """``builder.load()`` with its build lock watched: a dead owner's lock is cleared and the load retried."""
    path = lock_path(name)
    clear_stale_locks([name], say, strict=True)
    for attempt in range(2):
        watch = _LockWatch(path, say)
        watch.start()
        try:
            with op_cache():
                return builder.load(verbose=False)
        except Exception:  # re-raised, unless a dead build's lock was cleared meanwhile: then one retry
            if watch.cleared.is_set() and attempt == 0:
                say(f"retrying the build of {name} after clearing the dead build's lock")
                _compat.forget_jit_extension(name)  # else torch skips a name it has seen once in this process
                continue
            raise
        finally:
            watch.stop.set()
            watch.join()
    raise SetupError(f"building {name}: every attempt ended without an error or a result")  # not reached


def compiler_missing() -> str | None:
    """Why no C++ extension can be built here (no compiler, no ninja), or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx.split()[0]) is None:
        return f"no C++ compiler ({cxx!r} not found; set CXX or install g++)"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    return None


def ds_builder(spec: OpSpec) -> Any:
    """The active DeepSpeed accelerator's builder for ``spec``, or None where it has none."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(spec.builder)
    if builder is None or _compat.is_unimplemented_builder(builder):
        return None
    return builder


# ---------------------------------------------------------------------------------- ahead of time
@dataclass
class BuildResult:
    name: str
    ok: bool
    seconds: float
    detail: str  # library path, or why not


def build_ops(names: Sequence[str] = tuple(OPS), say: Callable[[str], None] = say) -> list[BuildResult]:
    """Build (or confirm up to date) DeepSpeed ops ``names`` for the active DeepSpeed accelerator, in this
    op cache (see :func:`~lightning_gaudi_ds.jit_ops.locks.extensions_root`)."""
    results = []
    for name in names:
        spec = OPS[name]
        start = time.monotonic()
        builder = ds_builder(spec)
        if builder is None:
            results.append(BuildResult(name, True, 0.0, "not used by this DeepSpeed accelerator"))
            continue
        if not builder.is_compatible(verbose=False):
            why = f"not compatible here: {getattr(builder, 'error_log', '') or ''}".strip()
            results.append(BuildResult(name, bool(spec.optional), 0.0,
                                       f"{why} ({spec.optional})" if spec.optional else why))
            continue
        verb = "checking that it is up to date" if built_library(name) else "building it (1-2 min on 2 cores)"
        say(f"DeepSpeed op {name} ({spec.purpose}): {verb} in {build_dir(name)}")
        try:
            load_op(name, builder, say)
        except Exception as err:  # report every op, not only the first failure
            results.append(BuildResult(name, False, time.monotonic() - start, short_error(err)))
            continue
        lib = built_library(name)
        detail = str(lib) if lib else "loaded (installed with DeepSpeed)"
        results.append(BuildResult(name, True, time.monotonic() - start, detail))
    return results


def short_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def print_build_results(results: Sequence[BuildResult], file: Any = None) -> int:
    """One line per op; returns the exit code (1 if any failed)."""
    for r in results:
        print(f"{r.name:20s} {'ok ' if r.ok else 'FAILED'} {r.seconds:6.1f} s  {r.detail}", file=file or sys.stdout)
    return 0 if all(r.ok for r in results) else 1
