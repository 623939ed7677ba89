"""What a launch runs, as data: checked arguments in, then the argv and the environment for each launcher.

Four launchers: ``python`` (one process; Lightning's own launcher may start more), ``torchrun``
(``python -m torch.distributed.run``), ``deepspeed`` (``python -m deepspeed.launcher.runner``) and ``mpirun``
(Open MPI). Nothing here starts a process or probes a port: :mod:`~lightning_gaudi_ds.launch.runner` picks the
port and :mod:`~lightning_gaudi_ds.launch.supervise` runs the plan. Every rank runs under the rank shim
(:mod:`~lightning_gaudi_ds.launch.rank`), started by path so that no rank imports this package once more.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_gaudi_ds import hpu
from lightning_gaudi_ds.errors import ArgumentTypeError, LaunchError
from lightning_gaudi_ds.launch import envvars, slurm
from lightning_gaudi_ds.launch._proc import ARGS_FILE_FLAG
from lightning_gaudi_ds.launch.hostfile import Host, parse_hostfile

# What remote ranks of a multi-node mpirun need from the launching shell (Open MPI passes only `-x` names): the
# execution mode and bridge flags, the visible cards, HCCL's network settings, the libraries the bridge loads.
MPI_FORWARD_PREFIXES = ("PT_HPU_", "PT_HCCL_", "HABANA_", "HCCL_", "HCL_")
MPI_FORWARD_NAMES = (
    "LD_LIBRARY_PATH", "GC_KERNEL_PATH", "HABANA_LOGS", "DEEPSPEED_USE_HPU", "TORCHINDUCTOR_COMPILE_THREADS",
    # read by Habana's DeepSpeed fork (1.20/1.21) in every rank
    "HPU_DS_OLD_SHARD_SIZE", "DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API",
    "HL_DS_DISABLE_CHECKPOINTING_COMPILE_BYPASS", "DISABLE_LOGS_WHILE_COMPILING",
)


# -------------------------------------------------------------------------------------- mpirun on Gaudi
def mpirun_binding(ranks_per_node: int, physical_cores: int | None) -> list[str]:
    """Open MPI flags that pin each rank to its own cores, as Habana's launchers do.

    Each rank gets ``physical_cores // ranks_per_node`` cores (its data loader and the bridge's host threads run
    there). Without a core count, or with fewer cores than ranks, processes are not bound.
    """
    per_rank = (physical_cores or 0) // max(ranks_per_node, 1)
    if per_rank < 1:
        return ["--bind-to", "none"]
    return ["--bind-to", "core", "--map-by", f"socket:PE={per_rank}", "--rank-by", "slot"]


def mpirun_forward_names(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The variables set in ``environ`` that remote ranks need, for ``mpirun -x NAME``."""
    return sorted(
        key for key in environ
        if key.startswith(MPI_FORWARD_PREFIXES) or key in MPI_FORWARD_NAMES
    )


RUN_DIR_ENV, RUN_ID_ENV, STOP_TIMEOUT_ENV = envvars.RUN_DIR.name, envvars.RUN_ID.name, envvars.STOP_TIMEOUT.name
RESTART_ENV, NUM_NODES_ENV, LINK_TIMEOUT_ENV = envvars.RESTART.name, envvars.NUM_NODES.name, envvars.LINK_TIMEOUT.name
RENDEZVOUS_TIMEOUT_ENV = envvars.RENDEZVOUS_TIMEOUT.name
SHIM = str(Path(__file__).resolve().with_name("rank.py"))
LAUNCHERS = ("python", "torchrun", "deepspeed", "mpirun")
# Exported by mpirun to every node: Open MPI passes only the variables named with -x to remote ranks.
_MPI_EXPORTS = ("MASTER_ADDR", "MASTER_PORT", RUN_DIR_ENV, RUN_ID_ENV, STOP_TIMEOUT_ENV, RESTART_ENV, "PYTHONPATH",
                "PYTHONUNBUFFERED", "PATH")
