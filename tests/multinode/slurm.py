"""A real SLURM cluster on the two hosts of tests/multinode/cluster.py: Debian's munge on both, slurmctld on n0,
slurmd on n0 and n1, as two nodes of one partition.

Everything a node keeps is in the session's temp root: the munge key, each host's munge socket, slurm.conf, state,
spool and logs. Each host sees its own munge socket and the cluster's configuration at SLURM's default paths through
bind mounts in its own mount namespace (``/etc/slurm``, and the socket's folder), so every SLURM command and daemon
finds them as on a real node, and nothing changes outside the namespaces. The plugins are those that work in this
sandbox: process tracking by the process tree (``proctrack/linuxproc``), no task binding (``task/none``), and
cgroup v1 pointed at an empty folder (``ip netns exec`` hides the machine's cgroups; slurmd only loads the plugin).

The timeouts are short so that the tests stay short, each a knob a real cluster has: a silent slurmd is DOWN after
:data:`SLURMD_TIMEOUT` s, a job's processes get :data:`KILL_WAIT` s between SIGTERM and SIGKILL, and a requeued job
waits :data:`CRED_EXPIRE` s (the job credential's lifetime) before it starts again.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.multinode.cluster import Cluster, Unavailable

DAEMONS = ("munged", "slurmctld", "slurmd")
TOOLS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "salloc", "scontrol", "scancel", "sinfo",
         "squeue")
SLURMD_TIMEOUT = 6  # s: slurmctld marks a node DOWN (and kills or requeues its jobs) after this much silence
KILL_WAIT = 4  # s: SIGTERM -> SIGKILL when SLURM ends a job's processes
CRED_EXPIRE = 5  # s: how long a requeued job waits before it starts again
# and the scheduler looks at pending jobs every second (sched_interval, 60 s by default), so that it starts then
CPUS = 2  # per node: what each host's slurmd finds (both share the machine's cores)


def _conf(d: Path, cluster: Cluster) -> str:
    nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={CPUS} State=UNKNOWN\n" for h in cluster.hosts)
    names = ",".join(h.name for h in cluster.hosts)
    return f"""ClusterName=lgds
