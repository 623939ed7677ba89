"""Launch a training script on N ranks: torchrun, DeepSpeed's launcher, mpirun, or plain python for one.

``lightning-gaudi-ds spawn --world_size 2 --use_deepspeed train.py --lr 0.1`` or, from code,
``DistributedRunner(["train.py --lr 0.1"], world_size=2, use_deepspeed=True).run()``.

The runner owns what it starts. The launcher runs in a session of its own and gets SIGTERM if the runner
dies; every rank runs under a small shim (:mod:`lightning_gaudi_ds._rank`) that keeps its output in
``<log dir>/rank<R>.log`` and records its exit status. When one rank fails (non-zero exit, or killed) the
runner stops every process of the job (SIGTERM, then SIGKILL after ``stop_timeout`` s), names the rank and
prints its last lines. SIGINT/SIGTERM to the runner stop the job the same way. Processes are found by a
token in their environment, so ranks that a launcher moved to their own session are stopped too.
"""

from __future__ import annotations

import argparse
import codecs
import ctypes
import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional, Sequence, Union

import psutil

from lightning_gaudi_ds._rank import RUN_DIR_ENV, STOP_TIMEOUT_ENV

RUN_ID_ENV = "LIGHTNING_GAUDI_DS_RUN_ID"
# Run by path, not with -m: importing the package would import lightning and deepspeed once more per rank.
_SHIM = [str(Path(__file__).resolve().with_name("_rank.py"))]
_PREFIX = "lightning-gaudi-ds:"

__all__ = ["DistributedRunner", "Host", "HostfileError", "parse_hostfile", "parse_hostfile_text"]


# ---------------------------------------------------------------------------------------------- hostfile
class HostfileError(ValueError):
    """A hostfile line that DeepSpeed's and Open MPI's runners would refuse or misread."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[Host]:
    """Parse DeepSpeed's hostfile format: one ``hostname slots=N`` per line; ``#`` starts a comment line."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    fix = "Each line must read `hostname slots=N` with N >= 1 (e.g. `worker-1 slots=8`); `#` starts a comment line."
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}: {line!r}"
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise HostfileError(f"{where} is not a host entry. {fix}")
        name, value = fields[0], fields[1][len("slots="):]
        if not value.lstrip("-").isdigit():
            raise HostfileError(f"{where}: slots={value!r} is not a whole number. {fix}")
        slots = int(value)
        if slots < 1:
            raise HostfileError(f"{where}: slots={slots}; a host needs at least 1 slot. Give it slots=1 or more,"
                                " or remove the line.")
        if name in seen:
            raise HostfileError(f"{where}: host {name!r} is listed again (first on line {seen[name]}). List each"
                                " host once, with its total slots.")
        seen[name] = number
        hosts.append(Host(name, slots, number))
    if not hosts:
        raise HostfileError(f"{source} lists no hosts. {fix}")
    return hosts


def parse_hostfile(path: Union[str, os.PathLike]) -> list[Host]:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise HostfileError(f"cannot read hostfile {str(path)!r}: {err.strerror}. Pass an existing file.") from err
    return parse_hostfile_text(text, source=str(path))


# ------------------------------------------------------------------------------------------------ ports
def port_in_use(port: int, address: str = "") -> Optional[bool]:
    """True if ``port`` is taken on this host, False if free, None if ``address`` is not one of this host's."""
    families = [(socket.AF_INET, address or "0.0.0.0")]
    if not address and socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT does not count
                s.bind((host, port))
        except socket.gaierror:
            return None
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return True
            if err.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                if family == socket.AF_INET:
                    return None
                continue
            raise
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------- runner
@dataclass
class _Failure:
    rank: Optional[int]
    returncode: int
    how: str
    log: Optional[Path]


@dataclass
class _Stopped:
    pids: list[int]
    seconds: float = 0.0
    killed: int = 0


