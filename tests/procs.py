"""Start real processes for tests, and own them: each job in its own process group, killed on time-out.

Only processes started here are ever signalled, by their process-group id.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_gaudi_ds.launch._proc import free_port

REPO = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).resolve().parent / "jobs"


@dataclass
class JobResult:
    returncode: int
    output: str
    seconds: float
    timed_out: bool

    def check(self) -> "JobResult":
        assert not self.timed_out, f"job timed out after {self.seconds:.0f}s; {self.report()}"
        assert self.returncode == 0, f"job failed (rc={self.returncode}); {self.report()}"
        return self

    def report(self, tail: int = 4000) -> str:
        """The output's tail, every traceback in the whole output (the ranks' outputs interleave, so the tail can
        hold one rank's only), and where the whole output was saved."""
        fd, path = tempfile.mkstemp(prefix="lgds-failed-job-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(self.output)
        blocks = _tracebacks(self.output[:-tail] if len(self.output) > tail else "")
        shown = "".join(f"\n--- a traceback before the tail ---\n{block}" for block in blocks[:4])
        return f"whole output in {path}; output tail:\n{self.output[-tail:]}{shown}"


def _tracebacks(text: str, limit: int = 3000) -> list[str]:
    """Each ``Traceback ...`` block of ``text`` up to its exception line (at most ``limit`` characters each)."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if "Traceback (most recent call last):" in line:
            end = next((j for j in range(i + 1, min(len(lines), i + 200))
                        if re.match(r"^(\[rank\d+\]: )?\w[\w.]*(Error|Exception|Interrupt|Exit)\b", lines[j])), i + 40)
            blocks.append("\n".join(lines[i:end + 1])[-limit:])
    return blocks


def job_env(extra: Optional[Mapping[str, Optional[str]]] = None) -> dict[str, str]:
    """The environment of a job: this one, less what a launcher sets per rank, plus ``extra`` (``None``: unset)."""
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_DEEPSPEED_CONFIG_PATH"):
        env.pop(key, None)
    if "MASTER_PORT" not in (extra or {}):  # run_job picks it itself (and again for a lost port)
        env["MASTER_PORT"] = str(free_port())
    env.update(
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # With mpi4py installed, Lightning's MPI probe makes Open MPI start a daemon (in its own session) per rank.
        OMPI_MCA_ess_singleton_isolated="1",
        # ... and those singletons share a job id: a session base for each job (tests/conftest.py says why).
        OMPI_MCA_orte_tmpdir_base=tempfile.mkdtemp(prefix="job-", dir=env.get("OMPI_MCA_orte_tmpdir_base") or None),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_job(
    args: Sequence[str],
    timeout: float = 300,
    env: Optional[Mapping[str, Optional[str]]] = None,
    cwd: Optional[Path] = None,
    ranks: Optional[int] = None,
    warm: bool = False,
) -> JobResult:
    """Run ``args`` in a new session; on time-out kill the whole process group (and only it).

    ``ranks=N`` (for ``python script ...`` only) starts the job warm: ``N`` ranks forked from the suite's warm server
    (tests/warm.py), each in the environment Lightning's launcher gives its ranks. ``warm=True`` (``python script``,
    ``python -m module`` or ``python -c code``) forks one process from it, in the job's environment as it is: a
    command line tool, a check script's Python, a script whose Trainer launches its own ranks. Without either, or with
    ``LGDS_WARM=0``, ``python`` starts cold. ``env`` values of ``None`` unset a variable.

    Unless ``env`` sets ``MASTER_PORT``, the harness picks it; a job whose rank 0 then finds it taken
    (``store_port_taken``) runs again on another port, at most ``PORT_TRIES`` times, with a warning.
    """
    for attempt in range(1, PORT_TRIES + 1):
        port_env = {} if env and "MASTER_PORT" in env else {"MASTER_PORT": str(free_port())}
        result = _run_job_once(args, timeout, {**port_env, **(env or {})}, cwd, ranks, warm)
        if attempt == PORT_TRIES or not port_env or not store_port_taken(result, int(port_env["MASTER_PORT"])):
            return result
        warnings.warn(f"attempt {attempt} of {' '.join(map(str, args[:2]))}: rank 0's store found port "
                      f"{port_env['MASTER_PORT']} taken between its choice and its bind (EADDRINUSE); run again on "
                      "another port", stacklevel=2)
    raise AssertionError("unreachable")


PORT_TRIES = 3  # a job whose store lost the harness's port pick to another process runs again, on another port


def store_port_taken(result: "JobResult", port: int) -> bool:
    """Whether ``result`` failed only because rank 0's TCPStore could not bind ``port`` (torch's EADDRINUSE message).

    The harness picks a free port outside the kernel's ephemeral range (``free_port``), and rank 0 binds it seconds
    later. Another process on a busy host (the other pytest worker, another job on a CI machine) can bind it in
    between; nothing the job tests has run by then, so the job runs again on another port.
    """
    return (not result.timed_out and result.returncode != 0
            and re.search(rf"port: {port}, useIpv6: \w+, code: -?\d+, name: EADDRINUSE", result.output) is not None)


def _run_job_once(args: Sequence[str], timeout: float, env: Mapping[str, Optional[str]], cwd: Optional[Path],
                  ranks: Optional[int], warm: bool) -> JobResult:
    if (ranks is not None or warm) and list(args[:1]) == [sys.executable] and len(args) > 1 and \
            os.environ.get(WARM_ENV, "1") != "0":
        return WarmServer.get().run(args[1:], ranks or 0, timeout, env, cwd)
    start, start_wall = time.monotonic(), time.time()
    full_env = job_env({**_timing_env(), **(env or {})})
    proc = subprocess.Popen(
        list(args),
        cwd=str(cwd or REPO),
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        output, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
            proc.wait()
        try:  # ranks the job started and left behind share its process group: end them too
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    seconds = time.monotonic() - start
    _record_job(args, full_env, start_wall, seconds, warm=False)
    return JobResult(proc.returncode, output or "", seconds, timed_out)


def kill_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(1.0)


def job_ranks(job_args: Sequence[str], default: int = 2) -> int:
    """The rank count a job's ``--devices`` asks for (tests/jobs/common.job_parser's default: 2)."""
    args = list(job_args)
    for i, arg in enumerate(args):
        if arg == "--devices" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return default


def run_train_job(out: Path, *job_args: str, timeout: float = 300, env: Optional[Mapping[str, str]] = None) -> list[dict]:
    """Run tests/jobs/train_job.py warm on ``--devices`` ranks; return per-rank results."""
    run_job([sys.executable, str(JOBS / "train_job.py"), "--out", str(out), *job_args], timeout, env,
            ranks=job_ranks(job_args)).check()
    files = sorted(out.glob("rank*.json"))
    assert files, f"no results written under {out}"
    return [json.loads(f.read_text()) for f in files]


TIMES_ENV = "LGDS_SUITE_TIMES"  # a folder: record every job's wall time and start-up there (benchmarks/suite.py)
FIRST_STEP_ENV = "LGDS_FIRST_STEP_FILE"  # per job: each rank appends the wall-clock time of its first optimizer step


def _timing_env() -> dict[str, str]:
    """The first-step file a timed job's ranks write to (tests/jobs/common.start_process); empty when not timing."""
    folder = os.environ.get(TIMES_ENV)
    if not folder:
        return {}
    return {FIRST_STEP_ENV: str(Path(folder) / "steps" / f"{uuid.uuid4().hex}.txt")}


