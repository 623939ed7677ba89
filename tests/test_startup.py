"""Start-up never hangs on a torch extension build lock, and trains when DeepSpeed's CPU op cannot be built.

Every test uses a private TORCH_EXTENSIONS_DIR: a lock planted in the shared cache would hang everyone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_gaudi_ds.jit_ops import build, locks, startup
from tests.procs import JOBS, free_port, kill_group, run_job

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture()
def ext_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "torch_extensions"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.setattr(locks, "SETTLE_S", 0.05)  # the two looks at a stale lock (tests without processes)
    return root


def _plant(ext: Path, name: str = build.SHM_COMM) -> Path:
    (ext / name).mkdir(parents=True, exist_ok=True)
    lock = ext / name / "lock"
    lock.touch()
    return lock


_FILE_BATON = Path(importlib.util.find_spec("torch").submodule_search_locations[0]) / "utils" / "file_baton.py"


class _Holder:
    """A real process that takes the lock exactly as torch's FileBaton does (O_CREAT|O_EXCL, kept open)."""

    def __init__(self, lock: Path, hold_s: float = 60.0, cwd: Path | None = None) -> None:
        code = textwrap.dedent(f"""
            import importlib.util, sys, time
            spec = importlib.util.spec_from_file_location("file_baton", {str(_FILE_BATON)!r})
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)   # torch's own FileBaton, without importing torch (slow)
            FileBaton = module.FileBaton
            baton = FileBaton({str(lock)!r})
            assert baton.try_acquire(), "lock already taken"
            print("held", flush=True)
            time.sleep({hold_s})
            baton.release()   # raises FileNotFoundError if someone removed our live lock
            print("released", flush=True)
        """)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=cwd, start_new_session=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "held"

    def kill(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait()

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out


# ---------------------------------------------------------------------------------- lock detection
def test_absent_lock(ext_dir: Path) -> None:
    assert locks.inspect_lock(locks.lock_path(build.SHM_COMM)).state == "absent"
    assert not locks.clear_stale_lock(locks.lock_path(build.SHM_COMM)).exists


def test_lock_without_owner_is_stale_and_cleared(ext_dir: Path) -> None:
    lock = _plant(ext_dir)
    assert locks.lock_path(build.SHM_COMM) == lock
    info = locks.inspect_lock(lock)
    assert info.state == "stale", info
    assert "stale" in info.describe() and str(lock) in info.describe()
    assert locks.clear_stale_lock(lock, settle_s=0.05).state == "stale"
    assert not lock.exists()


@pytest.mark.multiprocess
def test_lock_of_a_killed_owner_is_stale(ext_dir: Path) -> None:
    lock = ext_dir / build.SHM_COMM / "lock"
    lock.parent.mkdir()
    holder = _Holder(lock)
    try:
        info = locks.inspect_lock(lock)
        assert info.state == "live" and holder.proc.pid in info.holders, info
    finally:
        holder.kill()  # SIGTERM: FileBaton has no handler, the file stays behind like after Ctrl-C/kill
    assert lock.exists()
    assert locks.inspect_lock(lock).state == "stale"
    locks.clear_stale_lock(lock, settle_s=0.05)
    assert not lock.exists()


@pytest.mark.multiprocess
def test_live_lock_is_never_removed(ext_dir: Path) -> None:
    lock = ext_dir / build.SHM_COMM / "lock"
    lock.parent.mkdir()
    holder = _Holder(lock, hold_s=2.0)
    info = locks.clear_stale_lock(lock, settle_s=0.05)
    assert info.state == "live" and lock.exists()
    assert locks.clear_stale_locks([build.SHM_COMM], strict=True)[0].state == "live"
    rc, out = holder.finish()
    assert rc == 0, out  # its own release found the file it created: nobody broke the lock
    assert not lock.exists()


@pytest.mark.multiprocess
def test_orphaned_compile_in_build_dir_keeps_lock_live(ext_dir: Path) -> None:
    """The building Python was killed but its ninja/c++ still runs in the build dir: do not clear yet."""
    lock = _plant(ext_dir)
    compile_ = subprocess.Popen(["sleep", "30"], cwd=lock.parent, start_new_session=True)
    try:
        info = locks.inspect_lock(lock)
        assert info.state == "live" and compile_.pid in info.builders, info
        assert locks.clear_stale_lock(lock, settle_s=0.05).state == "live" and lock.exists()
    finally:
        kill_group(compile_.pid)
        compile_.wait()
    assert locks.clear_stale_lock(lock, settle_s=0.05).state == "stale" and not lock.exists()


def test_owner_that_cannot_be_inspected_is_an_error_naming_the_file(ext_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _plant(ext_dir)
    unknown = locks.LockInfo(lock, True, lock.stat().st_ino, 1.0, uninspected=-1)
    monkeypatch.setattr(locks, "inspect_lock", lambda path: unknown)
    with pytest.raises(locks.BuildLockError, match=f"rm {lock}"):
        locks.clear_stale_lock(lock)
    with pytest.raises(locks.BuildLockError):
        locks.clear_stale_locks([build.SHM_COMM], strict=True)
    said: list[str] = []
    assert locks.clear_stale_locks([build.SHM_COMM], said.append, strict=False) == []
    assert said and str(lock) in said[0]
    assert lock.exists()


def test_concurrent_clearers_remove_only_the_stale_lock(ext_dir: Path) -> None:
    """Every rank clears at once; none may remove the fresh lock another rank's build took meanwhile."""
    lock = _plant(ext_dir)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(locks.clear_stale_lock(lock, settle_s=0.2)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not lock.exists()
    assert sum(r.state == "stale" for r in results) >= 1


# ------------------------------------------------------------------------- loading with a watched lock
class _FakeBuilder:
    """Loads the way torch's ``_jit_compile`` does: its versioner (a name seen once in this process is not
    built again), FileBaton, build if acquired, else wait; then import."""

    def __init__(self, lock: Path) -> None:
        self.lock, self.builds = lock, 0

    def load(self, verbose: bool = False) -> str:
        from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER as versioner
        from torch.utils.file_baton import FileBaton

        old = versioner.get_version(build.SHM_COMM)
        version = versioner.bump_version_if_changed(
            build.SHM_COMM, [], build_arguments=[[]], build_directory=str(self.lock.parent), with_cuda=False,
            with_sycl=False, is_python_module=True, is_standalone=False)
        baton = FileBaton(str(self.lock), wait_seconds=0.05)
        if baton.try_acquire():
            try:
                if version != old:
                    self.builds += 1
                    (self.lock.parent / "op.so").write_text("built")
            finally:
                baton.release()
        else:
            baton.wait()
        if not (self.lock.parent / "op.so").exists():
            raise ImportError("op.so missing: the build this process waited on did not finish")
        return "module"


@pytest.fixture(autouse=True)
def _forget_fake_op() -> Iterator[None]:
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    JIT_EXTENSION_VERSIONER.entries.pop(build.SHM_COMM, None)
    yield
    JIT_EXTENSION_VERSIONER.entries.pop(build.SHM_COMM, None)


def _load_in_thread(builder: _FakeBuilder, said: list[str]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(build.load_op(build.SHM_COMM, builder, said.append))
        except BaseException as err:  # noqa: BLE001
            out.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.multiprocess
def test_waiter_recovers_when_the_builder_dies_mid_build(ext_dir: Path) -> None:
    lock = ext_dir / build.SHM_COMM / "lock"
    lock.parent.mkdir()
    holder = _Holder(lock)
    said: list[str] = []
    builder = _FakeBuilder(lock)
    thread, out = _load_in_thread(builder, said)
    time.sleep(1.5)
    assert thread.is_alive() and lock.exists()  # waiting on a live build, not breaking it
    holder.kill()
    thread.join(20)
    assert not thread.is_alive(), "load_op still waits on the dead build's lock"
    assert out == ["module"] and builder.builds == 1, (out, said)
    assert any("died" in s for s in said), said


@pytest.mark.multiprocess
def test_waiter_waits_for_a_live_build_and_reports_it(ext_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build._LockWatch, "__init__", _fast_report_init)
    lock = ext_dir / build.SHM_COMM / "lock"
    lock.parent.mkdir()
    holder = _Holder(lock, hold_s=3.0)
    (lock.parent / "op.so").write_text("built by the holder")
    said: list[str] = []
    builder = _FakeBuilder(lock)
    thread, out = _load_in_thread(builder, said)
    rc, output = holder.finish()
    thread.join(20)
    assert rc == 0, output
    assert out == ["module"] and builder.builds == 0, (out, said)
    assert any("waiting" in s and f"pid {holder.proc.pid}" in s for s in said), said


_original_watch_init = build._LockWatch.__init__


def _fast_report_init(self: Any, path: Path, say: Any, **kwargs: Any) -> None:
    _original_watch_init(self, path, say, poll_s=0.1, first_report_s=0.5, report_s=0.5)


# ------------------------------------------------------------------------------------- decisions
def test_shm_mode_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(startup.SHM_MODE_ENV, "yes")
    with pytest.raises(ValueError, match="off, on"):
        startup.shm_mode()
    monkeypatch.setenv(startup.SHM_MODE_ENV, " ON ")
    assert startup.shm_mode() == "on"
    monkeypatch.delenv(startup.SHM_MODE_ENV)
    assert startup.shm_mode() == "off"


def test_compiler_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert "no C++ compiler" in (build.compiler_missing() or "")


@pytest.fixture()
def compatible_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bool]]:
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(table, build.SHM_COMM, True)
    monkeypatch.setattr(startup, "_fallback_said", False)
    yield table


@pytest.mark.parametrize(
    ("mode", "cxx", "reason", "warns"),
    [
        (None, "c++", "=off, the default", False),
        ("off", "c++", "=off", False),
        ("on", "/nonexistent/c++", "cannot be built: no C++ compiler", True),
    ],
)
def test_fallback_is_decided_before_deepspeed_builds(
    ext_dir: Path, compatible_ops: dict[str, bool], monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder,
    mode: str | None, cxx: str, reason: str, warns: bool,
) -> None:
    if mode is None:
        monkeypatch.delenv(startup.SHM_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(startup.SHM_MODE_ENV, mode)
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(startup, "load_op", lambda *a, **k: pytest.fail("must not load or build"))
    result = startup.prepare_startup("cpu", False, world_size=2, say=lambda s: None)
    assert result.shm_comm == "fallback" and reason in result.reason, result
    assert compatible_ops[build.SHM_COMM] is False  # deepspeed's build_shm_op() now returns None
    said = [str(w.message) for w in recwarn if "shared-memory comm op" in str(w.message)]
    assert len(said) == (1 if warns else 0), said


def test_shm_on_loads_the_op_and_warns_when_it_cannot_engage(
    ext_dir: Path, compatible_ops: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(startup.SHM_MODE_ENV, "on")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    loaded: list[str] = []
    monkeypatch.setattr(startup, "load_op", lambda name, builder, say: loaded.append(name))
    with pytest.warns(UserWarning, match="LOCAL_SIZE equals the world size"):
        result = startup.prepare_startup("cpu", False, world_size=2, say=lambda s: None)
    assert result.shm_comm == "loaded" and loaded == [build.SHM_COMM]
    assert compatible_ops[build.SHM_COMM] is True


def test_failed_build_falls_back(
    ext_dir: Path, compatible_ops: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(startup.SHM_MODE_ENV, "on")

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Error building extension 'deepspeed_shm_comm'")

    monkeypatch.setattr(startup, "load_op", fail)
    with pytest.warns(UserWarning, match="its build failed"):
        result = startup.prepare_startup("cpu", False, world_size=2, say=lambda s: None)
    assert result.shm_comm == "fallback" and compatible_ops[build.SHM_COMM] is False


def test_start_clears_a_stale_lock_of_any_op_in_the_cache(ext_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ZeRO-Infinity start killed while zero.Init built pin_memory (async_io loads it; the set-up does not list it)
    leaves its lock: the next start clears it rather than hang in zero.Init, printing nothing."""
    monkeypatch.setenv(startup.SHM_MODE_ENV, "off")
    lock = _plant(ext_dir, "pin_memory")
    result = startup.prepare_startup("cpu", False, world_size=2, say=lambda s: None)
    assert not lock.exists() and result.cleared_locks == [str(lock)]


def test_offload_without_buildable_cpu_adam_is_a_clear_error(ext_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(startup.SHM_MODE_ENV, "off")
    monkeypatch.setattr(startup, "installed_ops", lambda: {})

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Error building extension 'cpu_adam'")

    monkeypatch.setattr(startup, "load_op", fail)
    with pytest.raises(RuntimeError, match="ZeRO-Offload needs DeepSpeed's cpu_adam.*--build-ops"):
        startup.prepare_startup("cpu", offload_optimizer=True, world_size=2, say=lambda s: None)


# ------------------------------------------------------------------------------- real processes
FALLBACK_ENV = {startup.SHM_MODE_ENV: "on", "CXX": "/bin/false"}


@pytest.fixture(scope="session")
def built_shm_ext(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the real op in a private dir after a build was killed mid-compile (the lock it left is cleared)."""
    root = tmp_path_factory.mktemp("ext_built")
    env = {"TORCH_EXTENSIONS_DIR": str(root)}
    cmd = [sys.executable, "-m", "lightning_gaudi_ds", "env", "--build-ops", build.SHM_COMM]
    lock = root / build.SHM_COMM / "lock"
    from tests.procs import job_env

    # the build to kill compiles for real: torch puts ccache or sccache before the compiler where installed (set-up
    # installs ccache), and from their cache the build could end before the kill
    no_cache = {"TORCH_NO_COMPILER_WRAPPER": "1", "CCACHE_DISABLE": "1"}
    proc = subprocess.Popen(cmd, env=job_env({**env, **no_cache}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not lock.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert lock.exists(), "the build never took its lock"
    time.sleep(2.0)  # let ninja start its compiles
    os.killpg(proc.pid, signal.SIGKILL)  # python and ninja; ninja's compiles run in their own process groups
    proc.wait()
    info = locks.inspect_lock(lock)
    assert info.exists and not info.holders, info  # stale, or live only through orphaned compiles
    for pid in info.builders:  # ours (the killed build's compiles): end them rather than wait minutes
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while locks.inspect_lock(lock).state != "stale" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert locks.inspect_lock(lock).state == "stale"
    result = run_job(cmd, timeout=900, env=env).check()
    assert "removed a stale" in result.output, result.output
    assert (root / build.SHM_COMM / f"{build.SHM_COMM}.so").is_file()
    return root


@pytest.mark.multiprocess
def test_two_ranks_clear_a_stale_lock_and_train_with_the_op(built_shm_ext: Path, tmp_path: Path) -> None:
    lock = _plant(built_shm_ext)
    port = str(free_port())
    env = {"TORCH_EXTENSIONS_DIR": str(built_shm_ext), "LOCAL_SIZE": "2", startup.SHM_MODE_ENV: "on",
           "MASTER_PORT": port}
    result = run_job([sys.executable, str(JOBS / "train_job.py"), "--out", str(tmp_path), "--no-eval",
                      "--max-steps", "2"], timeout=240, env=env, ranks=2).check()
    assert "removed a stale DeepSpeed build lock" in result.output
    assert result.output.count("deepspeed_shm_comm_op built successfully") == 2, result.output[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    assert not lock.exists()
    segments = [Path("/dev/shm") / startup.shm_segment_name(r, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                for r in range(2)]
    assert not any(p.exists() for p in segments), "DeepSpeed's shm segments leaked"


@pytest.mark.multiprocess
def test_shm_kernel_engages_under_lightnings_launcher_without_local_size_in_the_environment(
    built_shm_ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strategy gives DeepSpeed LOCAL_SIZE only around init_distributed (where the op reads it), never for the
    process's life: both ranks' shm segments exist while they train, and are gone afterwards. Cold: the ranks are
    Lightning's launcher's, as the name says."""
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    port = str(free_port())
    segments = [Path("/dev/shm") / startup.shm_segment_name(r, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                for r in range(2)]
    seen: set[Path] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(p for p in segments if p.exists())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_job([sys.executable, str(JOBS / "train_job.py"), "--out", str(tmp_path), "--no-eval",
                          "--max-steps", "2"], timeout=240, env={"TORCH_EXTENSIONS_DIR": str(built_shm_ext),
                                                                 startup.SHM_MODE_ENV: "on", "MASTER_PORT": port})
    finally:
        done.set()
        watcher.join()
    result.check()
    assert "loaded but unused" not in result.output, result.output[-3000:]
    assert seen == set(segments), f"the shm kernel did not engage on every rank: {sorted(map(str, seen))}"
    assert not any(p.exists() for p in segments), "DeepSpeed's shm segments leaked"


@pytest.mark.multiprocess
def test_two_ranks_with_a_stale_lock_and_no_compiler_train_on_gloo(ext_dir: Path, tmp_path: Path) -> None:
    """DeepSpeed alone waits forever on this lock; here both ranks clear it, fail the build fast, fall back."""
    _plant(ext_dir)
    result = run_job([sys.executable, str(JOBS / "train_job.py"), "--out", str(tmp_path), "--no-eval",
                      "--max-steps", "2"], timeout=240, env={"TORCH_EXTENSIONS_DIR": str(ext_dir), **FALLBACK_ENV},
                     ranks=2)
    result.check()
    assert "removed a stale DeepSpeed build lock" in result.output
    assert "built successfully" not in result.output
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


@pytest.mark.multiprocess
def test_op_unavailable_falls_back_and_says_so_once(ext_dir: Path, tmp_path: Path) -> None:
    result = run_job([sys.executable, str(JOBS / "train_job.py"), "--out", str(tmp_path), "--no-eval",
                      "--max-steps", "2"], timeout=240, env={"TORCH_EXTENSIONS_DIR": str(ext_dir), **FALLBACK_ENV},
                     ranks=2)
    result.check()
    assert result.output.count("shared-memory comm op is not used (its build failed") == 1, result.output[-3000:]
    assert "built successfully" not in result.output
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


# ------------------------------------------------------------------------------------------ report
def test_env_report_names_ops_and_a_stale_lock(ext_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_gaudi_ds import report

    lock = _plant(ext_dir)
    (ext_dir / build.CPU_ADAM).mkdir()
    (ext_dir / build.CPU_ADAM / f"{build.CPU_ADAM}.so").write_bytes(b"")
    info = report.collect()
    assert info["device"] == "cpu" and info["backend"] == "gloo"
    assert {"torch", "lightning", "deepspeed", "habana_frameworks"} <= set(info["versions"])
    assert info["ops"][build.SHM_COMM]["state"] == "not built"
    assert info["ops"][build.CPU_ADAM] == {"state": "built", "path": str(ext_dir / build.CPU_ADAM / "cpu_adam.so"),
                                         "purpose": build.OPS[build.CPU_ADAM].purpose}
    text = report.render(info)
    assert f"STALE   {lock}" in text and locks.FIX_COMMAND in text and build.BUILD_COMMAND in text

    parser = __import__("argparse").ArgumentParser()
    report.add_arguments(parser)
    assert report.run(parser.parse_args(["--clear-stale-locks"])) == 0
    assert not lock.exists()
    assert "removed a stale" in capsys.readouterr().out


def test_env_report_says_whether_deepspeed_is_habanas_fork() -> None:
    from lightning_gaudi_ds import report

    assert report.habana_fork_release("0.16.1+hpu.synapse.v1.21.0") == "1.21.0"
    assert report.habana_fork_release("0.16.1+hpu.synapse.v1.20.0") == "1.20.0"
    assert report.habana_fork_release("0.16.1") is None and report.habana_fork_release(None) is None
    info = report.collect()
    assert info["versions"]["habana_deepspeed_fork"] == report.habana_fork_release(info["versions"]["deepspeed"])
    line = next(x for x in report.render(info).splitlines() if x.startswith("deepspeed "))
    fork = info["versions"]["habana_deepspeed_fork"]
    assert line.endswith(f"(Habana's fork, release {fork})" if fork else "(upstream)")


@pytest.mark.multiprocess
def test_prebuild_without_a_compiler_fails_clearly(ext_dir: Path) -> None:
    result = run_job([sys.executable, "-m", "lightning_gaudi_ds", "env", "--build-ops", build.SHM_COMM], timeout=300,
                     env={"TORCH_EXTENSIONS_DIR": str(ext_dir), "CXX": "/bin/false"}, warm=True)
    assert not result.timed_out and result.returncode == 1, result.output[-3000:]
    assert f"{build.SHM_COMM}   FAILED" in result.output and "/bin/false" in result.output  # torch's reason
    assert not (ext_dir / build.SHM_COMM / "lock").exists()
