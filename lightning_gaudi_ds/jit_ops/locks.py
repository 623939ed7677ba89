"""Torch extension build locks: who holds one, and clearing it when its owner is gone.

DeepSpeed's JIT ops go through ``torch.utils.cpp_extension.load``, which serialises builders with ``FileBaton``:
``<build dir>/lock`` is created with ``O_CREAT|O_EXCL``, **kept open** by the building process while it runs
ninja in the build dir, then closed and removed. A waiter polls for the file to disappear, with no limit. A build
killed mid-way leaves the file behind, and every later start-up then waits forever, printing nothing.

The owner of a lock is therefore knowable without FileBaton writing anything: a live owner has the lock file
open, and an orphaned compile still runs with its working directory in the build dir (ninja puts each compile in
its own process group, so killing a build's group leaves them running). A lock nobody has open and nobody builds
under is stale. It is cleared under a file lock of our own (so two ranks never both clear, or clear the other's
fresh lock), only after a second look (same inode, still no holder) a moment later: a releasing owner closes
before it removes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
from filelock import FileLock

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds._environ import scoped_environ
from lightning_gaudi_ds.errors import BuildLockError

FIX_COMMAND = "lightning-gaudi-ds env --clear-stale-locks"


# ------------------------------------------------------------------------------------------ paths
CACHE_ENV = "TORCH_EXTENSIONS_DIR"


def extensions_root(environ: Mapping[str, str] = os.environ) -> Path:
    """The op cache DeepSpeed's ops are built in and loaded from: ``TORCH_EXTENSIONS_DIR`` when set, else this
    environment's own (:func:`environment_cache_dir`), else torch's per-Python, per-build default."""
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])
    own = environment_cache_dir(environ=environ)
    return own if own is not None else _compat.extensions_root()


def environment_cache_dir(prefix: str = sys.prefix, base_prefix: str = sys.base_prefix,
                          environ: Mapping[str, str] = os.environ) -> Path | None:
    """This Python environment's own op cache, ``<sys.prefix>/torch_extensions/py<ver>_<build>``; None outside a
    virtual or conda environment (torch's shared default then applies).

    Torch's default cache is shared by every environment with the same Python and torch build, so two environments
    rebuild the same op against each other's DeepSpeed and torch on every switch.
    """
    if prefix == base_prefix and environ.get("CONDA_PREFIX") != prefix:
        return None
    return Path(prefix) / "torch_extensions" / _compat.extensions_tag()


def environment_ninja_dir() -> str | None:
    """The folder of this environment's own ninja (the ``ninja`` package), or None when it has none."""
    try:
        import ninja
    except ImportError:
        return None
    return str(ninja.BIN_DIR) if Path(ninja.BIN_DIR, "ninja").is_file() else None


@contextlib.contextmanager
def op_cache() -> Iterator[Path]:
    """Around a DeepSpeed op build or load: the op goes to :func:`extensions_root`; ``os.environ`` is as it was after.

    DeepSpeed's ``OpBuilder.load()`` passes no ``build_directory`` to torch's ``load()``, which then reads
    ``TORCH_EXTENSIONS_DIR``: it is set for this block only (unless the user set it). Torch runs the first ``ninja``
    on ``PATH``; this environment's own comes first for the block, so that the ninja that built an op is the one
    that checks it later. Another version reads the build's log as "command line changed" and builds it all again
    (ninja 1.13 hashes commands unlike 1.11: a venv's python run without activating it found Debian's ninja and
    rebuilt cpu_adam, 40-90 s, on every switch).
    """
    root = extensions_root()
    values = {CACHE_ENV: str(root)}
    ninja_dir = environment_ninja_dir()
    path = os.environ.get("PATH", "")
    with contextlib.ExitStack() as stack:
        stack.enter_context(scoped_environ(values))
        if ninja_dir is not None and path.split(os.pathsep)[0] != ninja_dir:
            stack.enter_context(scoped_environ({"PATH": os.pathsep.join(filter(None, [ninja_dir, path]))},
                                               override=True))
        yield root


def build_dir(name: str) -> Path:
    return extensions_root() / name


def lock_path(name: str) -> Path:
    return build_dir(name) / _compat.BUILD_LOCK_NAME


# ------------------------------------------------------------------------------------ lock owners
@dataclass(frozen=True)
class LockInfo:
    """What is known about one FileBaton lock file and who owns it."""

    path: Path
    exists: bool
    inode: int | None = None
    age_s: float | None = None
    holders: tuple[int, ...] = ()  # processes with the lock file open (the building process)
    builders: tuple[int, ...] = ()  # processes working in the build dir (ninja, the compiler)
    uninspected: int = 0  # processes of the lock's owner that could not be inspected (-1: no process table)

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
            why = ("the process table cannot be read" if self.uninspected < 0
                   else f"{self.uninspected} processes not inspectable")
            return f"{self.path} (owner unknown: {why}{age})"
        return f"{self.path} (absent)"


def _process_summary(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline())
        stopped = proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return f"pid {pid}"
    hint = f" STOPPED (resume it with `kill -CONT {pid}` or end it)" if stopped else ""
    return f"pid {pid} `{cmd[:100]}`{hint}"


def inspect_lock(path: os.PathLike[str] | str) -> LockInfo:
    """Find who holds ``path`` (a torch FileBaton lock) and who compiles in its directory."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return LockInfo(path, exists=False)
    age = max(0.0, time.time() - st.st_mtime)
    target = os.path.realpath(path)
    directory = os.path.realpath(path.parent)
    holders: list[int] = []
    builders: list[int] = []
    uninspected = 0
    try:
        processes = list(psutil.process_iter())
    except OSError:  # e.g. Linux without /proc mounted
        return LockInfo(path, True, st.st_ino, age, uninspected=-1)
    for proc in processes:
        try:
            cwd = proc.cwd()
            if cwd == directory or cwd.startswith(directory + os.sep):
                builders.append(proc.pid)
            if any(f.path == target for f in proc.open_files()):
                holders.append(proc.pid)
        except psutil.NoSuchProcess:  # exited meanwhile (zombies included)
            continue
        except psutil.AccessDenied:
            if _could_be_ours(proc, st.st_uid):
                uninspected += 1
    return LockInfo(path, True, st.st_ino, age, tuple(holders), tuple(b for b in builders if b not in holders),
                    uninspected)


def _could_be_ours(proc: psutil.Process, lock_uid: int) -> bool:
    """Whether a process we may not inspect could be a build that holds the lock.

    Only the lock's creator (same user) can hold it. The kernel also hides the files of a process of the same
    user that holds capabilities we lack (e.g. a container's init); a torch build is an ordinary process, so
    such a process is not counted (a build run with more privileges than the checker is not seen).
    """
    try:
        if proc.uids().effective != lock_uid:
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    theirs, ours = _permitted_capabilities(proc.pid), _permitted_capabilities("self")
    if theirs is None or ours is None:
        return True
    return theirs & ~ours == 0


def _permitted_capabilities(pid: int | str) -> int | None:
    """The permitted capability set of a process (Linux ``/proc/<pid>/status``; psutil does not report it)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("CapPrm:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return None


SETTLE_S = 0.5  # seconds between the two looks at a stale lock


def clear_stale_lock(path: os.PathLike[str] | str, settle_s: float | None = None) -> LockInfo:
    """Remove ``path`` if it is stale; return what was seen. Never removes a live lock.

    A lock is removed only when two looks ``settle_s`` (default :data:`SETTLE_S`) apart agree (same inode, no
    holder, no compile in its dir): a releasing owner closes the file before it removes it. Raises
    :class:`BuildLockError` when the owner cannot be determined or the stale file cannot be removed.
    """
    path = Path(path)
    if not path.exists():
        return LockInfo(path, exists=False)
    try:
        # Every rank may clear at once: one at a time, so none removes a fresh lock another rank's build took.
        with FileLock(path.with_name(path.name + ".lgds-guard")):
            first = inspect_lock(path)
            if first.state == "stale":
                time.sleep(SETTLE_S if settle_s is None else settle_s)
                second = inspect_lock(path)
                if second.state != "stale" or second.inode != first.inode:
                    return second
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return first
    except OSError as err:
        raise BuildLockError(
            f"A stale torch extension build lock {path} cannot be removed ({err.strerror or err}). Remove it as its"
            f" owner (`rm {path}`), or point TORCH_EXTENSIONS_DIR at a directory you can write."
        ) from err
    if first.state == "unknown":
        raise BuildLockError(
            f"A torch extension build lock exists and its owner cannot be determined: {first.describe()}."
            f" If no DeepSpeed/torch extension build is running (`ps -ef | grep -E 'ninja|c\\+\\+'`), remove it:"
            f" `rm {path}`."
        )
    return first


def clear_stale_locks(
    names: Sequence[str], say: Callable[[str], None] | None = None, strict: bool = True
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


def scan_locks(root: Path | None = None) -> list[LockInfo]:
    """Every build lock under the extensions root (any extension, not only DeepSpeed's)."""
    root = root or extensions_root()
    if not root.is_dir():
        return []
    return [inspect_lock(p) for p in sorted(root.glob(f"*/{_compat.BUILD_LOCK_NAME}"))]