def plain_node_id(nodeid: str) -> str:
    """A test's node id without the ``@group`` that pytest-xdist's ``--dist loadgroup`` appends to it."""
    return nodeid[:nodeid.rfind("@")] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def _record_job(args: Sequence[str], env: Mapping[str, str], start_wall: float, seconds: float, warm: bool) -> None:
    """Append one job's times to ``$LGDS_SUITE_TIMES/jobs.jsonl`` (only when that variable is set)."""
    folder = os.environ.get(TIMES_ENV)
    step_file = env.get(FIRST_STEP_ENV)
    if not folder or not step_file:
        return
    first = None
    try:
        stamps = [float(x) for x in Path(step_file).read_text().split()]
        first = min(stamps) - start_wall if stamps else None
    except (OSError, ValueError):
        pass
    record = {"test": plain_node_id(os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]),
              "seconds": round(seconds, 2),
              "startup": None if first is None else round(first, 2), "warm": warm, "venv": Path(sys.prefix).name,
              "job": " ".join(Path(a).name if i < 2 else a for i, a in enumerate(args[:4]))}
    with open(Path(folder) / "jobs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


WARM_ENV = "LGDS_WARM"  # "0": every job starts cold, each rank importing torch, Lightning and DeepSpeed itself
WARM_CPU = [0.0]  # CPU seconds of the warm jobs that ended in this process (tests/conftest.py's per-test CPU time)


class WarmServer:
    """The session's fork server (tests/warm.py): started on first use, ended when the suite ends (its stdin closes)."""

    _instance: Optional["WarmServer"] = None
    START_TIMEOUT = 300.0  # its imports: 6-8 s on an idle 2-core machine

    @classmethod
    def get(cls) -> "WarmServer":
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        import atexit
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="lgds-warm-"))
        self._cond = threading.Condition()
        self._answers: dict[str, dict] = {}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "warm.py")], cwd=str(REPO), env=job_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)
        ready = self._wait("server", "ready", self.START_TIMEOUT)
        if not ready:
            why = self._answers.get("server", {}).get("why", f"not ready within {self.START_TIMEOUT:g} s")
            self.close()
            raise AssertionError(f"the warm server (tests/warm.py) cannot fork ranks: {why}; LGDS_WARM=0 starts"
                                 " every job cold")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._cond:
                self._answers.setdefault(message.pop("id", "server"), {}).update(message)
                self._cond.notify_all()
        with self._cond:
            self._answers.setdefault("server", {})["exited"] = True
            self._cond.notify_all()

    def _wait(self, job_id: str, key: str, timeout: float) -> Optional[Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._answers.get(job_id, {}):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if self._answers.get("server", {}).get("exited"):
                    raise AssertionError(f"the warm server (tests/warm.py) exited (rc={self.proc.poll()})")
                self._cond.wait(min(left, 1.0))
            return self._answers[job_id][key]

    def run(self, argv: Sequence[str], ranks: int, timeout: float, env: Optional[Mapping[str, Optional[str]]],
            cwd: Optional[Path]) -> JobResult:
        """Run ``python *argv`` warm: ``ranks`` ranks, or (0) one process in the job's environment as it is."""
        job_id = uuid.uuid4().hex
        output = self.folder / f"{job_id}.log"
        full_env = job_env({**_timing_env(), **(env or {})})
        start, start_wall = time.monotonic(), time.time()
        argv = [str(a) for a in argv]
        if argv[0] in ("-m", "-c") and len(argv) > 1:
            what, args = {"module" if argv[0] == "-m" else "code": argv[1]}, argv[2:]
        elif argv[0].startswith("-"):
            raise ValueError(f"the warm server runs `python script`, `-m module` or `-c code`, not {argv[0]}")
        else:
            what, args = {"script": argv[0]}, argv[1:]
        request = {"id": job_id, **what, "args": args, "env": full_env,
                   "cwd": str(cwd or REPO), "ranks": ranks, "output": str(output)}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._wait(job_id, "pid", 60)
        assert pid is not None, "the warm server did not start the job within 60 s"
        rc = self._wait(job_id, "rc", timeout)
        timed_out = rc is None
        if timed_out:
            kill_group(pid)
            rc = self._wait(job_id, "rc", 60)
        try:  # what the ranks started and left behind shares the job's process group: end it too
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        seconds = time.monotonic() - start
        text = output.read_text(errors="replace") if output.exists() else ""
        output.unlink(missing_ok=True)
        with self._cond:
            cpu = self._answers.pop(job_id, {}).get("cpu")
        WARM_CPU[0] += cpu or 0.0
        _record_job([sys.executable, *argv], full_env, start_wall, seconds, warm=True)
        return JobResult(-9 if rc is None else rc, text, seconds, timed_out)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the server ends the jobs it still runs, then exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(self.proc.pid)
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


MARK_ENV = "LGDS_TEST_JOB"  # every process of a LiveJob inherits it: how tests find leftovers


@dataclass
class LiveJob:
    """A job in its own session whose output lines are time-stamped as they arrive, so tests can act mid-run.

    Every process it starts carries ``LGDS_TEST_JOB=<mark>`` in its environment (unless a launcher scrubs it),
    which :meth:`leftovers` looks for in the process table.
    """

    args: Sequence[str]
    env: Optional[Mapping[str, str]] = None
    cwd: Optional[Path] = None
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.start, self._start_wall = time.monotonic(), time.time()
        self._env = job_env({**_timing_env(), **(self.env or {}), MARK_ENV: self.mark})
        self.proc = subprocess.Popen(
            list(self.args), cwd=str(self.cwd or REPO), env=self._env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, text: str, timeout: float = 300, count: int = 1) -> float:
        """Time (monotonic) of the ``count``-th occurrence of ``text`` in the output; fails on time-out or exit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = self._hits(text)
            if len(hits) >= count:
                return hits[count - 1]
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                hits = self._hits(text)
                if len(hits) >= count:
                    return hits[count - 1]
                raise AssertionError(f"job exited (rc={self.proc.returncode}) before printing {text!r} x{count}:\n"
                                     f"{self.output[-4000:]}")
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"no {text!r} x{count} within {timeout:.0f}s; output tail:\n{self.output[-4000:]}")

    def _hits(self, text: str) -> list[float]:
        # Counted per occurrence, not per line: ranks share the launcher's stdout, and a rank's line can arrive
        # in two writes (text, then newline) with another rank's output in between.
        return [t for t, line in list(self.lines) for _ in range(line.count(text))]

    def wait(self, timeout: float = 300) -> JobResult:
        timed_out = False
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
        self._reader.join(timeout=10)
        seconds = time.monotonic() - self.start
        _record_job(self.args, self._env, self._start_wall, seconds, warm=False)
        return JobResult(self.proc.returncode, self.output, seconds, timed_out)

    def send_signal(self, sig: int) -> None:
        """Signal the job's own process (the launcher or runner), not its group."""
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the job's process group and every process carrying its mark (only those)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in self.leftovers():
            try:
                p.kill()
            except Exception:
                pass
        self.proc.wait()

    def leftovers(self, where: Optional[Callable[["psutil.Process"], bool]] = None) -> list:
        """Live processes (not zombies) carrying this job's mark, optionally filtered."""
        return processes_with_env(MARK_ENV, self.mark, where)


def processes_with_env(key: str, value: str, where: Optional[Callable] = None) -> list:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(key) == value and (where is None or where(p)):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found
