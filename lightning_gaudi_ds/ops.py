"""DeepSpeed's C++ ops at start-up: built ahead of time, stale build locks cleared, a gloo fallback.

On CPU, ``deepspeed.init_distributed`` JIT-builds the shared-memory communication op
(``deepspeed_shm_comm``, ``ShareMemCommBuilder``, deepspeed/comm/torch.py ``build_shm_op``) and ZeRO-Offload
builds ``cpu_adam`` (``CPUAdamBuilder``, on first ``DeepSpeedCPUAdam``). Both go through
``torch.utils.cpp_extension.load``, which serialises builders with ``FileBaton``: ``<build dir>/lock`` is
created with ``O_CREAT|O_EXCL``, **kept open** by the building process while it runs ninja in the build dir,
then closed and removed. The waiter polls for the file to disappear, with no limit. A build killed mid-way
leaves the file behind, and every later start-up then waits forever, printing nothing.

The owner of a lock is therefore knowable on Linux without FileBaton writing anything: a live owner has the
lock file open (``/proc/<pid>/fd``), and an orphaned compile still runs with its working directory in the
build dir (``/proc/<pid>/cwd``; ninja puts each compile in its own process group, so killing a build's
group leaves them running). A lock nobody has open and nobody builds under is stale. It is cleared
under our own ``flock`` (so two ranks never both clear, or clear the other's fresh lock), only after a
second look (same inode, still no holder) a moment later: a releasing owner closes before it removes.

Training never uses the shm op: ZeRO's collectives go through ``TorchBackend.all_reduce`` etc., which are
``torch.distributed`` calls; only ``deepspeed.comm.inference_all_reduce`` (AutoTP inference layers) calls the
kernel, and only when ``LOCAL_SIZE == world size`` (DeepSpeed's launcher sets it; Lightning's does not). The
op also costs a 66 MB ``/dev/shm`` segment per rank that DeepSpeed never unlinks. So by default
(``LIGHTNING_GAUDI_DS_SHM_COMM=off``) the strategy tells DeepSpeed not to build or load it
(``deepspeed.ops.__compatible_ops__``, read by ``build_shm_op``) and collectives are plain ``torch.distributed``;
``on`` loads it, building it once when missing (DeepSpeed's own behaviour), and falls back with one warning
when it cannot be built.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from lightning_gaudi_ds.config import offloads_optimizer

SHM_COMM = "deepspeed_shm_comm"
CPU_ADAM = "cpu_adam"
SHM_MODE_ENV = "LIGHTNING_GAUDI_DS_SHM_COMM"
SHM_MODES = ("off", "on")
FIX_COMMAND = "lightning-gaudi-ds env --clear-stale-locks"
BUILD_COMMAND = "lightning-gaudi-ds env --build-ops"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpSpec:
    """A DeepSpeed op that is compiled on first use."""

    name: str  # torch extension name = build directory name
    builder: str  # DeepSpeed builder class, resolved through the active DeepSpeed accelerator
    purpose: str


OPS: dict[str, OpSpec] = {
    SHM_COMM: OpSpec(SHM_COMM, "ShareMemCommBuilder", "CPU shared-memory all-reduce (deepspeed.comm.inference_all_reduce)"),
    CPU_ADAM: OpSpec(CPU_ADAM, "CPUAdamBuilder", "DeepSpeedCPUAdam, the optimizer step of ZeRO-Offload"),
}


class BuildLockError(RuntimeError):
    """A torch extension build lock that cannot be judged safe to wait on or to clear."""


# ------------------------------------------------------------------------------------------ paths
def extensions_root() -> Path:
    """Torch's extension root, by torch's own rule (``TORCH_EXTENSIONS_DIR``, else the user cache dir)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        acc = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        acc = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        acc = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{acc}"


def build_dir(name: str) -> Path:
    return extensions_root() / name


def lock_path(name: str) -> Path:
    return build_dir(name) / "lock"


def built_library(name: str) -> Optional[Path]:
    """The JIT-built shared library of op ``name``, if present."""
    lib = build_dir(name) / f"{name}.so"
    return lib if lib.is_file() else None