# DeepSpeed's ssh/pdsh launch passes to other nodes only a few prefixes and the lines of its env file, whose name
# DS_ENV_FILE sets; a Gaudi job writes its own (with the user's lines first) in the run directory.
DEEPSPEED_ENV_FILE = "DS_ENV_FILE"
DEEPSPEED_ENV_NAME = "deepspeed_env"
TORCHRUN_LOG_NAME = "torchrun"  # torchrun's own log folder in the run directory
ARGS_NAME = "argv.json"  # a launch across hosts: the script and its arguments, read by every rank's shim
# ssh keepalives (pdsh, mpirun): a host silent for link_timeout s ends the ssh session, and with it the launch.
_KEEPALIVE_PROBES = 3


@dataclass(frozen=True)
class LaunchSpec:
    """Checked launch arguments; :func:`resolve` makes one. See :class:`DistributedRunner` for their meaning."""

    launcher: str
    world_size: int
    master_addr: str
    master_port: int
    stop_timeout: float = 10.0
    hostfile: Path | None = None
    hosts: tuple[Host, ...] | None = None
    node_rank: int | None = None
    hpu_mode: hpu.Mode | None = None
    link_timeout: float = 60.0
    rendezvous_timeout: float | None = None  # LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT, given to every rank
    left_out: tuple[str, ...] = ()  # hosts of the hostfile this start leaves out (min_nodes): see :func:`shrink`
    allocation: str | None = None  # the hosts are a SLURM allocation's (its variables, for messages); the runner
    # writes their hostfile (``hostfile`` is None until then)

    @property
    def across_hosts(self) -> bool:
        """Whether this launcher starts ranks on other hosts itself (pdsh or mpirun over ssh)."""
        return (self.launcher in ("deepspeed", "mpirun") and self.hosts is not None and len(self.hosts) > 1
                and self.node_rank is None)


@dataclass(frozen=True)
class Machine:
    """What a launch command depends on from the machine that starts it."""

    python: str
    mpirun: str
    as_root: bool
    cpus: int
    gaudi: bool = False  # the Gaudi software stack is installed
    physical_cores: int | None = None
    gaudi_env: tuple[str, ...] = ()  # the Gaudi variables set in this shell, which remote ranks need

    @classmethod
    def this(cls) -> Machine:
        import psutil

        return cls(sys.executable, shutil.which("mpirun") or "mpirun", hasattr(os, "geteuid") and os.geteuid() == 0,
                   os.cpu_count() or 1, hpu.habana_frameworks_installed(), psutil.cpu_count(logical=False),
                   tuple(mpirun_forward_names(os.environ)))


def split_command(command: str) -> list[str]:
    """``"train.py --lr 0.1"`` -> argv, split with shlex (never a shell); a leading interpreter is dropped."""
    if not isinstance(command, str):
        raise ArgumentTypeError(f"command {command!r}: pass each command as one string, e.g. 'train.py --lr 0.1'.")
    argv = shlex.split(command)
    if not argv:
        raise LaunchError("an empty command: pass 'script.py args...' or '-m module args...'.")
    if argv[0] == sys.executable or re.fullmatch(r"python[0-9.]*", Path(argv[0]).name):
        argv = argv[1:]  # the launcher supplies the interpreter
    return argv


