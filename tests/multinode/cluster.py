"""Two hosts on one machine for the multi-node tier: network namespaces joined by a veth pair on private addresses
that exist only inside them (no route out, nothing in the root namespace), each host with its own sshd (root login
by a key made for the session), hostname (UTS namespace), pid namespace and /etc/hosts (mount namespace), sharing
the filesystem as a cluster shares NFS.

Launchers run "on n0" by entering n0's namespaces (nsenter); they reach n1 (and n0) over ssh through an ``ssh``
wrapper first on PATH that reads the session's ssh config. Every process of a host lives in its pid namespace, whose
init is that host's sshd: killing it ends them all, which is the teardown.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.77"
_MADE = itertools.count()  # clusters made by this process: each gets namespaces of its own names


class Unavailable(Exception):
    """What this machine lacks to make the hosts (the tier is skipped, saying so)."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise Unavailable(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()[:300]}")
    return result


@dataclass
class Host:
    name: str
    address: str
    netns: str
    veth: str
    sshd: subprocess.Popen | None = None
    init_pid: int = 0  # sshd, pid 1 of the host's pid namespace, as this namespace sees it

    def pid_namespace(self) -> str:
        return os.readlink(f"/proc/{self.init_pid}/ns/pid")

    def processes(self) -> list[tuple[int, str]]:
        """Every process of this host but its sshd listener: (pid here, command line)."""
        ns, found = self.pid_namespace(), []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.init_pid:
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            found.append((int(entry), cmd))
        return found

    def enter(self, cwd: Path | None = None) -> list[str]:
        """The argv prefix that runs a command on this host (its network, hostname, mounts and pids) in ``cwd``."""
        return ["nsenter", "-t", str(self.init_pid), "-n", "-u", "-m", "-p", f"--wd={cwd or '/'}", "--"]

    def link(self, up: bool) -> None:
        _run("ip", "-n", self.netns, "link", "set", self.veth, "up" if up else "down")