def installed_ops() -> dict[str, bool]:
    """Ops compiled into the DeepSpeed wheel at install time (``DS_BUILD_OPS=1``): no JIT build needed."""
    try:
        from deepspeed.git_version_info import installed_ops as ops

        return dict(ops)
    except Exception:  # an odd DeepSpeed build must not break start-up
        return {}


# ------------------------------------------------------------------------------------ lock owners
@dataclass(frozen=True)
class LockInfo:
    """What is known about one FileBaton lock file and who owns it."""

    path: Path
    exists: bool
    inode: Optional[int] = None
    age_s: Optional[float] = None
    holders: tuple[int, ...] = ()  # processes with the lock file open (the building process)
    builders: tuple[int, ...] = ()  # processes working in the build dir (ninja, the compiler)
    uninspected: int = 0  # processes of the lock's owner that could not be inspected (-1: no /proc)

    @property
    def state(self) -> str:
        """``absent``, ``live`` (someone builds), ``stale`` (owner gone) or ``unknown`` (cannot tell)."""
        if not self.exists:
            return "absent"
        if self.holders or self.builders:
            return "live"
        return "unknown" if self.uninspected else "stale"

    def describe(self) -> str:
        age = f", {self.age_s:.0f} s old" if self.age_s is not None else ""
        if self.state == "live":
            who = ", ".join(_process_summary(p) for p in (self.holders or self.builders))
            role = "held by" if self.holders else "no holder, but a compile still runs in its dir:"
            return f"{self.path} ({role} {who}{age})"
        if self.state == "stale":
            return f"{self.path} (stale: no process holds it or builds in its dir{age})"
        if self.state == "unknown":
            why = "no /proc to inspect" if self.uninspected < 0 else f"{self.uninspected} processes not inspectable"
            return f"{self.path} (owner unknown: {why}{age})"
        return f"{self.path} (absent)"