def resolve(
    world_size: int = 1,
    hostfile: str | os.PathLike | None = None,
    use_mpi: bool = False,
    use_deepspeed: bool = False,
    master_port: int = 29500,
    master_addr: str | None = None,
    node_rank: int | None = None,
    stop_timeout: float = 10.0,
    hpu_mode: hpu.Mode | None = None,
    link_timeout: float = 60.0,
    rendezvous_timeout: float | None = None,
    allocation: slurm.Allocation | None = None,
) -> LaunchSpec:
    """Check the arguments together (reading the hostfile) and pick the launcher; ``LaunchError`` says what to fix.

    ``allocation`` (the SLURM allocation this runs in, :func:`~lightning_gaudi_ds.launch.slurm.allocation`) gives the
    hosts of a DeepSpeed or mpirun launch without a hostfile; a hostfile, when given, is used instead."""
    hpu.check_mode_name(hpu_mode, "hpu_mode={}", LaunchError)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LaunchError(f"world_size={world_size!r}: pass the number of ranks, a whole number >= 1.")
    if use_mpi and use_deepspeed:
        raise LaunchError("use_mpi=True and use_deepspeed=True: pick one launcher (or neither for torchrun).")
    if isinstance(master_port, bool) or not (isinstance(master_port, int) and 0 <= master_port < 65536):
        raise LaunchError(f"master_port={master_port!r}: pass a TCP port between 1 and 65535 (0: any free port).")
    if not _seconds(stop_timeout, zero_ok=True):
        raise LaunchError(f"stop_timeout={stop_timeout!r}: pass the seconds between SIGTERM and SIGKILL when stopping"
                         " ranks, a finite number >= 0 (default 10).")
    if not _seconds(link_timeout):
        raise LaunchError(f"link_timeout={link_timeout!r}: pass the seconds after which a silent host (a lost node or"
                         " link) ends the job, a finite number > 0 (default 60).")
    path = Path(hostfile).resolve() if hostfile is not None else None
    hosts = tuple(parse_hostfile(path)) if path is not None else None
    source = None
    if hosts is None and allocation is not None and (use_mpi or use_deepspeed) and node_rank is None:
        hosts, source = allocation.hosts, allocation.source
        if world_size not in (1, allocation.world_size):
            raise slurm.AllocationError(
                f"world_size={world_size}, but the SLURM allocation has {allocation.world_size} task(s) ({source})."
                f" Pass world_size={allocation.world_size} (or leave it out), or allocate"
                " --nodes N --ntasks-per-node M with N x M = the ranks you want, or pass a hostfile.")
        world_size = allocation.world_size
    else:
        world_size = _world_size(world_size, path, hosts, node_rank, use_mpi, use_deepspeed)
    if use_mpi:
        launcher = "mpirun"
    elif use_deepspeed:
        launcher = "deepspeed"
    else:
        launcher = "python" if world_size == 1 and hosts is None else "torchrun"
    address = master_addr or (hosts[0].name if hosts and len(hosts) > 1 else "127.0.0.1")
    return LaunchSpec(launcher, world_size, address, master_port, stop_timeout, path, hosts, node_rank, hpu_mode,
                      link_timeout, rendezvous_timeout, allocation=source)


