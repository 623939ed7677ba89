"""Run a launch plan and own what it starts: watch the ranks, stop the job, say how it ended.

The launcher runs in a session of its own and gets SIGTERM if the supervisor dies; every rank runs under the
rank shim (:mod:`~lightning_gaudi_ds.launch.rank`), which keeps its output in ``<run dir>/rank<R>.log`` and
records its exit status in ``rank<R>.json``. When one rank fails (non-zero exit, or killed) every process of the
job is stopped (SIGTERM, then SIGKILL after ``stop_timeout`` s), and the failed rank is named with its last lines.
SIGINT/SIGTERM/SIGHUP to the supervisor stop the job the same way. Processes are found by the job's token in
their environment, so ranks that a launcher moved to their own session are stopped too.
"""

from __future__ import annotations

import codecs
import functools
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import psutil

from lightning_gaudi_ds.launch._proc import (
    FAILING_WINDOW_S,
    HEARTBEAT_NAME,
    PREEMPTED_EXIT,
    describe_exit,
    exit_code,
    say,
    signal_when_parent_dies,
)
from lightning_gaudi_ds.launch.hostfile import Host
from lightning_gaudi_ds.launch.plan import RUN_ID_ENV, SHIM

# How a rank is described that raised and was then ended by a signal (its launcher stopping the job) while exiting.
_ENDED_WHILE_EXITING = "raised (see its log), then was ended while exiting"
# The signals with which launchers (and this supervisor) end ranks.
_STOPPING_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL}


@dataclass
class Failure:
    """The first thing that went wrong: the rank (None: the job as a whole), its exit code, how, its log, and the
    hosts whose ranks it lost (a failed rank's host, or the hosts the launcher lost)."""

    rank: int | None
    returncode: int
    how: str
    log: Path | None
    hosts: tuple[str, ...] = ()
    at: float = -math.inf  # when its rank's traceback showed (-inf: it showed none)
    ended_by_signal: bool = False  # it raised, then a signal (its launcher stopping the job) ended it while exiting


@dataclass
class Stopped:
    """What stopping the job took: the processes found, the seconds, and how many needed SIGKILL."""

    pids: list[int]
    seconds: float = 0.0
    killed: int = 0


