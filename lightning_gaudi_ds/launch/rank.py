"""Per-rank shim that :class:`~lightning_gaudi_ds.launch.DistributedRunner` puts between a launcher and the script.

``python path/to/launch/rank.py script.py args...`` (or ``-m module args...``; run by path so that no rank imports
the package once more; ``python -m lightning_gaudi_ds.launch.rank`` works too) runs the script as a child, copies
its output to this process's stdout and to ``<run dir>/rank<R>.log``, and records what happened to it in
``<run dir>/rank<R>.json`` ("pid", "child_pid", "host", "clock_offset"; "failed_at" when the script's latest burst
of tracebacks began; then "returncode" and "ended_at"), so the runner learns which rank failed first and how,
whatever launcher sits in between. SIGTERM/SIGINT/SIGHUP are passed on to the script, and SIGKILL follows
``LIGHTNING_GAUDI_DS_STOP_TIMEOUT`` s later; the script gets SIGKILL if this shim dies. Without
``LIGHTNING_GAUDI_DS_RUN_DIR`` it becomes the script (the variables: :mod:`~lightning_gaudi_ds.launch.envvars`).
``rank.py --lgds-args-file F`` reads the script and its arguments from the JSON list in ``F`` (launches across
hosts: no remote shell parses them). A rank that Lightning's MPI probe makes an isolated Open MPI singleton gets a
session directory of its own (:func:`own_mpi_session_base`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__:
    from lightning_gaudi_ds.launch import envvars
    from lightning_gaudi_ds.launch._proc import (
        ARGS_FILE_FLAG,
        FAILING_WINDOW_S,
        HEARTBEAT_NAME,
        MPI_RANK_KEYS,
        exit_code,
        say,
        signal_when_parent_dies,
    )
else:  # run by path, as the launchers do: the sibling modules, without importing the package
    import envvars  # type: ignore[no-redef,import-not-found]
    from _proc import (  # type: ignore[no-redef,import-not-found]
        ARGS_FILE_FLAG,
        FAILING_WINDOW_S,
        HEARTBEAT_NAME,
        MPI_RANK_KEYS,
        exit_code,
        say,
        signal_when_parent_dies,
    )

__all__ = ["ARGS_FILE_FLAG", "global_rank_from_env", "main", "own_mpi_session_base", "python_command"]
# Global rank as each launcher announces it; the first one present wins.
_RANK_KEYS = ("RANK", *MPI_RANK_KEYS)


def global_rank_from_env() -> int:
    for key in _RANK_KEYS:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def python_command(argv: list[str]) -> list[str]:
    """``script.py args`` -> ``python -u script.py args``; ``-m module args`` -> ``python -u -m module args``.

    Under mpirun the script runs through ``python -m mpi4py``, which calls MPI_Abort on an uncaught exception.
    Otherwise the failed rank blocks in MPI_Finalize at exit (waiting for its peers) while keeping its gloo
    connections open, and the peers block in their next collective: a job that never ends.
    """
    if not argv:
        raise SystemExit("usage: python rank.py (script.py | -m module) [args...]")
    under_mpi = any(key in os.environ for key in MPI_RANK_KEYS)
    if under_mpi and importlib.util.find_spec("mpi4py") is not None:
        return [sys.executable, "-u", "-m", "mpi4py", *argv]
    return [sys.executable, "-u", *argv]


OMPI_SESSION_BASE = "OMPI_MCA_orte_tmpdir_base"


def own_mpi_session_base(env: dict[str, str]) -> str | None:
    """Give a rank its own Open MPI session directory where the launcher asked for isolated singletons; returns it.

    With mpi4py installed, Lightning's MPI probe initialises MPI in every rank. Outside mpirun each rank is then a
    singleton, isolated (``OMPI_MCA_ess_singleton_isolated=1``, no daemon), and every isolated singleton on a host has
    the same job id, so the same session directory. One that ends removes the tree while another is creating it, and
    the second's ``MPI_Init`` aborts (``mkdir <tmp>/ompi.<host>.<uid>/jf.0/1: No such file or directory``): a rank lost
    at start-up whenever two runs share a host. A fresh directory inside the configured base (``env``'s
    ``OMPI_MCA_orte_tmpdir_base``, else the system's temporary directory) keeps ranks apart; ``env`` is updated.
    """
    if env.get("OMPI_MCA_ess_singleton_isolated") != "1" or any(key in env for key in MPI_RANK_KEYS):
        return None
    try:
        base = tempfile.mkdtemp(prefix="lgds-ompi-", dir=env.get(OMPI_SESSION_BASE) or None)
    except OSError:  # a base that cannot be written to: Open MPI reports it, as it would without this shim
        return None
    env[OMPI_SESSION_BASE] = base
    return base


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # the runner never reads a half-written record


# The first line Python (and mpi4py) writes for an uncaught exception; the time it shows is when the rank began to
# fail. A rank that raises still runs its exit handlers (which may end its process groups, so that its peers fail
# too) before it exits: the order of exits alone can name a peer instead of the rank that raised.
TRACEBACK = b"Traceback (most recent call last):"


def _pump(src: int, log: Any, on_traceback: Any = None) -> None:
    """Copy the script's output to the log and to stdout; call ``on_traceback()`` at each traceback header."""
    out = sys.stdout.buffer
    tail = b""  # the end of what came before: a header split between reads is still seen
    while True:
        try:
            chunk = os.read(src, 65536)
        except OSError:
            break
        if not chunk:
            break
        if on_traceback is not None and TRACEBACK in tail + chunk:
            on_traceback()
        tail = (tail + chunk)[1 - len(TRACEBACK):]
        try:
            log.write(chunk)
            log.flush()
        except (OSError, ValueError):  # the log was closed: the script has exited
            break
        try:
            out.write(chunk)
            out.flush()
        except (OSError, ValueError):  # the launcher stopped reading: keep the log going
            pass


def _watch_supervisor(path: Path, timeout: float, stop: Any) -> None:
    """A launch across hosts: call ``stop`` once the supervisor's heartbeat file is gone (it has ended) or has not
    changed for ``timeout`` s (its host or the link to it is lost; a read that hangs, as on a lost NFS server,
    counts as no change). Times are this host's own, so clocks need not agree."""
    seen, beat, gone = time.monotonic(), "", False

    def read() -> None:
        nonlocal seen, beat, gone
        while True:
            try:
                now = path.read_text()
            except FileNotFoundError:
                gone = True
                return
            except OSError:
                now = beat
            if now != beat:
                beat, seen = now, time.monotonic()
            time.sleep(1.0)

    def check() -> None:
        while not gone and time.monotonic() - seen < timeout:
            time.sleep(0.5)
        sys.stderr.write(f"lightning-gaudi-ds: rank {global_rank_from_env()} on {socket.gethostname()}: the"
                         f" supervisor {'has ended' if gone else f'is silent for {timeout:g} s'}: stopping\n")
        stop()

    for target in (read, check):
        threading.Thread(target=target, daemon=True).start()


def _own_group_dying_with_parent() -> None:
    # preexec_fn (between fork and exec): signals reach the script through this shim only, once (torchrun signals
    # the shim's process group), and the script dies with the shim. Python 3.10 has no Popen(process_group=).
    os.setpgid(0, 0)
    signal_when_parent_dies(signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv[:1] == [ARGS_FILE_FLAG] and len(argv) == 2:
        # A launch across hosts: the script and its arguments come byte for byte from a file on the shared run
        # directory, never through the remote shell that pdsh/ssh hands the command line to.
        argv = json.loads(Path(argv[1]).read_text())
    command = python_command(argv)
    try:  # the runner checked them; a rank started otherwise is told, and its script does not start
        run_dir, grace, link = (envvars.read(var) for var in (envvars.RUN_DIR, envvars.STOP_TIMEOUT,
                                                                 envvars.LINK_TIMEOUT))
    except envvars.EnvVarError as err:
        say(f"rank {global_rank_from_env()}: error: {err}")
        return 2
    if not run_dir:
        os.execv(command[0], command)
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    rank = global_rank_from_env()
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    session_base = own_mpi_session_base(env)
    try:
        return _run_rank(command, env, directory, rank, grace, link)
    finally:
        if session_base is not None:
            shutil.rmtree(session_base, ignore_errors=True)


def _run_rank(command: list[str], env: dict[str, str], directory: Path, rank: int, grace: float,
              link: float | None) -> int:
    record_path = directory / f"rank{rank}.json"
    read_fd, write_fd = os.pipe()
    with open(directory / f"rank{rank}.log", "ab") as log:
        child = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd,
            preexec_fn=_own_group_dying_with_parent, close_fds=True,
        )
        os.close(write_fd)
        record: dict[str, Any] = {
            "rank": rank, "pid": os.getpid(), "child_pid": child.pid, "host": socket.gethostname(),
            "local_rank": os.environ.get("LOCAL_RANK"), "command": command,
        }
        lock = threading.Lock()  # the pump's thread writes the record too
        _write_json(record_path, record)
        # This host's clock against the run directory's (a shared file system's server): the supervisor compares
        # times that ranks on several hosts record.
        record["clock_offset"] = record_path.stat().st_mtime - time.time()
        last_traceback = [-FAILING_WINDOW_S]

        def traceback_seen() -> None:
            now = time.time()
            if now - last_traceback[0] > FAILING_WINDOW_S:  # a new burst: its first header is when it began
                with lock:
                    record["failed_at"] = now
                    _write_json(record_path, record)
            last_traceback[0] = now

        escalation: list[threading.Timer] = []

        forwarded: set[int] = set()

        def forward(signum: int, frame: Any) -> None:
            # Pass the signal on, once: the supervisor and the launcher may both send it, and a second SIGTERM
            # would run Lightning's handler (which broadcasts to every rank) once more on this rank only. A script
            # that ignores it (Lightning only takes note of SIGTERM) gets SIGKILL after the grace period, so the
            # rank ends even when nobody is left to escalate (runner killed).
            if child.poll() is None and signum not in forwarded:
                forwarded.add(signum)
                child.send_signal(signum)
                if not escalation:
                    escalation.append(threading.Timer(grace, child.kill))
                    escalation[0].daemon = True
                    escalation[0].start()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)

        def supervisor_lost() -> None:
            forward(signal.SIGTERM, None)
            _end_orphaned_daemon()

        if link is not None:
            _watch_supervisor(directory / HEARTBEAT_NAME, link, supervisor_lost)
        pump = threading.Thread(target=_pump, args=(read_fd, log, traceback_seen), daemon=True)
        pump.start()
        returncode = child.wait()
        # Processes the script started (Lightning's own launcher) may hold the pipe open: do not wait on them.
        ended = time.time()
        pump.join(timeout=2.0)
    with lock:
        record.update(returncode=returncode, ended_at=ended)
        _write_json(record_path, record)
    return exit_code(returncode)


def _end_orphaned_daemon() -> None:
    """The supervisor is lost: end the Open MPI daemon (``orted``) that started this rank, if one did. Behind a lost
    link it cannot reach mpirun, and would wait a minute or more on TCP before ending by itself; on SIGTERM it stops
    its ranks (this shim passes the signal on) and exits."""
    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:  # not Linux, or the parent is gone
        return
    if name == "orted":
        try:
            os.kill(parent, signal.SIGTERM)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