SlurmctldHost={cluster.hosts[0].name}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d / "munge" / "munge.socket.2"},cred_expire={CRED_EXPIRE}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
PlugStackConfig={d / "etc" / "plugstack.conf"}
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d}/%n/spool
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d}/%n/slurmd.pid
SlurmctldLogFile={d / "log" / "slurmctld.log"}
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT}
SlurmctldTimeout=10
MessageTimeout=5
KillWait={KILL_WAIT}
InactiveLimit=0
MinJobAge=600
JobRequeue=1
{nodes}PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Slurm:
    """The SLURM cluster on ``cluster``; its files under :attr:`dir`."""

    cluster: Cluster
    dir: Path

    # ------------------------------------------------------------------------------------------------ commands
    def argv(self, host: int, *args: str, cwd: Path | None = None) -> list[str]:
        return [*self.cluster.hosts[host].enter(cwd or self.cluster.root), *args]

    def run(self, *args: str, host: int = 0, env: Mapping[str, str] | None = None, check: bool = True,
            timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A SLURM command on host ``host`` (n0 by default), with ``env`` (default: this process's)."""
        done = subprocess.run(self.argv(host, *args, cwd=cwd), capture_output=True, text=True, timeout=timeout,
                              env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise AssertionError(f"`{' '.join(args)}` on n{host} failed ({done.returncode}):"
                                 f" {done.stderr.strip()[-2000:]}")
        return done

    def sbatch(self, script: Path, *options: str, args: Sequence[str] = (), env: Mapping[str, str], cwd: Path) -> int:
        """Submit ``script`` with ``args`` from n0 (in ``cwd``, exporting ``env``); the job id."""
        done = self.run("sbatch", "--parsable", *options, str(script), *args, env=env, cwd=cwd)
        return int(done.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``{}`` once the job is gone)."""
        done = self.run("scontrol", "show", "job", "-o", str(job), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def wait_job(self, job: int, states: Sequence[str], timeout: float, count: int = 0) -> dict[str, str]:
        """Wait until the job is in one of ``states`` (with ``Restarts`` >= ``count``); its record then."""
        deadline, info = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            info = self.job(job)
            if info.get("JobState") in states and int(info.get("Restarts", 0)) >= count:
                return info
            time.sleep(0.3)
        raise AssertionError(f"job {job} not in {states} (restarts >= {count}) within {timeout:.0f}s: {info}\n"
                             f"{self.log('slurmctld.log')[-3000:]}")

    def node_states(self) -> dict[str, str]:
        done = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)

    def log(self, name: str) -> str:
        path = self.dir / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""

    # ----------------------------------------------------------------------------------------------- daemons
    def _running(self, host: int, program: str) -> bool:
        return any(os.path.basename(cmd.split(" ", 1)[0]).rstrip(":") == program
                   for _, cmd in self.cluster.hosts[host].processes())

    def _daemon(self, host: int, *argv: str) -> None:
        done = subprocess.run(self.argv(host, *argv), capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            name = self.cluster.hosts[host].name
            raise Unavailable(f"`{' '.join(argv)}` on {name} failed ({done.returncode}): {done.stderr.strip()[-300:]}"
                              f" {self.log(f'slurmd-{name}.log')[-300:]}")

    def ensure_up(self, timeout: float = 60) -> None:
        """Start whichever daemon is not running, and wait until every node is idle (the state a test starts in)."""
        d = self.dir
        for index, host in enumerate(self.cluster.hosts):
            if not self._running(index, "munged"):
                self._daemon(index, "/usr/sbin/munged", "--force", f"--key-file={d / 'munge.key'}",
                             f"--socket={d / 'munge' / 'munge.socket.2'}", f"--pid-file={d / 'munge' / 'munged.pid'}",
                             f"--log-file={d / 'log' / f'munged-{host.name}.log'}",
                             f"--seed-file={d / host.name / 'munged.seed'}")
        if not self._running(0, "slurmctld"):
            self._daemon(0, "/usr/sbin/slurmctld")
        for index in range(len(self.cluster.hosts)):
            if not self._running(index, "slurmd"):
                self._daemon(index, "/usr/sbin/slurmd")
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if sorted(states) == sorted(h.name for h in self.cluster.hosts) and set(states.values()) == {"idle"}:
                return
            if time.monotonic() > deadline:
                raise Unavailable(f"the SLURM nodes are not idle after {timeout:.0f} s: {states}\n"
                                  f"{self.log('slurmctld.log')[-1500:]}")
            time.sleep(0.3)


def start(cluster: Cluster) -> Slurm:
    """munge and SLURM on ``cluster``'s hosts; :class:`Unavailable` (the SLURM tests skip, saying why) when this
    machine lacks them or they cannot start here."""
    missing = [tool for tool in TOOLS if shutil.which(tool, path=f"/usr/sbin:/usr/bin:{os.environ.get('PATH', '')}")
               is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not installed (bash scripts/setup.sh installs Debian's slurmd,"
                          " slurmctld, slurm-client and munge)")
    if not Path("/etc/slurm").is_dir():
        raise Unavailable("/etc/slurm does not exist (the slurm packages make it); each host mounts its config there")
    d = cluster.root / "slurm"
    for sub in ("etc", "state", "log", "munge", *(h.name for h in cluster.hosts),
                *(f"{h.name}/munge" for h in cluster.hosts), *(f"{h.name}/spool" for h in cluster.hosts)):
        (d / sub).mkdir(parents=True, exist_ok=True)
    fd = os.open(d / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    (d / "etc" / "plugstack.conf").write_text("")
    (d / "etc" / "slurm.conf").write_text(_conf(d, cluster))
    # only for slurmd's start: no cgroup plugin is used (proctrack/linuxproc, task/none)
    (d / "etc" / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={d / 'cgroup'}\n"
                                           "CgroupAutomount=no\n")
    (d / "cgroup").mkdir()
    slurm = Slurm(cluster, d)
    for host in cluster.hosts:
        for source, target in ((d / host.name / "munge", d / "munge"), (d / "etc", Path("/etc/slurm"))):
            done = subprocess.run(["nsenter", "-t", str(host.init_pid), "-m", "--", "mount", "--bind", str(source),
                                   str(target)], capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise Unavailable(f"cannot bind-mount {source} on {target} in {host.name}: {done.stderr.strip()}")
    cluster.daemons = DAEMONS
    slurm.ensure_up()
    return slurm