def _process_summary(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return f"pid {pid}"
    stopped = " STOPPED (resume it with `kill -CONT %d` or end it)" % pid if state in ("T", "t") else ""
    return f"pid {pid} `{cmd[:100]}`{stopped}"


def inspect_lock(path: os.PathLike[str] | str) -> LockInfo:
    """Find who holds ``path`` (a torch FileBaton lock) and who compiles in its directory."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return LockInfo(path, exists=False)
    age = max(0.0, time.time() - st.st_mtime)
    proc = Path("/proc")
    if not proc.is_dir():
        return LockInfo(path, True, st.st_ino, age, uninspected=-1)
    target = os.path.realpath(path)
    directory = os.path.realpath(path.parent)
    holders: list[int] = []
    builders: list[int] = []
    uninspected = 0
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            uid = entry.stat(follow_symlinks=False).st_uid
        except OSError:
            continue  # exited meanwhile
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if cwd == directory or cwd.startswith(directory + os.sep):
                builders.append(pid)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        holders.append(pid)
                        break
                except OSError:
                    continue
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            if uid == st.st_uid and _could_be_ours(pid):  # only the lock's creator (same uid) can hold it
                uninspected += 1
        except OSError:
            continue
    return LockInfo(path, True, st.st_ino, age, tuple(holders), tuple(b for b in builders if b not in holders),
                    uninspected)


def _permitted_caps(pid: str | int) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("CapPrm:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return None


def _could_be_ours(pid: int) -> bool:
    """Whether an uninspectable process could be a build run like ours.

    The kernel refuses to show another process's fds when it holds capabilities we lack (e.g. a container's
    init) or is not dumpable. A torch build is an ordinary process of the same user: one with capabilities
    beyond ours is not counted (a build run with more privileges than the checker is not seen).
    """
    theirs, ours = _permitted_caps(pid), _permitted_caps("self")
    if theirs is None or ours is None:
        return True
    return theirs & ~ours == 0


@contextlib.contextmanager
def _clear_guard(path: Path) -> Iterator[None]:
    """Serialise clearers of one lock (every rank may try at once) with an flock beside it."""
    guard = path.with_name(path.name + ".lgds-guard")
    fd = os.open(guard, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def clear_stale_lock(path: os.PathLike[str] | str, settle_s: float = 0.5) -> LockInfo:
    """Remove ``path`` if it is stale; return what was seen. Never removes a live lock.

    A lock is removed only when two looks ``settle_s`` apart agree (same inode, no holder, no compile in its
    dir): a releasing owner closes the file before it removes it. Raises :class:`BuildLockError` when the
    owner cannot be determined or the stale file cannot be removed.
    """
    path = Path(path)
    if not path.exists():
        return LockInfo(path, exists=False)
    try:
        with _clear_guard(path):
            first = inspect_lock(path)
            if first.state == "stale":
                time.sleep(settle_s)
                second = inspect_lock(path)
                if second.state != "stale" or second.inode != first.inode:
                    return second
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return first
    except OSError as err:
        raise BuildLockError(
            f"A stale torch extension build lock {path} cannot be removed ({err.strerror}). Remove it as its owner"
            f" (`rm {path}`), or point TORCH_EXTENSIONS_DIR at a directory you can write."
        ) from err
    if first.state == "unknown":
        raise BuildLockError(
            f"A torch extension build lock exists and its owner cannot be determined: {first.describe()}."
            f" If no DeepSpeed/torch extension build is running (`ps -ef | grep -E 'ninja|c\\+\\+'`), remove it:"
            f" `rm {path}`."
        )
    return first


def clear_stale_locks(
    names: Sequence[str] = tuple(OPS), say: Optional[Callable[[str], None]] = None, strict: bool = True
) -> list[LockInfo]:
    """Clear the stale build locks of ops ``names``; return the locks found (cleared ones: state ``stale``).

    With ``strict=False`` a lock that cannot be judged or removed is reported through ``say`` instead of raising.
    """
    found = []
    for name in names:
        try:
            info = clear_stale_lock(lock_path(name))
        except BuildLockError as err:
            if strict:
                raise
            if say is not None:
                say(f"warning: {err}")
            continue
        if info.exists:
            found.append(info)
            if say is not None and info.state == "stale":
                say(f"removed a stale DeepSpeed build lock left by a killed build: {info.describe()}")
    return found


def scan_locks(root: Optional[Path] = None) -> list[LockInfo]:
    """Every build lock under the extensions root (any extension, not only DeepSpeed's)."""
    root = root or extensions_root()
    if not root.is_dir():
        return []
    return [inspect_lock(p) for p in sorted(root.glob("*/lock"))]


# ---------------------------------------------------------------------------------- loading ops
def _say(message: str) -> None:
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
    prefix = f"[lightning_gaudi_ds rank {rank}]" if rank is not None else "[lightning_gaudi_ds]"
    print(f"{prefix} {message}", file=sys.stderr, flush=True)


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


def load_op(name: str, builder: Any, say: Callable[[str], None] = _say) -> Any:
    """``builder.load()`` with its build lock watched: a dead owner's lock is cleared and the load retried."""
    path = lock_path(name)
    clear_stale_locks([name], say, strict=True)
    for attempt in range(2):
        watch = _LockWatch(path, say)
        watch.start()
        try:
            return builder.load(verbose=False)
        except Exception:
            if watch.cleared.is_set() and attempt == 0:
                say(f"retrying the build of {name} after clearing the dead build's lock")
                _forget_jit_version(name)
                continue
            raise
        finally:
            watch.stop.set()
            watch.join()
    raise AssertionError("unreachable")


def _forget_jit_version(name: str) -> None:
    """Make torch's JIT loader build ``name`` again in this process (it skips names it has seen once)."""
    try:
        from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

        JIT_EXTENSION_VERSIONER.entries.pop(name, None)
    except (ImportError, AttributeError):
        pass


def compiler_missing() -> Optional[str]:
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


def _ds_builder(spec: OpSpec) -> Any:
    """The active DeepSpeed accelerator's builder for ``spec``, or None where it has none."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(spec.builder)
    if builder is None or type(builder).__name__ == "NotImplementedBuilder":
        return None
    return builder


@dataclass
class BuildResult:
    name: str
    ok: bool
    seconds: float
    detail: str  # library path, or why not


def build_ops(names: Sequence[str] = tuple(OPS), say: Callable[[str], None] = _say) -> list[BuildResult]:
    """Build (or confirm up to date) DeepSpeed ops ``names`` for the active DeepSpeed accelerator."""
    results = []
    for name in names:
        spec = OPS[name]
        start = time.monotonic()
        builder = _ds_builder(spec)
        if builder is None:
            results.append(BuildResult(name, True, 0.0, "not used by this DeepSpeed accelerator"))
            continue
        if not builder.is_compatible(verbose=False):
            results.append(BuildResult(name, False, 0.0, f"not compatible here: {getattr(builder, 'error_log', '')}"))
            continue
        verb = "checking that it is up to date" if built_library(name) else "building it (1-2 min on 2 cores)"
        say(f"DeepSpeed op {name} ({spec.purpose}): {verb} in {build_dir(name)}")
        try:
            load_op(name, builder, say)
        except Exception as err:  # report every op, not only the first failure
            results.append(BuildResult(name, False, time.monotonic() - start, _short(err)))
            continue
        lib = built_library(name)
        detail = str(lib) if lib else "loaded (installed with DeepSpeed)"
        results.append(BuildResult(name, True, time.monotonic() - start, detail))
    return results


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:300] if text else type(err).__name__


# ------------------------------------------------------------------------------------ start-up
@dataclass
class StartupOps:
    """What :func:`prepare_startup` decided, for logs and tests."""

    shm_comm: str  # "loaded" | "fallback" | "not used"
    reason: str = ""
    loaded: list[str] = field(default_factory=list)
    cleared_locks: list[str] = field(default_factory=list)


_fallback_said = False


def shm_mode(env: Mapping[str, str] = os.environ) -> str:
    """``off`` (default) or ``on``, from ``LIGHTNING_GAUDI_DS_SHM_COMM``."""
    mode = env.get(SHM_MODE_ENV, "off").strip().lower() or "off"
    if mode not in SHM_MODES:
        raise ValueError(f"{SHM_MODE_ENV}={mode!r} is not one of {', '.join(SHM_MODES)}.")
    return mode


def _disable_shm(reason: str, world_size: int, warn: bool) -> StartupOps:
    """Tell DeepSpeed not to build/load the shm op (``build_shm_op`` then returns None); warn once if asked."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM] = False
    global _fallback_said
    if warn and not _fallback_said and world_size > 1:
        _fallback_said = True
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"DeepSpeed's shared-memory comm op is not used ({reason}); collectives use plain"
                       " torch.distributed (ZeRO training's all-reduce always does).")
    else:
        log.debug("DeepSpeed's shared-memory comm op is not used: %s", reason)
    return StartupOps("fallback", reason)