@dataclass
class Cluster:
    root: Path
    hosts: list[Host] = field(default_factory=list)
    daemons: tuple[str, ...] = ()  # programs that belong to the hosts, not to a job (tests/multinode/slurm.py's)

    def job_processes(self, index: int) -> list[tuple[int, str]]:
        """Host ``index``'s processes but its sshd listener and :attr:`daemons`."""
        return [(pid, cmd) for pid, cmd in self.hosts[index].processes()
                if os.path.basename(cmd.split(" ", 1)[0]).rstrip(":") not in self.daemons]

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def hostfile(self, slots: int = 1, names: list[str] | None = None) -> Path:
        path = self.root / f"hostfile-{slots}"
        path.write_text("".join(f"{h.name} slots={slots}\n" for h in self.hosts if names is None or h.name in names))
        return path

    def env(self) -> dict[str, str]:
        """What a launcher on n0 needs: the ssh wrapper first on PATH."""
        return {"PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def leftovers(self) -> dict[str, list[tuple[int, str]]]:
        found = {h.name: self.job_processes(i) for i, h in enumerate(self.hosts)}
        return {name: procs for name, procs in found.items() if procs}

    def wait_clean(self, timeout: float) -> dict[str, list[tuple[int, str]]]:
        deadline = time.monotonic() + timeout
        left = self.leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = self.leftovers()
        return left

    def kill_leftovers(self) -> None:
        for index in range(len(self.hosts)):
            self.kill_leftovers_on(index)

    def kill_leftovers_on(self, index: int) -> None:
        """SIGKILL every process of host ``index`` but its sshd listener and :attr:`daemons`."""
        for pid, _ in self.job_processes(index):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _check_tools() -> None:
    for tool in ("ip", "unshare", "nsenter", "ssh", "ssh-keygen", "pdsh", "mpirun"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} is not installed (bash scripts/setup.sh installs openssh, pdsh and Open MPI)")
    if not Path("/usr/sbin/sshd").exists():
        raise Unavailable("/usr/sbin/sshd is not installed (apt-get install openssh-server)")
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")


def start(root: Path) -> Cluster:
    """Bring up n0 and n1; on any failure, tear down what was made and raise :class:`Unavailable`."""
    _check_tools()
    cluster = Cluster(root)
    tag = f"lgds{os.getpid()}c{next(_MADE)}"
    try:
        _start(cluster, tag)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def _start(cluster: Cluster, tag: str) -> None:
    root = cluster.root
    root.chmod(0o755)
    cluster.hosts = [Host(f"n{i}", f"{SUBNET}.{i + 1}", f"{tag}n{i}", f"veth{i}") for i in range(2)]
    for host in cluster.hosts:
        _run("ip", "netns", "add", host.netns)
        _run("ip", "-n", host.netns, "link", "set", "lo", "up")
    n0, n1 = cluster.hosts
    _run("ip", "-n", n0.netns, "link", "add", n0.veth, "type", "veth", "peer", "name", n1.veth, "netns", n1.netns)
    for host in cluster.hosts:
        _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.veth)
        host.link(True)
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "id"))
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "hostkey"))
    shutil.copy(root / "id.pub", root / "authorized_keys")
    (root / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in cluster.hosts))
    (root / "ssh_config").write_text(
        "Host *\n  User root\n  IdentityFile {id}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n  ConnectTimeout 10\n"
        .format(id=root / "id"))
    cluster.bin.mkdir()
    wrapper = cluster.bin / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {root / "ssh_config"} "$@"\n')
    wrapper.chmod(0o755)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    for host in cluster.hosts:
        config = root / f"sshd_{host.name}"
        config.write_text(
            f"ListenAddress {host.address}\nHostKey {root / 'hostkey'}\nPidFile none\n"
            f"AuthorizedKeysFile {root / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            # what a cluster's sshd does: end the session of a client that no longer answers
            "ClientAliveInterval 2\nClientAliveCountMax 3\nMaxStartups 100\nMaxSessions 100\nLogLevel ERROR\n")
        script = (f"mount --bind {root / 'hosts'} /etc/hosts && hostname {host.name}"
                  f" && exec /usr/sbin/sshd -D -e -f {config}")
        host.sshd = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc",
             "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(root / f"sshd_{host.name}.log", "wb"),
            start_new_session=True)
    for host in cluster.hosts:
        host.init_pid = _child_of(host)
    deadline = time.monotonic() + 30
    for host in cluster.hosts:
        while True:
            probe = _run(*n0.enter(), str(wrapper), host.name, "hostname", check=False)
            if probe.returncode == 0 and probe.stdout.strip() == host.name:
                break
            if time.monotonic() > deadline:
                log = (root / f"sshd_{host.name}.log").read_text()[-500:]
                raise Unavailable(f"ssh from n0 to {host.name} did not work: {probe.stderr.strip()[:300]} {log}")
            time.sleep(0.3)


def _child_of(host: Host) -> int:
    """The sshd that unshare forked (pid 1 of the host's pid namespace)."""
    assert host.sshd is not None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if host.sshd.poll() is not None:
            raise Unavailable(f"sshd for {host.name} exited ({host.sshd.returncode}): unshare/mount not permitted?")
        try:
            with open(f"/proc/{host.sshd.pid}/task/{host.sshd.pid}/children") as f:
                children = f.read().split()
        except OSError:
            children = []
        if children:
            pid = int(children[0])
            try:
                if "sshd" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    return pid
            except OSError:
                pass
        time.sleep(0.1)
    raise Unavailable(f"sshd for {host.name} did not start")


def stop(cluster: Cluster) -> None:
    """Kill every process of both hosts (their pid namespaces' init, which takes the rest along) and delete the
    namespaces. Only processes in the namespaces made here are signalled."""
    for host in cluster.hosts:
        if host.init_pid:
            for pid, _ in host.processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.kill(host.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if host.sshd is not None:
            try:
                host.sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                host.sshd.kill()
                host.sshd.wait()
    for host in cluster.hosts:
        _run("ip", "netns", "del", host.netns, check=False)


def make_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="lgds-multinode-"))