def _seconds(value: object, zero_ok: bool = False) -> bool:
    """Whether ``value`` is a finite number of seconds (> 0, or >= 0 with ``zero_ok``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if zero_ok else value > 0


def check_script(argv: Sequence[str], cwd: Path | None = None) -> None:
    """Refuse a user command whose script file is missing, or whose ``-m`` top-level package cannot be found,
    before any rank starts (every rank would fail the same way)."""
    if argv[0] == "-m":
        if len(argv) < 2:
            raise LaunchError("-m without a module name: pass '-m package.module args...'.")
        top = argv[1].split(".")[0]
        import importlib.util

        if importlib.util.find_spec(top) is None:
            raise LaunchError(f"module {argv[1]!r}: no module named {top!r} in this Python ({sys.executable}); install"
                             " it, or check PYTHONPATH and the name.")
        return
    if argv[0].startswith("-"):  # another interpreter option (-c code, -u ...): nothing to look up
        return
    script = Path(cwd or Path.cwd(), argv[0])
    if not script.is_file():
        what = "is a directory" if script.is_dir() else "does not exist"
        raise LaunchError(f"training script {argv[0]!r} {what} (looked in {script.parent}); pass the path of a Python"
                         " file, or '-m module' for a module.")


def check_log_dir(log_dir: Path) -> None:
    """Refuse a ``log_dir`` that is not a directory or cannot be created and written, before any rank starts."""
    existing = log_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == log_dir else f" ({existing} is a file)"
        raise LaunchError(f"log_dir={str(log_dir)!r}: not a directory{where}; pass a directory to keep per-rank logs.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LaunchError(f"log_dir={str(log_dir)!r}: {existing} is not writable by this user; pass a directory you"
                         " can write to.")


def _world_size(world_size: int, hostfile: Path | None, hosts: tuple[Host, ...] | None,
                node_rank: int | None, use_mpi: bool, use_deepspeed: bool) -> int:
    if hosts is None:
        if node_rank is not None:
            raise LaunchError(f"node_rank={node_rank} needs a hostfile listing every node; pass hostfile=.")
        return world_size
    total = sum(h.slots for h in hosts)
    slots = ", ".join(f"{h.name}={h.slots}" for h in hosts)
    if world_size not in (1, total):
        raise LaunchError(f"world_size={world_size} but hostfile {hostfile} has {total} slots ({slots}). Pass"
                         f" world_size={total}, or edit the hostfile's slots to the ranks you want.")
    if node_rank is not None:
        if not 0 <= node_rank < len(hosts):
            raise LaunchError(f"node_rank={node_rank}: the hostfile lists {len(hosts)} nodes;"
                              f" pass 0..{len(hosts) - 1}.")
        if use_mpi:
            raise LaunchError("node_rank with use_mpi: mpirun starts every node itself; drop node_rank.")
        if not use_deepspeed and len({h.slots for h in hosts}) > 1:
            raise LaunchError(f"torchrun starts the same number of ranks on every node, but the hostfile's slots differ"
                             f" ({slots}). Make them equal or use use_deepspeed=True.")
    elif not (use_mpi or use_deepspeed):
        raise LaunchError(
            f"hostfile={str(hostfile)!r} with torchrun: torchrun starts the ranks of one node. Run the same command"
            " on each node with node_rank=I (CLI: --node_rank I), or launch every node from here with"
            " use_deepspeed=True or use_mpi=True."
        )
    return total


def launch_argv(spec: LaunchSpec, user: Sequence[str], port: int, machine: Machine,
                args_file: Path | None = None, run_dir: Path | None = None) -> list[str]:
    """The argv that starts ``user`` (script or ``-m module``, and its arguments) on every rank of ``spec``.

    With ``args_file`` (a launch across hosts, where a remote shell parses the command line) the ranks read
    ``user`` from that file instead: the command line carries only its path. With ``run_dir``, torchrun keeps its
    own logs in ``<run_dir>/torchrun`` (without one it leaves a ``torchelastic_*`` folder in the system's temp
    directory)."""
    py, shim, user = machine.python, [SHIM], list(user)
    if args_file is not None:
        user = [ARGS_FILE_FLAG, str(args_file)]
    if spec.launcher == "mpirun":
        cmd = [machine.mpirun, "-np", str(spec.world_size)]
        exports = list(_MPI_EXPORTS)
        if spec.rendezvous_timeout is not None:
            exports.append(RENDEZVOUS_TIMEOUT_ENV)
        if spec.left_out:
            exports.append(NUM_NODES_ENV)
        if spec.across_hosts:
            exports.append(LINK_TIMEOUT_ENV)
        if _gaudi(spec, machine):
            # Habana's launchers pin each rank to its share of the cores; remote ranks need the mode and the
            # Gaudi settings of this shell.
            per_node = max(h.slots for h in spec.hosts) if spec.hosts else spec.world_size
            cmd += mpirun_binding(per_node, machine.physical_cores)
            exports += [key for key in [hpu.LAZY_MODE_ENV, *machine.gaudi_env] if key not in exports]
        else:
            cmd += ["--bind-to", "none"]
        if machine.as_root:
            cmd.append("--allow-run-as-root")
        if spec.hosts is not None:
            cmd += ["--hostfile", str(spec.hostfile)]
        elif spec.world_size > machine.cpus:
            cmd.append("--oversubscribe")
        for key in exports:
            cmd += ["-x", key]
        return [*cmd, py, "-u", *shim, *user]
    if spec.launcher == "deepspeed":
        cmd = [py, "-u", "-m", "deepspeed.launcher.runner", "--master_addr", spec.master_addr, "--master_port",
               str(port), "--no_local_rank"]
        if spec.hosts is None:
            cmd += ["--num_nodes", "1", "--num_gpus", str(spec.world_size)]
        else:
            cmd += ["--hostfile", str(spec.hostfile)]
            if spec.node_rank is not None:
                cmd += ["--no_ssh", "--node_rank", str(spec.node_rank)]
            elif len(spec.hosts) == 1:
                cmd += ["--no_ssh_check"]  # one host: DeepSpeed launches locally, ssh is never used
        return [*cmd, *shim, *user]
    if spec.launcher == "python":
        return [py, "-u", *shim, *user]
    if spec.hosts is not None and spec.node_rank is not None:
        nnodes, per_node, node_rank = len(spec.hosts), spec.hosts[spec.node_rank].slots, spec.node_rank
    else:
        nnodes, per_node, node_rank = 1, spec.world_size, 0
    rdzv = []
    if nnodes > 1:  # torchrun's own rendezvous comes before any rank: bound it by the project's rendezvous timeout
        limit = spec.rendezvous_timeout or envvars.RENDEZVOUS_TIMEOUT.default
        rdzv = ["--rdzv-conf", f"timeout={math.ceil(limit)}"]
    logs = ["--log-dir", str(run_dir / TORCHRUN_LOG_NAME)] if run_dir is not None else []
    return [py, "-u", "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", str(per_node),
            "--node_rank", str(node_rank), "--master_addr", spec.master_addr, "--master_port", str(port),
            "--max_restarts", "0", "--monitor_interval", "0.5", *logs, *rdzv, *shim, *user]


def launch_env(spec: LaunchSpec, base: Mapping[str, str], run_dir: Path, token: str, port: int,
               machine: Machine, restart: int = 0) -> dict[str, str]:
    """``base`` (the runner's environment) plus what the launcher and the rank shims need; ``restart``: which
    restart of the job this start is (0: the first start). A launcher that starts the ranks itself gives them no
    SLURM job variable: inside an allocation they are its ranks, not srun's tasks."""
    env = dict(base) if spec.launcher == "python" else slurm.without_slurm(base)
    env.update({RUN_DIR_ENV: str(run_dir), RUN_ID_ENV: token, "MASTER_ADDR": spec.master_addr,
                "MASTER_PORT": str(port), STOP_TIMEOUT_ENV: str(spec.stop_timeout), RESTART_ENV: str(restart)})
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONPATH", "")
    if spec.rendezvous_timeout is not None:
        env[RENDEZVOUS_TIMEOUT_ENV] = f"{spec.rendezvous_timeout:g}"
    env.pop(NUM_NODES_ENV, None)  # only a start that left hosts out says how many nodes it has
    if spec.left_out and spec.hosts is not None:
        env[NUM_NODES_ENV] = str(len(spec.hosts))
    if spec.across_hosts:
        interval = max(1, math.ceil(spec.link_timeout / _KEEPALIVE_PROBES))
        keepalive = f"-o ServerAliveInterval={interval} -o ServerAliveCountMax={_KEEPALIVE_PROBES}"
        key = "OMPI_MCA_plm_rsh_args" if spec.launcher == "mpirun" else "PDSH_SSH_ARGS_APPEND"
        env[key] = f"{base[key]} {keepalive}" if base.get(key) else keepalive
        env[LINK_TIMEOUT_ENV] = f"{spec.link_timeout:g}"  # the shims' bound on the supervisor's heartbeat
        if spec.launcher == "mpirun":
            # Each remote orted's lifeline to mpirun: TCP keepalives, so a daemon behind a lost link ends too
            # (Open MPI's default: 300 s idle, then 9 probes 20 s apart).
            for name, value in (("time", interval), ("intvl", interval), ("probes", _KEEPALIVE_PROBES)):
                env.setdefault(f"OMPI_MCA_oob_tcp_keepalive_{name}", str(value))
    if spec.launcher == "mpirun":
        if machine.as_root:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    else:
        # Lightning probes MPI in every rank (mpi4py's MPI_Init); without this Open MPI starts a daemon each.
        env.setdefault("OMPI_MCA_ess_singleton_isolated", "1")
    if _gaudi(spec, machine):
        # habana_frameworks picks its mode at import in each rank: every rank gets it spelled out, and the defaults.
        env.update(hpu.rank_env(spec.hpu_mode or hpu.mode_from_env(base), base))
    if spec.launcher == "deepspeed" and spec.across_hosts:
        env[DEEPSPEED_ENV_FILE] = str(run_dir / DEEPSPEED_ENV_NAME)
    return env


def _gaudi(spec: LaunchSpec, machine: Machine) -> bool:
    return machine.gaudi or spec.hpu_mode is not None


# What every rank of a pdsh launch must see besides the PYTHON* variables DeepSpeed forwards by itself.
_DEEPSPEED_EXPORTS = (RUN_DIR_ENV, RUN_ID_ENV, STOP_TIMEOUT_ENV, RESTART_ENV, RENDEZVOUS_TIMEOUT_ENV, LINK_TIMEOUT_ENV,
                      NUM_NODES_ENV, "OMPI_MCA_ess_singleton_isolated", "PATH")
# DeepSpeed writes each line as `export KEY="value";` into the remote shell's command (0.16 always quotes, 0.19 when
# the value has other characters than these): inside double quotes these characters would still be interpreted.
_SHELL_ACTIVE = re.compile(r'["$`\\\n\r]')


def deepspeed_env_text(env: Mapping[str, str], user_lines: str = "") -> str:
    """DeepSpeed's env file for a launch over pdsh: the user's own lines, then the project's settings and the Gaudi
    variables of ``env``. A value a remote shell would interpret is refused (``ValueError``) before anything starts."""
    names = [key for key in _DEEPSPEED_EXPORTS if key in env]
    names += [key for key in mpirun_forward_names(env) if key not in names]
    for key in names:
        if _SHELL_ACTIVE.search(env[key]):
            raise LaunchError(f"{key}={env[key]!r}: DeepSpeed's pdsh launch hands this variable to a remote shell,"
                             " which would interpret its \", $, `, \\ or line break. Remove those characters, or"
                             " launch with use_mpi=True or per node (node_rank).")
    ours = "".join(f"{key}={env[key]}\n" for key in names)
    return (user_lines if not user_lines or user_lines.endswith("\n") else user_lines + "\n") + ours


# ------------------------------------------------------------------------ min_nodes: fewer hosts on a restart
def check_min_nodes(min_nodes: object, spec: LaunchSpec, max_restarts: int) -> None:
    """Refuse a ``min_nodes`` that cannot apply to ``spec`` (``ValueError`` naming the value and the fix)."""
    if min_nodes is None:
        return
    if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) or min_nodes < 1:
        raise LaunchError(f"min_nodes={min_nodes!r}: pass the fewest hosts a restart may run on, a whole number >= 1,"
                         " or None to restart on every host of the hostfile.")
    if spec.hosts is None:
        raise LaunchError(f"min_nodes={min_nodes} needs a hostfile: it says how many of its hosts a restart may run"
                         " on. Pass hostfile= (CLI: --hostfile), or drop min_nodes.")
    if spec.node_rank is not None or spec.launcher not in ("deepspeed", "mpirun"):
        raise LaunchError(f"min_nodes={min_nodes} with node_rank={spec.node_rank}: a runner started per node cannot"
                         " leave other nodes out. Launch every node from here (use_deepspeed=True or use_mpi=True,"
                         " no node_rank), or drop min_nodes.")
    if min_nodes > len(spec.hosts):
        raise LaunchError(f"min_nodes={min_nodes}, but hostfile {spec.hostfile} lists {len(spec.hosts)} host(s);"
                         f" pass 1..{len(spec.hosts)}.")
    if max_restarts < 1:
        raise LaunchError(f"min_nodes={min_nodes} applies when the job restarts, but max_restarts={max_restarts};"
                         " pass max_restarts >= 1 (CLI: --max_restarts N), or drop min_nodes.")