def shm_segment_name(rank: int, env: Mapping[str, str] = os.environ) -> str:
    """The POSIX shm segment DeepSpeed's op creates for ``rank`` (shm.cpp ``shm_initialize``)."""
    return f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_{env.get('MASTER_PORT', '')}_{rank}"


def _unlink_own_segment(rank: int) -> None:
    # DeepSpeed never unlinks its 66 MB segment per rank: /dev/shm (RAM) fills up run after run. Peers keep
    # their mapping; by exit every rank has long passed shm_initialize (collectives followed it).
    with contextlib.suppress(OSError):
        os.unlink(Path("/dev/shm") / shm_segment_name(rank))


def prepare_startup(
    deepspeed_accelerator: str,
    config: Any = None,
    world_size: int = 1,
    say: Callable[[str], None] = _say,
) -> StartupOps:
    """Run on every rank before ``deepspeed.init_distributed``: never hang on a build lock, never compile silently.

    Clears stale build locks of DeepSpeed's JIT ops, decides whether the CPU shm op is loaded (see the module
    docstring) and, with ZeRO-Offload, loads ``cpu_adam`` (building it once if needed, with a message).
    """
    # Ops this run does not load only get a warning for a lock that cannot be judged; loaded ones raise.
    cleared = [str(i.path) for i in clear_stale_locks(tuple(OPS), say, strict=False) if i.state == "stale"]
    result = _prepare_shm(world_size, say) if deepspeed_accelerator == "cpu" else StartupOps("not used")
    result.cleared_locks = cleared
    if offloads_optimizer(config):
        builder = _ds_builder(OPS[CPU_ADAM])
        if builder is not None and not installed_ops().get(CPU_ADAM):
            if built_library(CPU_ADAM) is None:
                say(f"building DeepSpeed's {CPU_ADAM} op for ZeRO-Offload (first run only, 2-5 min on 2 cores);"
                    f" build it ahead with `{BUILD_COMMAND}`")
            try:
                load_op(CPU_ADAM, builder, say)
            except BuildLockError:
                raise
            except Exception as err:
                raise RuntimeError(
                    f"ZeRO-Offload needs DeepSpeed's {CPU_ADAM} op, which could not be built: {_short(err)}."
                    f" Install a C++ compiler and ninja, then run `{BUILD_COMMAND}`; or train without offload"
                    " (offload_optimizer=False)."
                ) from err
            result.loaded.append(CPU_ADAM)
    return result