class DistributedRunner:
    """Run each command of ``command_list`` on ``world_size`` ranks; ``run()`` returns the first non-zero exit code.

    Args:
        command_list: commands, each ``"script.py args..."`` (or ``"-m module args..."``); split with shlex,
            never run through a shell; run one after another, stopping at the first failure.
        world_size: ranks in all. 1 runs plain python (Lightning's own launcher may still start ``devices``
            processes). With a hostfile: 1 or the sum of its slots.
        hostfile: DeepSpeed's format (``host slots=N``); needs ``use_deepspeed`` or ``use_mpi``, or ``node_rank``.
        use_mpi: launch with Open MPI's ``mpirun``.
        use_deepspeed: launch with DeepSpeed's launcher (``--no_local_rank``: scripts read ``LOCAL_RANK``).
            Neither: torchrun (``python -m torch.distributed.run``).
        master_port: rendezvous port; 0 picks a free one. When this runner tells every rank the port and it is
            taken on this host, a free port is used instead (and printed).
        master_addr: rendezvous address; default 127.0.0.1, or the first host of the hostfile.
        node_rank: start only this node's ranks of a hostfile job (torchrun ``--node_rank``, DeepSpeed
            ``--no_ssh --node_rank``): run the same command on every node with its own node_rank.
        log_dir: keep per-rank logs in a new subdirectory of this per run and command; default a temporary
            directory, removed after success.
        stop_timeout: seconds between SIGTERM and SIGKILL when stopping the job.
        timeout: stop the job after this many seconds (exit code 124); None waits forever.
        tail_lines: lines of a failed rank's output to print.
    """

    def __init__(
        self,
        command_list: Union[str, Sequence[str]],
        world_size: int = 1,
        hostfile: Optional[Union[str, os.PathLike]] = None,
        use_mpi: bool = False,
        use_deepspeed: bool = False,
        master_port: int = 29500,
        master_addr: Optional[str] = None,
        node_rank: Optional[int] = None,
        log_dir: Optional[Union[str, os.PathLike]] = None,
        stop_timeout: float = 10.0,
        timeout: Optional[float] = None,
        tail_lines: int = 20,
    ) -> None:
        self.command_list = [command_list] if isinstance(command_list, str) else list(command_list)
        self.commands = [self._split(c) for c in self.command_list]
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: pass the number of ranks, a whole number >= 1.")
        if use_mpi and use_deepspeed:
            raise ValueError("use_mpi=True and use_deepspeed=True: pick one launcher (or neither for torchrun).")
        if isinstance(master_port, bool) or not (isinstance(master_port, int) and 0 <= master_port < 65536):
            raise ValueError(f"master_port={master_port!r}: pass a TCP port between 1 and 65535 (0: any free port).")
        self.use_mpi, self.use_deepspeed = use_mpi, use_deepspeed
        self.hostfile = Path(hostfile).resolve() if hostfile is not None else None
        self.hosts = parse_hostfile(self.hostfile) if self.hostfile is not None else None
        self.node_rank = node_rank
        self.world_size = self._resolve_world_size(world_size)
        self.master_addr = master_addr or (self.hosts[0].name if self.hosts and len(self.hosts) > 1 else "127.0.0.1")
        self.master_port = master_port
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.stop_timeout = stop_timeout
        self.timeout = timeout
        self.tail_lines = tail_lines
        self._stop_signal: Optional[int] = None

    @property
    def launcher(self) -> str:
        if self.use_mpi:
            return "mpirun"
        if self.use_deepspeed:
            return "deepspeed"
        return "python" if self.world_size == 1 and self.hosts is None else "torchrun"

    @staticmethod
    def _split(command: str) -> list[str]:
        if not isinstance(command, str):
            raise TypeError(f"command {command!r}: pass each command as one string, e.g. 'train.py --lr 0.1'.")
        argv = shlex.split(command)
        if not argv:
            raise ValueError("an empty command: pass 'script.py args...' or '-m module args...'.")
        if argv[0] == sys.executable or re.fullmatch(r"python[0-9.]*", Path(argv[0]).name):
            argv = argv[1:]  # the launcher supplies the interpreter
        return argv

    def _resolve_world_size(self, world_size: int) -> int:
        if self.hosts is None:
            if self.node_rank is not None:
                raise ValueError(f"node_rank={self.node_rank} needs a hostfile listing every node; pass hostfile=.")
            return world_size
        total = sum(h.slots for h in self.hosts)
        if world_size not in (1, total):
            raise ValueError(
                f"world_size={world_size} but hostfile {self.hostfile} has {total} slots"
                f" ({', '.join(f'{h.name}={h.slots}' for h in self.hosts)}). Pass world_size={total}, or edit the"
                " hostfile's slots to the ranks you want."
            )
        if self.node_rank is not None:
            if not 0 <= self.node_rank < len(self.hosts):
                raise ValueError(f"node_rank={self.node_rank}: the hostfile lists {len(self.hosts)} nodes; pass"
                                 f" 0..{len(self.hosts) - 1}.")
            if self.use_mpi:
                raise ValueError("node_rank with use_mpi: mpirun starts every node itself; drop node_rank.")
            if not self.use_deepspeed and len({h.slots for h in self.hosts}) > 1:
                raise ValueError("torchrun starts the same number of ranks on every node, but the hostfile's slots"
                                 f" differ ({', '.join(f'{h.name}={h.slots}' for h in self.hosts)}). Make them equal"
                                 " or use use_deepspeed=True.")
        elif not (self.use_mpi or self.use_deepspeed):
            raise ValueError(
                f"hostfile={str(self.hostfile)!r} with torchrun: torchrun starts the ranks of one node. Run the same"
                " command on each node with node_rank=I (CLI: --node_rank I), or launch every node from here with"
                " use_deepspeed=True or use_mpi=True."
            )
        return total

    # ----------------------------------------------------------------------------- command construction
    def build_command(self, command: Union[str, Sequence[str]], master_port: Optional[int] = None) -> list[str]:
        """The argv that launches ``command`` on every rank (no shell involved)."""
        user = self._split(command) if isinstance(command, str) else list(command)
        port = str(master_port or self.master_port)
        py = sys.executable
        if self.use_mpi:
            return self._mpirun_command(user, port)
        if self.use_deepspeed:
            cmd = [py, "-u", "-m", "deepspeed.launcher.runner", "--master_addr", self.master_addr,
                   "--master_port", port, "--no_local_rank"]
            if self.hosts is None:
                cmd += ["--num_nodes", "1", "--num_gpus", str(self.world_size)]
            else:
                cmd += ["--hostfile", str(self.hostfile)]
                if self.node_rank is not None:
                    cmd += ["--no_ssh", "--node_rank", str(self.node_rank)]
                elif len(self.hosts) == 1:
                    cmd += ["--no_ssh_check"]  # one host: DeepSpeed launches locally, ssh is never used
            return cmd + [*_SHIM, *user]
        if self.launcher == "python":
            return [py, "-u", *_SHIM, *user]
        if self.hosts is not None and self.node_rank is not None:
            nnodes, per_node, node_rank = len(self.hosts), self.hosts[self.node_rank].slots, self.node_rank
        else:
            nnodes, per_node, node_rank = 1, self.world_size, 0
        return [py, "-u", "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", str(per_node),
                "--node_rank", str(node_rank), "--master_addr", self.master_addr, "--master_port", port,
                "--max_restarts", "0", "--monitor_interval", "0.5", *_SHIM, *user]

    def _mpirun_command(self, user: list[str], port: str) -> list[str]:
        mpirun = shutil.which("mpirun") or "mpirun"
        cmd = [mpirun, "-np", str(self.world_size), "--bind-to", "none"]
        if _is_root():
            cmd.append("--allow-run-as-root")
        if self.hosts is not None:
            cmd += ["--hostfile", str(self.hostfile)]
        elif self.world_size > (os.cpu_count() or 1):
            cmd.append("--oversubscribe")
        for key in ("MASTER_ADDR", "MASTER_PORT", RUN_DIR_ENV, RUN_ID_ENV, STOP_TIMEOUT_ENV, "PYTHONPATH",
                    "PYTHONUNBUFFERED", "PATH"):
            cmd += ["-x", key]  # exported to every node: Open MPI passes only these to remote ranks
        return cmd + [sys.executable, "-u", *_SHIM, *user]

    def _environment(self, run_dir: Path, token: str, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({RUN_DIR_ENV: str(run_dir), RUN_ID_ENV: token, "MASTER_ADDR": self.master_addr,
                    "MASTER_PORT": str(port), STOP_TIMEOUT_ENV: str(self.stop_timeout)})
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("PYTHONPATH", "")
        if self.use_mpi:
            if _is_root():
                env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        else:
            # Lightning probes MPI in every rank (mpi4py's MPI_Init); without this Open MPI starts a daemon each.
            env.setdefault("OMPI_MCA_ess_singleton_isolated", "1")
        return env

    def _check_launcher_installed(self) -> None:
        if self.use_mpi and shutil.which("mpirun") is None:
            raise RuntimeError("use_mpi=True (--use_mpi) needs Open MPI's `mpirun` on PATH. Install it with"
                               " `apt-get install openmpi-bin libopenmpi-dev` and `pip install mpi4py`"
                               " (or run `bash scripts/setup.sh`).")

    def _choose_port(self) -> int:
        if self.node_rank not in (None, 0):
            return self.master_port  # node 0 owns the rendezvous port
        if self.master_port == 0:
            if self.node_rank == 0:
                raise ValueError("master_port=0 (any free port) with node_rank: every node must be told the same"
                                 " port; pass one explicitly.")
            return free_port()
        busy = port_in_use(self.master_port, "" if _is_local(self.master_addr) else self.master_addr)
        if not busy:
            return self.master_port
        if self.node_rank == 0:
            raise RuntimeError(
                f"master_port={self.master_port} is already in use on this host ({self.master_addr}), and the other"
                " nodes will look for it there. Pass a free port (--master_port) to every node."
            )
        port = free_port()
        _say(f"master port {self.master_port} is in use on this host; using free port {port} instead"
             " (pass --master_port to choose one).")
        return port

    # ---------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        """Run every command; return the first non-zero exit code (128+N for a rank killed by signal N), else 0."""
        self._check_launcher_installed()
        for index, argv in enumerate(self.commands):
            code = self._run_one(argv, index)
            if code != 0:
                return code
        return 0

    def _run_one(self, user: list[str], index: int) -> int:
        token = uuid.uuid4().hex
        if self.log_dir is not None:  # a fresh directory per run: records of an earlier run must not be read
            run_dir = self.log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{token[:6]}-cmd{index}"
            run_dir.mkdir(parents=True)
            keep = True
        else:
            run_dir, keep = Path(tempfile.mkdtemp(prefix="lgds-run-")), False
        port = self._choose_port()
        argv = self.build_command(user, port)
        _say(f"{self.launcher}, world size {self.world_size}: {shlex.join(argv)}")
        start = time.monotonic()
        with _SignalTrap(self):
            launcher = subprocess.Popen(
                argv, env=self._environment(run_dir, token, port), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_term_with_parent if threading.active_count() == 1 else None,
            )
            relay = _Relay(launcher.stdout, run_dir / "launcher.log")
            failure, code = None, 1
            try:
                failure, code = self._supervise(launcher, run_dir, start)
            finally:
                stopped = self._stop(launcher, token, clean_exit=failure is None and code == 0)
                relay.join()
        elapsed = time.monotonic() - start
        if failure is not None:
            self._report(failure, stopped, elapsed, run_dir)
            code = failure.returncode
        elif code != 0:
            self._say_stopped(stopped)
        elif stopped.pids:
            _say(f"{len(stopped.pids)} process(es) of the job outlived the launcher and were stopped: {stopped.pids}")
        if code == 0 and not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif code != 0:
            _say(f"per-rank logs: {run_dir}")
        return code

    def _supervise(self, launcher: subprocess.Popen, run_dir: Path, start: float) -> tuple[Optional[_Failure], int]:
        ranks = _RankTable(run_dir)
        while True:
            if self._stop_signal is not None:
                sig = self._stop_signal
                _say(f"received {signal.Signals(sig).name}: stopping every rank.")
                return None, 128 + sig
            failure = ranks.first_failure()
            if failure is not None:
                return failure, failure.returncode
            code = launcher.poll()
            if code is not None:
                failure = ranks.first_failure()  # the shims wrote their records before exiting
                if failure is None and code != 0:
                    failure = _Failure(None, _exit_code(code), f"the launcher exited with {_describe(code)}",
                                       run_dir / "launcher.log")
                return failure, 0 if failure is None else failure.returncode
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                return _Failure(None, 124, f"the job ran past timeout={self.timeout:g} s", None), 124
            time.sleep(0.1)

    def _stop(self, launcher: subprocess.Popen, token: str, clean_exit: bool) -> _Stopped:
        """End every process of the job: SIGTERM, then SIGKILL after ``stop_timeout`` s.

        The ranks go first; the launcher gets a moment to notice and exit by itself (mpirun can crash when
        signalled while its ranks exit) before it is signalled too. After a clean exit, leftovers first get
        ``stop_timeout`` s to finish on their own.
        """
        if clean_exit:
            deadline = time.monotonic() + self.stop_timeout
            while _job_processes(launcher, token) and time.monotonic() < deadline:
                time.sleep(0.2)
        start = time.monotonic()
        procs = _job_processes(launcher, token)
        for p in procs:
            if p.pid != launcher.pid:
                _signal(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=min(2.0, self.stop_timeout))
        for p in alive:
            if p.pid == launcher.pid:
                _signal(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(alive, timeout=max(0.0, self.stop_timeout - (time.monotonic() - start)))
        alive += [p for p in _job_processes(launcher, token) if p not in alive]  # started during the wait
        for p in alive:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        launcher.wait()
        return _Stopped(sorted(p.pid for p in procs), time.monotonic() - start, len(alive))

    def _report(self, failure: _Failure, stopped: _Stopped, elapsed: float, run_dir: Path) -> None:
        who = f"rank {failure.rank}" if failure.rank is not None else "the job"
        _say(f"{who} failed: {failure.how} (after {elapsed:.1f} s).")
        if failure.log is not None and failure.log.exists():
            lines = _tail(failure.log, self.tail_lines)
            _say(f"last {len(lines)} lines of {who} ({failure.log}):")
            sys.stderr.write("".join(f"  | {line}\n" for line in lines))
        self._say_stopped(stopped)

    def _say_stopped(self, stopped: _Stopped) -> None:
        if stopped.pids:
            _say(f"stopped {len(stopped.pids)} process(es) of the job in {stopped.seconds:.1f} s"
                 f" ({stopped.killed} needed SIGKILL after {self.stop_timeout:g} s).")


# --------------------------------------------------------------------------------------- supervision
class _RankTable:
    """What the shims recorded under the run directory, and whether each rank is still alive."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[int, Optional[psutil.Process]] = {}

    def first_failure(self) -> Optional[_Failure]:
        failures = []
        for path in self.run_dir.glob("rank*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            rank = int(record["rank"])
            log = self.run_dir / f"rank{rank}.log"
            if "returncode" in record:
                code = int(record["returncode"])
                if code != 0:
                    failures.append((path.stat().st_mtime, _Failure(rank, _exit_code(code),
                                     f"exited with {_describe(code)} (pid {record['child_pid']} on {record['host']})",
                                     log)))
                continue
            if rank not in self.procs:
                try:
                    self.procs[rank] = psutil.Process(int(record["pid"]))
                except psutil.NoSuchProcess:
                    self.procs[rank] = None
            proc = self.procs[rank]
            if not _alive(proc) and "returncode" not in json.loads(path.read_text()):
                failures.append((time.time(), _Failure(rank, 128 + signal.SIGKILL,
                                 f"its process (pid {record['pid']}) vanished without an exit status: killed", log)))
        if not failures:
            return None
        return min(failures, key=lambda item: item[0])[1]


def _alive(proc: Optional[psutil.Process]) -> bool:
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


class _Relay(threading.Thread):
    """Copies the launcher's output to our stdout and to a file."""

    def __init__(self, stream: Optional[IO[bytes]], path: Path) -> None:
        super().__init__(daemon=True)
        self.stream, self.path = stream, path
        self.start()

    def run(self) -> None:
        assert self.stream is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with open(self.path, "ab") as log:
            for chunk in iter(lambda: self.stream.read1(65536), b""):  # type: ignore[union-attr]
                log.write(chunk)
                log.flush()
                try:
                    sys.stdout.write(decoder.decode(chunk))
                    sys.stdout.flush()
                except (OSError, ValueError):
                    pass

    def join(self, timeout: Optional[float] = 5.0) -> None:
        super().join(timeout)


class _SignalTrap:
    """While a job runs (main thread only): SIGINT/SIGTERM/SIGHUP ask the runner to stop it instead of dying."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, runner: DistributedRunner) -> None:
        self.runner = runner
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "_SignalTrap":
        self.runner._stop_signal = None
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.runner._stop_signal = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------------------------- helpers
_PR_SET_PDEATHSIG = 1
try:
    _prctl: Optional[Any] = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
    _prctl = None


def _term_with_parent() -> None:  # in the launcher between fork and exec: SIGTERM when the runner dies
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _is_local(address: str) -> bool:
    if address in ("127.0.0.1", "localhost", "0.0.0.0", "::1", socket.gethostname()):
        return True
    return port_in_use(0, address) is not None  # binding works only on this host's addresses


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    if code > 128 and code - 128 in signal.valid_signals():
        return f"exit code {code} (signal {signal.Signals(code - 128).name})"
    return f"exit code {code}"


def _tail(path: Path, lines: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode("utf-8", errors="replace")
    return [line.rstrip("\r") for line in text.splitlines()[-lines:]]


def _say(message: str) -> None:
    sys.stderr.write(f"{_PREFIX} {message}\n")
    sys.stderr.flush()


# ------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``spawn``: the seed's launcher flags, then the script and its own arguments."""
    parser.add_argument("--world_size", type=int, default=1, help="ranks in all (default 1: plain python)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--use_deepspeed", action="store_true", help="launch with DeepSpeed's launcher")
    which.add_argument("--use_mpi", action="store_true", help="launch with Open MPI's mpirun")
    parser.add_argument("--hostfile", default=None, help="DeepSpeed-format hostfile: one `host slots=N` per line")
    parser.add_argument("--node_rank", type=int, default=None,
                        help="with --hostfile: start only this node's ranks (run once per node)")
    parser.add_argument("--master_addr", default=None, help="rendezvous address (default 127.0.0.1 / first host)")
    parser.add_argument("--master_port", type=int, default=29500, help="rendezvous port (default 29500; 0: any free)")
    parser.add_argument("--log_dir", default=None, help="keep per-rank logs here (default: a temporary directory)")
    parser.add_argument("--stop_timeout", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)")
    parser.add_argument("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    parser.add_argument("training_script", help="the script to run on every rank")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def run(args: argparse.Namespace) -> int:
    argv = (["-m"] if args.module else []) + [args.training_script, *args.training_script_args]
    try:
        runner = DistributedRunner(
            [shlex.join(argv)], world_size=args.world_size, hostfile=args.hostfile, use_mpi=args.use_mpi,
            use_deepspeed=args.use_deepspeed, master_port=args.master_port, master_addr=args.master_addr,
            node_rank=args.node_rank, log_dir=args.log_dir, stop_timeout=args.stop_timeout,
        )
        return runner.run()
    except (ValueError, RuntimeError) as err:
        _say(f"error: {err}")
        return 2