@dataclass(frozen=True)
class HostChoice:
    """The hosts a restart runs on (hostfile order) and those it leaves out, each with why."""

    kept: tuple[Host, ...]
    left_out: tuple[tuple[Host, str], ...]

    @property
    def world_size(self) -> int:
        return sum(h.slots for h in self.kept)


def select_hosts(hosts: Sequence[Host], unreachable: Mapping[str, str], min_nodes: int) -> HostChoice | None:
    """The hosts of ``hosts`` not in ``unreachable`` (host name -> why), or None when fewer than ``min_nodes``."""
    kept = tuple(h for h in hosts if h.name not in unreachable)
    if len(kept) < min_nodes:
        return None
    return HostChoice(kept, tuple((h, unreachable[h.name]) for h in hosts if h.name in unreachable))


def shrink(spec: LaunchSpec, choice: HostChoice, hostfile: Path) -> LaunchSpec:
    """``spec`` on ``choice.kept`` only, whose hostfile the caller writes to ``hostfile`` (:func:`hostfile_text`).
    The rendezvous moves to the first kept host when its address was a host left out."""
    gone = {h.name for h, _ in choice.left_out}
    address = choice.kept[0].name if spec.master_addr in gone else spec.master_addr
    return replace(spec, world_size=choice.world_size, master_addr=address, hostfile=hostfile, hosts=choice.kept,
                   left_out=tuple(sorted(gone)))


def hostfile_text(hosts: Sequence[Host]) -> str:
    return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)