def _prepare_shm(world_size: int, say: Callable[[str], None]) -> StartupOps:
    import deepspeed.ops

    mode = shm_mode()
    if not deepspeed.ops.__compatible_ops__.get(SHM_COMM, False):
        return StartupOps("not used", "DeepSpeed reports it incompatible here")
    builder = _ds_builder(OPS[SHM_COMM])
    if builder is None:
        return StartupOps("not used", "no builder on this DeepSpeed accelerator")
    if mode == "off":
        return _disable_shm(f"{SHM_MODE_ENV}=off, the default", world_size, warn=False)
    built = installed_ops().get(SHM_COMM) or built_library(SHM_COMM) is not None
    if not built and (missing := compiler_missing()) is not None:
        return _disable_shm(f"it cannot be built: {missing}", world_size, warn=True)
    if not built:
        say(f"building DeepSpeed's {SHM_COMM} op (first run only, 1-4 min on 2 cores);"
            f" build it ahead with `{BUILD_COMMAND}`")
    try:
        load_op(SHM_COMM, builder, say)
    except BuildLockError:
        raise
    except Exception as err:  # every rank sees the same failure (same build dir): all fall back alike
        return _disable_shm(f"its build failed: {_short(err)}", world_size, warn=True)
    if os.environ.get("LOCAL_SIZE") != str(world_size):
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"{SHM_MODE_ENV}=on: DeepSpeed's shm kernel engages only when LOCAL_SIZE equals the world"
                       f" size ({world_size}, all ranks on this machine); LOCAL_SIZE is"
                       f" {os.environ.get('LOCAL_SIZE')!r}, so the op is loaded but unused.")
    else:
        atexit.register(lambda: _unlink_own_segment(int(os.environ.get("RANK", "0"))))  # RANK: set by then
    return StartupOps("loaded", mode, [SHM_COMM])


# ----------------------------------------------------------------------------------------- CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_gaudi_ds.ops build [OP ...]`` (what scripts/setup.sh runs)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lightning_gaudi_ds.ops", description=main.__doc__)
    parser.add_argument("action", choices=("build", "clear-stale-locks"))
    parser.add_argument("ops", nargs="*", default=list(OPS), help=f"default: {' '.join(OPS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ops) - set(OPS))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; known: {', '.join(OPS)}")
    if args.action == "clear-stale-locks":
        clear_stale_locks(args.ops, _say)
        return 0
    return print_build_results(build_ops(args.ops))


def print_build_results(results: Sequence[BuildResult], file: Any = None) -> int:
    """One line per op; returns the exit code (1 if any failed)."""
    for r in results:
        print(f"{r.name:20s} {'ok ' if r.ok else 'FAILED'} {r.seconds:6.1f} s  {r.detail}", file=file or sys.stdout)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
