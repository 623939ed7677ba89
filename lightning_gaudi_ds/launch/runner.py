"""Launch a training script on N ranks: torchrun, DeepSpeed's launcher, mpirun, or plain python for one.

``lightning-gaudi-ds spawn --world_size 2 --use_deepspeed train.py --lr 0.1`` or, from code,
``DistributedRunner(["train.py --lr 0.1"], world_size=2, use_deepspeed=True).run()``.

:class:`DistributedRunner` checks its arguments at once (:mod:`~lightning_gaudi_ds.launch.plan`), picks the
rendezvous port when a command starts, and hands the plan to :mod:`~lightning_gaudi_ds.launch.supervise`, which
owns every process of the job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds.errors import LaunchError, SetupError
from lightning_gaudi_ds.launch import envvars, plan, slurm
from lightning_gaudi_ds.launch._proc import free_port, is_local_address, port_in_use, say
from lightning_gaudi_ds.launch.hostfile import Host
from lightning_gaudi_ds.launch.rendezvous import HOW_TO_START
from lightning_gaudi_ds.launch.supervise import Supervisor

__all__ = ["DistributedRunner"]


class DistributedRunner:
    """Run each command of ``command_list`` on ``world_size`` ranks; ``run()`` returns the first non-zero exit code.

    Args:
        command_list: commands, each ``"script.py args..."`` (or ``"-m module args..."``); split with shlex,
            never run through a shell; run one after another, stopping at the first failure.
        world_size: ranks in all. 1 runs plain python (Lightning's own launcher may still start ``devices``
            processes). With a hostfile: 1 or the sum of its slots.
        hostfile: DeepSpeed's format (``host slots=N``); needs ``use_deepspeed`` or ``use_mpi``, or ``node_rank``.
            Inside a SLURM allocation (``salloc``, ``sbatch``), ``use_deepspeed`` or ``use_mpi`` without a hostfile
            runs on the allocation's nodes (``SLURM_JOB_NODELIST``), each with ``SLURM_TASKS_PER_NODE`` ranks; a
            hostfile, when given, is used instead.
        use_mpi: launch with Open MPI's ``mpirun``.
        use_deepspeed: launch with DeepSpeed's launcher (``--no_local_rank``: scripts read ``LOCAL_RANK``).
            Neither: torchrun (``python -m torch.distributed.run``).
        master_port: rendezvous port; 0 picks a free one. When this runner tells every rank the port and it is
            taken on this host, a free port is used instead (and printed).
        master_addr: rendezvous address; default 127.0.0.1, or the first host of the hostfile.
        node_rank: start only this node's ranks of a hostfile job (torchrun ``--node_rank``, DeepSpeed
            ``--no_ssh --node_rank``): run the same command on every node with its own node_rank.
        log_dir: keep per-rank logs in a new subdirectory of this per run and command (mode 0700); default a
            private temporary directory (0700), removed at the end: under the working directory when the launcher
            starts other hosts (pdsh, mpirun), since every rank writes its records there (it must be shared, as
            the working directory DeepSpeed's launcher enters on every host is), else under the system's temp
            directory.
        stop_timeout: seconds between SIGTERM and SIGKILL when stopping the job.
        timeout: stop the job after this many seconds (exit code 124); None waits forever.
        link_timeout: launches over ssh (pdsh, mpirun): a host that does not answer ssh keepalives for this
            long (a lost node or a partitioned link) ends the job; default 60 s.
        tail_lines: lines of a failed rank's output to print.
        max_restarts: start the job again up to this many times after a rank fails or is preempted (not after
            ``timeout`` or a signal to this runner). Every rank of a restart sees ``LIGHTNING_GAUDI_DS_RESTART=<n>``
            and :class:`~lightning_gaudi_ds.HPUDeepSpeedStrategy` then resumes a ``trainer.fit`` without
            ``ckpt_path`` from ``ckpt_path="last"``.
        min_nodes: with a hostfile (pdsh or mpirun from here) and ``max_restarts``: before each restart every
            other host is probed over ssh (``link_timeout`` s); those that do not answer are left out if at least
            ``min_nodes`` hosts remain, else the job ends. The restart then runs on fewer ranks (the checkpoint is
            resharded on load) and its ranks see ``LIGHTNING_GAUDI_DS_NUM_NODES``, which the strategy takes over
            ``Trainer(num_nodes=...)``. Default None: every restart runs on every host.
        hpu_mode: on Gaudi, the execution mode every rank imports ``habana_frameworks`` in: ``"eager"``
            (torch.compile, Habana's default) or ``"lazy"``; default ``PT_HPU_LAZY_MODE`` (unset: eager). Exported
            to every rank (``-x`` for mpirun, DeepSpeed's env file for its multi-node launch).
    """

    def __init__(
        self,
        command_list: str | Sequence[str],
        world_size: int = 1,
        hostfile: str | os.PathLike | None = None,
        use_mpi: bool = False,
        use_deepspeed: bool = False,
        master_port: int = 29500,
        master_addr: str | None = None,
        node_rank: int | None = None,
        log_dir: str | os.PathLike | None = None,
        stop_timeout: float = 10.0,
        timeout: float | None = None,
        tail_lines: int = 20,
        hpu_mode: str | None = None,
        link_timeout: float = 60.0,
        max_restarts: int = 0,
        min_nodes: int | None = None,
    ) -> None:
        self.command_list = [command_list] if isinstance(command_list, str) else list(command_list)
        if not self.command_list:
            raise LaunchError("command_list=[]: nothing to run; pass at least one command, e.g. ['train.py --lr 0.1'].")
        if timeout is not None and not plan._seconds(timeout):
            raise LaunchError(f"timeout={timeout!r}: pass the seconds after which the job is stopped, a finite number"
                             " > 0, or None to wait for the job however long it runs.")
        if isinstance(tail_lines, bool) or not isinstance(tail_lines, int) or tail_lines < 0:
            raise LaunchError(f"tail_lines={tail_lines!r}: pass a whole number >= 0.")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise LaunchError(f"max_restarts={max_restarts!r}: pass how many times a failed job is started again, a"
                             " whole number >= 0 (0: never).")
        self.max_restarts = max_restarts
        self.commands = [plan.split_command(c) for c in self.command_list]
        envvars.check(os.environ)  # every package variable the ranks would read, checked now, not on a rank
        rdzv = envvars.read(envvars.RENDEZVOUS_TIMEOUT) if os.environ.get(envvars.RENDEZVOUS_TIMEOUT.name) else None
        allocation = None
        if (use_mpi or use_deepspeed) and node_rank is None:
            try:
                allocation = slurm.allocation(os.environ)  # read even when a hostfile wins, to say so
            except slurm.AllocationError:
                if hostfile is None:
                    raise
        self.spec = plan.resolve(world_size, hostfile, use_mpi, use_deepspeed, master_port, master_addr, node_rank,
                                 stop_timeout, hpu_mode, link_timeout,  # type: ignore[arg-type]  # resolve checks it
                                 rdzv, allocation)
        self._ignored_allocation = allocation.source if allocation is not None and hostfile is not None else None
        plan.check_min_nodes(min_nodes, self.spec, max_restarts)
        self.min_nodes = min_nodes
        self._attempt = self.spec  # what the start under way runs on: the spec, or fewer hosts of it (min_nodes)
        self.use_mpi, self.use_deepspeed = use_mpi, use_deepspeed
        self.log_dir = Path(log_dir) if log_dir is not None else None
        if self.log_dir is not None:
            plan.check_log_dir(self.log_dir)
        self.timeout = timeout
        self.tail_lines = tail_lines

    # The checked arguments, under the names they had as constructor arguments.
    @property
    def launcher(self) -> str:
        """``"python"``, ``"torchrun"``, ``"deepspeed"`` or ``"mpirun"``."""
        return self.spec.launcher

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def hostfile(self) -> Path | None:
        return self.spec.hostfile

    @property
    def hosts(self) -> list[Host] | None:
        return list(self.spec.hosts) if self.spec.hosts is not None else None

    @property
    def node_rank(self) -> int | None:
        return self.spec.node_rank

    @property
    def master_addr(self) -> str:
        return self.spec.master_addr

    @property
    def master_port(self) -> int:
        return self.spec.master_port

    @property
    def stop_timeout(self) -> float:
        return self.spec.stop_timeout

    def build_command(self, command: str | Sequence[str], master_port: int | None = None,
                      args_file: Path | None = None, run_dir: Path | None = None) -> list[str]:
        """The argv that launches ``command`` on every rank (no shell involved on this host); torchrun keeps its
        logs under ``run_dir``."""
        user = plan.split_command(command) if isinstance(command, str) else list(command)
        return plan.launch_argv(self._attempt, user, master_port or self.master_port, plan.Machine.this(),
                                args_file, run_dir)

    def _environment(self, run_dir: Path, token: str, port: int, restart: int = 0) -> dict[str, str]:
        env = plan.launch_env(self._attempt, os.environ, run_dir, token, port, plan.Machine.this(), restart)
        if env.get(plan.DEEPSPEED_ENV_FILE) == str(run_dir / plan.DEEPSPEED_ENV_NAME):
            # Our file replaces the name DeepSpeed reads in ~ and in the working directory: keep the user's lines.
            name = os.environ.get(plan.DEEPSPEED_ENV_FILE, ".deepspeed_env")
            user = [Path(d, name) for d in (Path.home(), Path.cwd())]
            lines = "".join(p.read_text() for p in user if p.is_file())
            _write_private(run_dir / plan.DEEPSPEED_ENV_NAME, plan.deepspeed_env_text(env, lines))
        return env

    def _check_launcher_installed(self) -> None:
        if self.use_mpi and shutil.which("mpirun") is None:
            raise SetupError("use_mpi=True (--use_mpi) needs Open MPI's `mpirun` on PATH. Install it with"
                               " `apt-get install openmpi-bin libopenmpi-dev` and `pip install mpi4py`"
                               " (or run `bash scripts/setup.sh`).")

    def _choose_port(self) -> int:
        if self.node_rank not in (None, 0):
            return self.master_port  # node 0 owns the rendezvous port
        if self.master_port == 0:
            if self.node_rank == 0:
                raise LaunchError("master_port=0 (any free port) with node_rank: every node must be told the same"
                                 " port; pass one explicitly.")
            return free_port()
        address = self._attempt.master_addr
        busy = port_in_use(self.master_port, "" if is_local_address(address) else address)
        if not busy:
            return self.master_port
        if self.node_rank == 0:
            raise SetupError(
                f"master_port={self.master_port} is already in use on this host ({self.master_addr}), and the other"
                " nodes will look for it there. Pass a free port (--master_port) to every node."
            )
        port = free_port()
        say(f"master port {self.master_port} is in use on this host; using free port {port} instead"
            " (pass --master_port to choose one).")
        return port

    def _no_rank_hint(self, port: int) -> str:
        if self.launcher != "torchrun" or self.spec.hosts is None or self.node_rank is None:
            return ""
        limit = self.spec.rendezvous_timeout or envvars.RENDEZVOUS_TIMEOUT.default
        return (f"no rank started: torchrun's rendezvous of {len(self.spec.hosts)} nodes at {self.master_addr}:{port}"
                f" did not complete within {limit:g} s ({envvars.RENDEZVOUS_TIMEOUT.name}); is every node started?"
                f" {HOW_TO_START}")

    def run(self) -> int:
        """Run every command; return the first non-zero exit code (128+N for a rank killed by signal N), else 0."""
        self._check_launcher_installed()
        if self._ignored_allocation:
            say(f"hostfile {self.hostfile} given: the SLURM allocation ({self._ignored_allocation}) is not used.")
        elif self.spec.allocation:
            say(f"the SLURM allocation's hosts: {', '.join(f'{h.name} ({h.slots})' for h in self.spec.hosts or ())}"
                f" from {self.spec.allocation}.")
        if self.spec.hosts is None:  # on other nodes the script's path is theirs to have
            for argv in self.commands:
                plan.check_script(argv)
        for index, argv in enumerate(self.commands):
            code = self._run_restarting(argv, index)
            if code != 0:
                return code
        return 0

    def _run_restarting(self, user: list[str], index: int) -> int:
        """Run one command, starting it again up to ``max_restarts`` times after a failure; log each attempt."""
        failures: list[str] = []
        ended, code = 0.0, 1
        lost: tuple[str, ...] = ()  # the hosts whose ranks the last failure lost
        for attempt in range(self.max_restarts + 1):
            if attempt:
                if not self._choose_hosts(attempt, lost):
                    self._say_failures(failures)
                    return code
                say(f"restart {attempt} of {self.max_restarts}: starting the job again"
                    f" {time.monotonic() - ended:.1f} s after the failure; the ranks resume from the newest complete"
                    " checkpoint (ckpt_path='last'), which rank 0 names.")
            try:
                code, supervisor = self._run_one(user, index, attempt)
            finally:
                if self._attempt.hostfile != self.spec.hostfile and self._attempt.hostfile is not None:
                    self._attempt.hostfile.unlink(missing_ok=True)
                self._attempt = self.spec
            if code == 0:
                if failures:
                    say(f"the job completed after {attempt} restart(s).")
                return 0
            if not self.max_restarts:
                return code
            ended = supervisor.ended_at
            failure = supervisor.failure
            lost = failure.hosts if failure is not None else ()
            who = "the job" if failure is None or failure.rank is None else f"rank {failure.rank}"
            why = failure.how if failure is not None else f"exit code {code}"
            failures.append(f"attempt {attempt + 1}: {who} failed: {why}")
            if supervisor.signalled or code == 124:
                return code
        say(f"max_restarts={self.max_restarts} exhausted; the job failed {len(failures)} times:")
        self._say_failures(failures)
        return code

    @staticmethod
    def _say_failures(failures: Sequence[str]) -> None:
        for line in failures:
            say(f"  {line}")

    def _choose_hosts(self, attempt: int, lost: Sequence[str]) -> bool:
        """With ``min_nodes``: the hosts restart ``attempt`` runs on (into ``self._attempt``), leaving out those
        that do not answer; False (said why) when fewer than ``min_nodes`` remain."""
        if self.min_nodes is None or self.spec.hosts is None:
            return True
        hosts = self.spec.hosts
        started = time.monotonic()
        unreachable = probe_hosts(hosts, self.spec.launcher, self.spec.link_timeout)
        probed = time.monotonic() - started
        choice = plan.select_hosts(hosts, unreachable, self.min_nodes)
        why = "; ".join(f"{name}: {reason}" for name, reason in unreachable.items())
        if choice is None:
            say(f"restart {attempt} of {self.max_restarts}: not started: {len(hosts) - len(unreachable)} of"
                f" {len(hosts)} host(s) answer ({why}), fewer than min_nodes={self.min_nodes}.")
            return False
        if not choice.left_out:
            say(f"restart {attempt}: all {len(hosts)} hosts answer (probed in {probed:.1f} s).")
            return True
        fd, name = tempfile.mkstemp(prefix="lgds-hostfile-", text=True)
        with os.fdopen(fd, "w") as f:
            f.write(plan.hostfile_text(choice.kept))
        self._attempt = plan.shrink(self.spec, choice, Path(name))
        for host, reason in choice.left_out:
            whose = "its ranks were the ones lost; " if host.name in lost else ""
            say(f"restart {attempt}: leaving out host {host.name} ({host.slots} rank(s)): {whose}{reason}.")
        moved = (f"; rendezvous moves to {self._attempt.master_addr}"
                 if self._attempt.master_addr != self.spec.master_addr else "")
        say(f"restart {attempt}: {len(choice.kept)} of {len(hosts)} hosts remain (min_nodes={self.min_nodes}):"
            f" {', '.join(h.name for h in choice.kept)}; world size {self.spec.world_size} -> {choice.world_size},"
            f" num_nodes {len(hosts)} -> {len(choice.kept)} ({plan.NUM_NODES_ENV}={len(choice.kept)}){moved};"
            f" the ranks reshard the checkpoint on load (hosts probed in {probed:.1f} s).")
        return True

    def _run_one(self, user: list[str], index: int, attempt: int = 0) -> tuple[int, Supervisor]:
        token = uuid.uuid4().hex
        if self.log_dir is not None:  # a fresh directory per run: records of an earlier run must not be read
            run_dir = self.log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{token[:6]}-cmd{index}"
            try:
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                run_dir.mkdir(mode=0o700)
            except OSError as err:  # e.g. under /proc, where the access check above cannot tell
                where = err.filename if err.filename is not None else run_dir
                raise LaunchError(f"log_dir={str(self.log_dir)!r}: cannot create {where} ({err.strerror}); pass a"
                                 " directory you can write to.") from None
            keep = True
        else:  # mkdtemp: mode 0700
            shared = Path.cwd() if self._attempt.across_hosts else None
            run_dir, keep = Path(tempfile.mkdtemp(prefix=".lgds-run-" if shared else "lgds-run-", dir=shared)), False
        private = []  # removed at the end whatever happens: the env file may carry tokens from this environment
        try:
            if self._attempt.hosts is not None and self._attempt.hostfile is None:  # a SLURM allocation's hosts
                hostfile = run_dir / "hostfile"
                _write_private(hostfile, plan.hostfile_text(self._attempt.hosts))
                self._attempt = replace(self._attempt, hostfile=hostfile)
            port = self._choose_port()
            args_file = None
            if self._attempt.across_hosts:  # no remote shell parses the arguments: every shim reads them from here
                args_file = run_dir / plan.ARGS_NAME
                private.append(args_file)
                _write_private(args_file, json.dumps(user))
            argv = self.build_command(user, port, args_file, run_dir)
            private.append(run_dir / plan.DEEPSPEED_ENV_NAME)
            # a requeued SLURM job (SLURM_RESTART_COUNT) is a restart too: its ranks resume from "last"
            env = self._environment(run_dir, token, port, attempt + slurm.restart_count(os.environ))
            say(f"{self.launcher}, world size {self._attempt.world_size}: {shlex.join(argv)}")
            supervisor = Supervisor(self.stop_timeout, self.timeout, self.tail_lines, self._attempt.hosts,
                                    self._no_rank_hint(port))
            return supervisor.run(argv, env, run_dir, token, keep), supervisor
        finally:
            for path in private:
                path.unlink(missing_ok=True)
            if not keep:
                shutil.rmtree(run_dir, ignore_errors=True)


def probe_hosts(hosts: Sequence[Host], launcher: str, timeout: float,
                environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The hosts of ``hosts`` that do not answer ``ssh HOST true`` within ``timeout`` s (name -> why), probed
    together with the launcher's own ssh options; this host is not probed."""
    key = "OMPI_MCA_plm_rsh_args" if launcher == "mpirun" else "PDSH_SSH_ARGS_APPEND"
    ssh = [shutil.which("ssh", path=environ.get("PATH")) or "ssh", *shlex.split(environ.get(key, "")),
           "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, math.ceil(timeout))}"]

    def probe(name: str) -> str | None:
        try:
            done = subprocess.run([*ssh, name, "true"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout + 5, start_new_session=True)
        except subprocess.TimeoutExpired:
            return f"unreachable: no answer to ssh within {timeout + 5:g} s"
        except OSError as err:
            return f"unreachable: cannot run ssh ({err})"
        if done.returncode == 0:
            return None
        last = (done.stderr.strip().splitlines() or [""])[-1]
        return f"unreachable: ssh exited with {done.returncode}" + (f" ({last})" if last else "")

    names = [h.name for h in hosts if not is_local_address(h.name)]
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(names)))) as pool:
        answers = dict(zip(names, pool.map(probe, names), strict=True))
    return {name: why for name, why in answers.items() if why is not None}


def _write_private(path: Path, text: str) -> None:
    """Write a new file only this user can read (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# ------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``spawn``: the launcher's flags, then the script and its own arguments."""
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
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop the job after this many seconds (exit code 124; default: no limit)")
    parser.add_argument("--link_timeout", type=float, default=60.0,
                        help="pdsh/mpirun over ssh: a host silent this long (lost node or link) ends the job"
                             " (default 60)")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="start the job again up to N times after a rank fails or is preempted; the ranks"
                             " resume from the newest complete checkpoint (default 0)")
    parser.add_argument("--min_nodes", type=int, default=None,
                        help="with --hostfile and --max_restarts: a restart leaves out hosts that do not answer ssh"
                             " if at least M hosts remain; the ranks reshard the checkpoint (default: every host)")
    parser.add_argument("--hpu_mode", choices=hpu.MODES, default=None,
                        help="Gaudi execution mode for every rank (default: PT_HPU_LAZY_MODE, unset = eager)")
    parser.add_argument("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    parser.add_argument("training_script", help="the script to run on every rank")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def run(args: argparse.Namespace) -> int:
    """``spawn``: build a :class:`DistributedRunner` from the parsed arguments and run it."""
    argv = (["-m"] if args.module else []) + [args.training_script, *args.training_script_args]
    try:
        runner = DistributedRunner(
            [shlex.join(argv)], world_size=args.world_size, hostfile=args.hostfile, use_mpi=args.use_mpi,
            use_deepspeed=args.use_deepspeed, master_port=args.master_port, master_addr=args.master_addr,
            node_rank=args.node_rank, log_dir=args.log_dir, stop_timeout=args.stop_timeout, hpu_mode=args.hpu_mode,
            timeout=args.timeout, link_timeout=args.link_timeout, max_restarts=args.max_restarts,
            min_nodes=args.min_nodes,
        )
        return runner.run()
    except (ValueError, RuntimeError) as err:
        say(f"error: {err}")
        return 2
