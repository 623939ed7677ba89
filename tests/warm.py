"""A fork server for the suite's jobs: ranks start warm, forked from a parent that has already imported torch,
Lightning, DeepSpeed and transformers (6-8 s per rank on 2 cores when each rank imports them itself).

Run by tests/procs.py (``WarmServer``), one per test session (per pytest-xdist worker); never imported by the tests.
The protocol is one JSON line per message. On stdin, a job: ``{"id", "script" | "module" | "code", "args", "env",
"cwd", "ranks", "output"}`` (``python script``, ``python -m module`` or ``python -c code``; ``ranks`` 0: one process
in the job's environment as it is, a command line tool rather than a rank). On stdout, the
server's answers: ``{"ready": true}`` once the imports are done, ``{"id", "pid"}`` when a job's leader has started
(the leader is the job's process group: kill that group to end the job), ``{"id", "rc", "cpu"}`` when it has ended
(``cpu``: the CPU seconds of the leader and its ranks).

Each job still gets fresh processes and a fresh process group, never a shared engine: the leader is forked from the
server, starts its own session, and forks ``ranks`` processes. Each rank sets the environment that Lightning's own
launcher gives its ranks (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), so
Lightning sees processes created externally (as under torchrun), and then runs the script as ``python script args``
would: ``sys.argv``, ``sys.path[0]`` the script's folder, ``__main__``, and a normal interpreter exit (atexit
handlers, threads joined, the exit code). The leader waits for its ranks; once one fails, the others get
``FAIL_GRACE`` seconds before it kills them, by pid (a dead rank never leaves the others hanging), and it exits with
the first failure's code.

The server forks only while it is single-threaded and has run no torch operation (no OpenMP pool yet), and its
objects are frozen out of the collector (``gc.freeze``), so the ranks neither copy its heap nor scan it.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import time
from typing import Any, Optional

# What a job imports on its way to its first step (measured: 700 modules past the top-level packages, torch's
# compiler among them, which deepspeed.initialize and the CPU ops' loader reach), never the package itself: its
# modules read their environment as they import, and a job's environment is its own.
PRELOAD = ("torch", "lightning", "lightning.pytorch", "lightning.fabric", "deepspeed", "transformers",
           "transformers.modeling_utils", "torch._inductor.compile_fx", "torch.utils.cpp_extension",
           "deepspeed.ops.adam", "deepspeed.module_inject", "deepspeed.moe.layer",
           "lightning.pytorch.strategies.deepspeed", "lightning.fabric.strategies.deepspeed")
FAIL_GRACE = 20.0  # seconds the other ranks get once one rank has failed (Lightning's own launcher gives none)


def _preload() -> None:
    import importlib
    import warnings

    with warnings.catch_warnings():  # a job's own imports print whatever they print; the server's stay quiet
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # an optional one (transformers) this environment lacks or cannot import: jobs import it
                pass


_protocol = -1  # the server's answers go on its own descriptor: what the imports print (DeepSpeed's accelerator
# notice) goes to stderr, never into the protocol


def _open_protocol() -> None:
    global _protocol
    _protocol = os.dup(1)
    os.dup2(2, 1)


def _send(message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(_protocol, data):]


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a shell reports it


def _lead(job: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The job's leader: its own session, one fork per rank. Returns the job in a rank; never returns in the leader."""
    os.setsid()
    os.close(_protocol)  # only the server answers
    out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)  # the leader and its ranks write to the job's output, never to the server's pipe
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    ranks: dict[int, int] = {}
    for local_rank in range(job["ranks"]):
        pid = os.fork()
        if pid == 0:
            env = dict(job["env"])
            env.update(NODE_RANK="0", LOCAL_RANK=str(local_rank), WORLD_SIZE=str(job["ranks"]))
            if env.get("OMPI_MCA_orte_tmpdir_base"):  # an Open MPI session base per rank (tests/conftest.py)
                env["OMPI_MCA_orte_tmpdir_base"] = os.path.join(env["OMPI_MCA_orte_tmpdir_base"], f"rank{local_rank}")
            return {**job, "env": env}
        ranks[pid] = local_rank
    if not job["ranks"]:  # one plain process: the environment as the job gave it
        pid = os.fork()
        if pid == 0:
            return job
        ranks[pid] = 0
    first_failure: Optional[int] = None
    deadline = None
    while ranks:
        if deadline is not None and time.monotonic() > deadline:
            for pid in ranks:  # only the ranks this leader forked, by their pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = float("inf")
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        del ranks[pid]
        code = _exit_code(status)
        if code != 0 and first_failure is None:
            first_failure = code
            deadline = time.monotonic() + FAIL_GRACE
    os._exit(first_failure or 0)


def serve() -> dict[str, Any]:
    """Answer job requests until stdin closes. Returns only in a forked rank, with the job it is to run."""
    _open_protocol()
    _preload()
    gc.collect()
    gc.freeze()
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:  # a fork copies only the calling thread: locks another one holds would never be released
        _send({"ready": False, "why": f"{threads} threads after the imports (is OMP_NUM_THREADS=1 set?)"})
        os._exit(0)
    _send({"ready": True})
    leaders: dict[int, str] = {}
    stdin = sys.stdin.fileno()
    buffer = b""
    while True:
        while leaders:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in leaders:  # the leader's CPU time includes its ranks' (it has reaped them)
                _send({"id": leaders.pop(pid), "rc": _exit_code(status), "cpu": usage.ru_utime + usage.ru_stime})
        readable, _, _ = select.select([stdin], [], [], 0.1)
        if not readable:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:  # the suite has ended: end the jobs still running (only the groups this server started)
            for pid in leaders:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            job = json.loads(line)
            sys.stdout.flush()  # nothing buffered is written twice, once by each side of the fork
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(stdin)  # the leader never reads jobs
                rank_job = _lead(job)
                assert rank_job is not None
                return rank_job
            leaders[pid] = job["id"]
            _send({"id": job["id"], "pid": pid})


def _run(job: dict[str, Any]) -> None:
    """In a rank: become ``python script args`` (``-m module``, ``-c code``) in the job's folder and environment."""
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.stdin = open(os.devnull)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    import runpy  # the server's objects stay frozen: the job's own are collected as in any process

    if job.get("module"):  # as ``python -m``: the working folder first on sys.path, argv[0] the module's file
        sys.argv = [job["module"], *job["args"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    elif job.get("code") is not None:  # as ``python -c``
        sys.argv = ["-c", *job["args"]]
        sys.path[0] = ""
        exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        script = os.path.abspath(job["script"])
        sys.argv = [script, *job["args"]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _run(serve())