class Supervisor:
    """Runs one job to its end and reports it; ``run()`` returns the job's exit code.

    Args:
        stop_timeout: seconds between SIGTERM and SIGKILL when stopping the job.
        timeout: stop the job after this many seconds (exit code 124); None waits forever.
        tail_lines: lines of a failed rank's output to print.
        hosts: the hostfile's hosts, in rank order: which ranks a host that is lost had.
        no_rank_hint: said when the launcher fails before any rank started (torchrun's rendezvous timed out).
    """

    def __init__(self, stop_timeout: float = 10.0, timeout: float | None = None, tail_lines: int = 20,
                 hosts: Sequence[Host] | None = None, no_rank_hint: str = "") -> None:
        self.stop_timeout = stop_timeout
        self.no_rank_hint = no_rank_hint
        self.hosts = list(hosts) if hosts is not None else None
        self.timeout = timeout
        self.tail_lines = tail_lines
        self._stop_signal: int | None = None
        self.failure: Failure | None = None  # after run(): what ended the job, if it did not succeed
        self.signalled = False  # after run(): the supervisor itself was asked to stop (SIGINT/SIGTERM/SIGHUP)
        self.ended_at = 0.0  # after run(): time.monotonic() when the end (or the failure) was seen

    def run(self, argv: Sequence[str], env: dict[str, str], run_dir: Path, token: str, keep_logs: bool) -> int:
        """Start ``argv`` (the launcher) and supervise it until every process of the job has ended.

        Returns 0, the failed rank's exit code (128+N for signal N), 124 on time-out, or 128+N for signal N to the
        supervisor. ``run_dir`` is removed after success unless ``keep_logs``.
        """
        start = time.monotonic()
        with _SignalTrap(self):
            launcher = subprocess.Popen(
                list(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,
                # preexec_fn is unsafe once other threads exist, and the kernel sends the parent-death signal when
                # the forking thread (not the process) ends: ask for it only while this is the only thread.
                preexec_fn=(functools.partial(signal_when_parent_dies, signal.SIGTERM)
                            if threading.active_count() == 1 else None),
            )
            relay = _Relay(launcher.stdout, run_dir / "launcher.log")
            heartbeat = _Heartbeat(run_dir / HEARTBEAT_NAME)
            failure, code = None, 1
            try:
                failure, code = self._watch(launcher, run_dir, start, relay)
            finally:
                self.ended_at = time.monotonic()
                stopped = self._stop(launcher, token, clean_exit=failure is None and code == 0)
                heartbeat.stop()  # ranks on other hosts stop by themselves once it is gone
                relay.join()
        elapsed = time.monotonic() - start
        self.failure, self.signalled = failure, self._stop_signal is not None
        if failure is not None:
            self._report(failure, stopped, elapsed)
            code = failure.returncode
        elif code != 0:
            self._say_stopped(stopped)
            if self._stop_signal is not None and _all_preempted(run_dir):
                say(f"every rank saved a checkpoint and exited with {PREEMPTED_EXIT} (preempted).")
                code = PREEMPTED_EXIT
        elif stopped.pids:
            say(f"{len(stopped.pids)} process(es) of the job outlived the launcher and were stopped: {stopped.pids}")
        if code == 0 and not keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif code != 0 and keep_logs:
            say(f"per-rank logs: {run_dir}")
        return code

    def _watch(self, launcher: subprocess.Popen, run_dir: Path, start: float,
               relay: _Relay) -> tuple[Failure | None, int]:
        ranks = _RankTable(run_dir)
        while True:
            lost = self._lost_host(ranks, relay, run_dir)
            if lost is not None:
                return lost, lost.returncode
            if self._stop_signal is not None:
                sig = self._stop_signal
                say(f"received {signal.Signals(sig).name}: stopping every rank.")
                return None, 128 + sig
            failure = ranks.first_failure()
            if failure is not None:
                failure = self._settle(ranks, failure)
                if (failure.returncode == 128 + signal.SIGTERM or failure.ended_by_signal) and self.hosts is not None:
                    # Stopped, not the cause: mpirun ends its ranks so when it loses a host. Let it say so first.
                    try:
                        launcher.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    relay.join(timeout=2)
                    failure = self._lost_host(ranks, relay, run_dir) or failure
                return failure, failure.returncode
            code = launcher.poll()
            if code is not None:
                failure = ranks.first_failure()  # the shims wrote their records before exiting
                if failure is None and code != 0:
                    hint = "" if ranks.records() or not self.no_rank_hint else f"; {self.no_rank_hint}"
                    failure = Failure(None, exit_code(code), f"the launcher exited with {describe_exit(code)}"
                                      f"{ranks.silent_hosts(self.hosts)}{hint}", run_dir / "launcher.log",
                                      tuple(ranks.silent_host_names(self.hosts) if self.hosts else ()))
                return failure, 0 if failure is None else failure.returncode
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                return Failure(None, 124, f"the job ran past timeout={self.timeout:g} s", None), 124
            time.sleep(0.1)

    def _settle(self, ranks: _RankTable, failure: Failure) -> Failure:
        """A rank that raised before ``failure`` may still be in its exit handlers, which can end its process groups
        and make its peers fail first: give it up to ``min(stop_timeout, 10)`` s to record its exit, and name the
        one that began first (still exiting, if it has not ended by then)."""
        deadline = time.monotonic() + min(self.stop_timeout, 10.0)
        while (waiting := ranks.raising(failure.at)) and self._stop_signal is None:
            if time.monotonic() > deadline:
                when, rank = waiting[0]
                record = ranks.records().get(rank, {})
                return Failure(rank, 1, f"raised (see its log), and was still exiting {min(self.stop_timeout, 10.0):g}"
                               f" s after rank {failure.rank} failed ({record.get('host', '?')})",
                               ranks.run_dir / f"rank{rank}.log", (str(record.get("host", "")),), when)
            time.sleep(0.1)
            failure = ranks.first_failure() or failure
        return failure

    def _lost_host(self, ranks: _RankTable, relay: _Relay, run_dir: Path) -> Failure | None:
        """A host the launcher lost: named by pdsh, or (mpirun, which does not name it) the other hosts whose ranks
        gave no exit status."""
        if relay.lost:
            names = relay.lost
        elif relay.daemon_lost:
            names = ranks.silent_host_names(self.hosts)
        else:
            return None
        return Failure(None, LOST_HOST_EXIT, f"{ranks.describe_hosts(self.hosts, names)} unreachable: its ssh"
                       " session ended (no answer to ssh keepalives within link_timeout, or no connection)",
                       run_dir / "launcher.log", tuple(names))

    def _stop(self, launcher: subprocess.Popen, token: str, clean_exit: bool) -> Stopped:
        """End every process of the job: SIGTERM, then SIGKILL after ``stop_timeout`` s.

        The ranks go first; the launcher gets a moment to notice and exit by itself (mpirun can crash when
        signalled while its ranks exit) before it is signalled too; when the supervisor itself was signalled (a
        preemption: the ranks save, then exit) that moment is all of ``stop_timeout``, as a launcher passes the
        signal on once more (torchrun to each rank's process group) and would end a rank exiting after its save.
        After a clean exit, leftovers first get ``stop_timeout`` s to finish on their own.
        """
        if clean_exit:
            deadline = time.monotonic() + self.stop_timeout
            while _job_processes(launcher, token) and time.monotonic() < deadline:
                time.sleep(0.2)
        start = time.monotonic()
        procs = _job_processes(launcher, token)
        for p in procs:
            if p.pid != launcher.pid and not _under_shim(p):  # a rank shim passes the signal on to its script
                _signal(p, signal.SIGTERM)
        moment = self.stop_timeout if self._stop_signal is not None else min(2.0, self.stop_timeout)
        _, alive = psutil.wait_procs(procs, timeout=moment)
        for p in alive:
            if p.pid == launcher.pid:
                _signal(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(alive, timeout=max(0.0, self.stop_timeout - (time.monotonic() - start)))
        alive += [p for p in _job_processes(launcher, token) if p not in alive]  # started during the wait
        for p in alive:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        launcher.wait()
        return Stopped(sorted(p.pid for p in procs), time.monotonic() - start, len(alive))

    def _report(self, failure: Failure, stopped: Stopped, elapsed: float) -> None:
        who = f"rank {failure.rank}" if failure.rank is not None else "the job"
        say(f"{who} failed: {failure.how} (after {elapsed:.1f} s).")
        if failure.log is not None and failure.log.exists():
            lines = _tail(failure.log, self.tail_lines)
            say(f"last {len(lines)} lines of {who} ({failure.log}):")
            sys.stderr.write("".join(f"  | {line}\n" for line in lines))
        self._say_stopped(stopped)

    def _say_stopped(self, stopped: Stopped) -> None:
        if stopped.pids:
            say(f"stopped {len(stopped.pids)} process(es) of the job in {stopped.seconds:.1f} s"
                f" ({stopped.killed} needed SIGKILL after {self.stop_timeout:g} s).")


class _RankTable:
    """What the shims recorded under the run directory, and whether each rank is still alive."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[int, psutil.Process | None] = {}
        self.vanished: dict[int, float] = {}  # a local rank whose process is gone unrecorded: when first seen so
        self.host = socket.gethostname()

    def records(self) -> dict[int, dict[str, Any]]:
        found = {}
        for path in self.run_dir.glob("rank*.json"):
            try:
                record = json.loads(path.read_text())
                found[int(record["rank"])] = record
            except (OSError, ValueError, KeyError):
                continue
        return found

    @staticmethod
    def describe_hosts(hosts: Sequence[Host] | None, names: Sequence[str]) -> str:
        """``host n1 (rank 1)``, ``host n1 (ranks 2-3)``, for the hostfile's ``names``."""
        first, described = 0, []
        for host in hosts or []:
            ranks = range(first, first + host.slots)
            first += host.slots
            if host.name in names:
                span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
                described.append(f"host {host.name} ({span})")
        return ", ".join(described) or ", ".join(f"host {name}" for name in names)

    def silent_host_names(self, hosts: Sequence[Host] | None) -> list[str]:
        """The other hosts of ``hosts`` with a rank that never recorded an exit status."""
        records, first, lost = self.records(), 0, []
        for host in hosts or []:
            ranks = range(first, first + host.slots)
            first += host.slots
            if host.name in (self.host, socket.getfqdn()):
                continue  # this host's ranks: the supervisor sees them itself
            if any("returncode" not in records.get(r, {}) for r in ranks):
                lost.append(host.name)
        return lost

    def silent_hosts(self, hosts: Sequence[Host] | None) -> str:
        """``; host n1 (ranks 2-3) gave no exit status ...`` for the other hosts whose ranks never reported an exit."""
        lost = self.silent_host_names(hosts) if hosts and len(hosts) > 1 else []
        if not lost:
            return ""
        return (f"; {self.describe_hosts(hosts, lost)} gave no exit status: unreachable (a lost node or link) or"
                " killed")

    @staticmethod
    def _raised_at(record: dict[str, Any], until: float) -> float | None:
        """When the rank's last burst of tracebacks began, on its own clock, if it ended (or is still exiting, at
        ``until``) within ``FAILING_WINDOW_S`` of it; None otherwise (no traceback, or one it survived)."""
        raised = record.get("failed_at")
        if isinstance(raised, (int, float)) and until - float(raised) <= FAILING_WINDOW_S:
            return float(raised)
        return None

    @staticmethod
    def _offset(record: dict[str, Any]) -> float:
        """The rank's host clock against the run directory's (see the shim), so that hosts' times compare."""
        offset = record.get("clock_offset", 0.0)
        return float(offset) if isinstance(offset, (int, float)) else 0.0

    def _local(self, rank: int, record: dict[str, Any]) -> psutil.Process | None:
        if rank not in self.procs:
            try:
                self.procs[rank] = psutil.Process(int(record["pid"]))
            except psutil.NoSuchProcess:
                self.procs[rank] = None
        return self.procs[rank]

    def raising(self, before: float) -> list[tuple[float, int]]:
        """(when, rank) of the ranks whose traceback came before ``before`` and that have not recorded their exit
        yet (a local one only while its shim lives), first first."""
        found = []
        for rank, record in self.records().items():
            if "returncode" in record:
                continue
            offset = self._offset(record)
            raised = self._raised_at(record, time.time() - offset)
            if raised is None or raised + offset >= before:
                continue
            if record.get("host") != self.host or _alive(self._local(rank, record)):
                found.append((raised + offset, rank))
        return sorted(found)

    def first_failure(self) -> Failure | None:
        """The rank that failed first. The first to exit (or, a local one, to vanish) unless it raised: then a rank
        that raised before it, still exiting or not, is the cause (its exit handlers end its process groups, so its
        peers can fail and exit first). Exit times and traceback times are not compared with each other: a rank
        killed from outside is reaped some time after its peers see its connections close."""
        failures: list[tuple[float, Failure]] = []  # (exit time, failure); failure.at: its traceback's time
        for path in self.run_dir.glob("rank*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            rank = int(record["rank"])
            log = self.run_dir / f"rank{rank}.log"
            offset = self._offset(record)
            if "returncode" in record:
                code = int(record["returncode"])
                if code != 0:
                    ended = record.get("ended_at")
                    ended = float(ended) if isinstance(ended, (int, float)) else path.stat().st_mtime - offset
                    raised = self._raised_at(record, ended)
                    how = f"exited with {describe_exit(code)} (pid {record['child_pid']} on {record['host']})"
                    ended_by_signal = raised is not None and -code in _STOPPING_SIGNALS
                    if ended_by_signal:
                        # It raised, and a launcher ended it while it ran its exit handlers: Python's exit code
                        # for an uncaught exception, not the signal's, says what happened.
                        code, how = 1, f"{_ENDED_WHILE_EXITING}: {how}"
                    at = -math.inf if raised is None else raised + offset
                    failures.append((ended + offset, Failure(rank, exit_code(code), how, log, (str(record["host"]),),
                                                             at, ended_by_signal)))
                continue
            if record.get("host") != self.host:
                continue  # another host's process: its shim records its exit, or the launcher reports the host
            proc = self._local(rank, record)
            if not _alive(proc) and "returncode" not in json.loads(path.read_text()):
                first_seen = self.vanished.setdefault(rank, time.time())
                raised = self._raised_at(record, first_seen - offset)
                failures.append((first_seen, Failure(rank, 128 + signal.SIGKILL,
                                 f"{'it raised (see its log), then ' if raised is not None else ''}its process (pid"
                                 f" {record['pid']}) vanished without an exit status: killed", log, (self.host,),
                                 -math.inf if raised is None else raised + offset)))
        if not failures:
            return None
        first = min(failures, key=lambda item: item[0])[1]
        earlier = [f for _, f in failures if first.at > f.at > -math.inf]  # exited ranks that raised before it
        return min(earlier, key=lambda f: f.at) if earlier else first


def _all_preempted(run_dir: Path) -> bool:
    """Whether every rank recorded the preemption exit code (it saved a checkpoint after SIGTERM)."""
    records = _RankTable(run_dir).records().values()
    return bool(records) and all(record.get("returncode") == PREEMPTED_EXIT for record in records)


def _under_shim(proc: psutil.Process) -> bool:
    """Whether ``proc`` is the script of a live rank shim, which forwards signals to it (once each)."""
    try:
        parent = proc.parent()
        return parent is not None and _is_shim(parent.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _is_shim(cmdline: Sequence[str]) -> bool:
    """Whether this command line is a rank shim's (``python [-u ...] rank.py script ...``), not a launcher's that
    names the shim as the script it starts (``torchrun ... rank.py``, ``mpirun -np 2 python rank.py``)."""
    if SHIM not in cmdline:
        return False
    before = cmdline[1:cmdline.index(SHIM)]
    return all(arg.startswith("-") and arg not in ("-m", "-c") for arg in before)


def _alive(proc: psutil.Process | None) -> bool:
    try:
        return proc is not None and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _job_processes(launcher: subprocess.Popen, token: str) -> list[psutil.Process]:
    """The launcher, its descendants, and every process carrying the job's token in its environment."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(launcher.pid)
        for p in [root, *root.children(recursive=True)]:
            found[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid in found or p.pid == me:
            continue
        try:
            if p.environ().get(RUN_ID_ENV) == token:
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return [p for p in found.values() if _alive(p) and not (p.pid == launcher.pid and launcher.poll() is not None)]


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def _tail(path: Path, lines: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode("utf-8", errors="replace")
    return [line.rstrip("\r") for line in text.splitlines()[-lines:]]


# pdsh's own line when the ssh session to a host fails: ssh exits 255 when it cannot connect or its keepalives go
# unanswered (ServerAliveInterval x ServerAliveCountMax, set from link_timeout).
_PDSH_LOST = re.compile(rb"^pdsh@[^:]+: ([^:\s]+): ssh exited with exit code 255", re.MULTILINE)
# mpirun's own words when it loses the daemon (orted) of a host; it does not always name the host.
_MPI_LOST = re.compile(rb"(ORTE|PRTE) (was unable to reliably start one or more daemons|has lost communication with"
                       rb" a remote daemon)")
LOST_HOST_EXIT = 255  # the job's exit code when a host is lost (ssh's own code for it)


class _Relay(threading.Thread):
    """Copies the launcher's output to our stdout and to a file, noting the hosts pdsh says it lost."""

    def __init__(self, stream: IO[bytes] | None, path: Path) -> None:
        super().__init__(daemon=True)
        self.stream, self.path = stream, path
        self.lost: list[str] = []
        self.daemon_lost = False
        self._partial = b""
        self.start()

    def run(self) -> None:
        stream = cast(io.BufferedReader, self.stream)  # Popen(stdout=PIPE): read1 returns what has arrived
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with open(self.path, "ab") as log:
            for chunk in iter(lambda: stream.read1(65536), b""):
                lines = self._partial + chunk
                complete, _, self._partial = lines.rpartition(b"\n")
                self.lost += [m.decode(errors="replace") for m in _PDSH_LOST.findall(complete)]
                self.daemon_lost = self.daemon_lost or _MPI_LOST.search(complete) is not None
                self._partial = self._partial[-4096:]
                log.write(chunk)
                log.flush()
                try:
                    sys.stdout.write(decoder.decode(chunk))
                    sys.stdout.flush()
                except (OSError, ValueError):
                    pass

    def join(self, timeout: float | None = 5.0) -> None:
        super().join(timeout)


class _Heartbeat(threading.Thread):
    """A counter in the run directory, rewritten every second while the job is supervised. A rank on another host
    stops its script when the file is gone (the supervisor has ended) or unchanged for the link timeout (a lost
    link, or the supervisor's host is down): see the rank shim."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.done = path, threading.Event()
        self._beat(0)
        self.start()

    def _beat(self, count: int) -> None:
        try:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(str(count))
            os.replace(tmp, self.path)
        except OSError:
            pass

    def run(self) -> None:
        count = 0
        while not self.done.wait(1.0):
            count += 1
            self._beat(count)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)
        self.path.unlink(missing_ok=True)


class _SignalTrap:
    """While a job runs (main thread only): SIGINT/SIGTERM/SIGHUP ask the supervisor to stop it instead of dying."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalTrap:
        self.supervisor._stop_signal = None
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.supervisor._stop_signal = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
