"""Small process helpers shared by the runner, the rank shim, the cluster environments, tests and benchmarks.

Standard library only: the rank shim runs this file's directory as a script directory (it is started by path so
that no rank imports the package, Lightning or DeepSpeed once more), and imports this module as a sibling.
"""

from __future__ import annotations

import ctypes
import errno
import random
import signal
import socket
import sys
from typing import Any

PREFIX = "lightning-gaudi-ds:"
# The package's environment variables (the run directory, the stop and link timeouts, the restart count, ...) are
# in the sibling module envvars.py.
# The shim's flag for a launch across hosts: the script and its arguments are read from this JSON file.
ARGS_FILE_FLAG = "--lgds-args-file"
# Launches across hosts: the supervisor's heartbeat in the run directory, which a rank watches (envvars.LINK_TIMEOUT).
HEARTBEAT_NAME = "supervisor.alive"
# A rank's exit code after SIGTERM (preemption) once it saved a checkpoint at a step boundary: sysexits.h's
# EX_TEMPFAIL ("a temporary failure; try again"), apart from failures and from 143 (killed by SIGTERM unsaved).
PREEMPTED_EXIT = 75
# A traceback counts as the start of a rank's failure when the rank exits (or is still exiting) within this many
# seconds of it; tracebacks closer together than this are one burst, timed from its first. An earlier one was handled
# (logged and survived), and does not make the rank the cause of a later failure.
FAILING_WINDOW_S = 30.0

# How MPI launchers announce a process's global rank and the world size: Open MPI (OMPI_COMM_WORLD_*), MPICH and
# Intel MPI (PMI_*), MVAPICH2 (MV2_*). A PMIx server (Open MPI 4+, Slurm's --mpi=pmix) exports PMIX_RANK but no
# size variable: processes ask PMIx for the size (checked with Open MPI 4.1's mpirun).
MPI_RANK_KEYS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
MPI_SIZE_KEYS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def say(message: str, prefix: str = PREFIX) -> None:
    """One line on stderr, prefixed with the command's name (or ``prefix``)."""
    sys.stderr.write(f"{prefix} {message}\n")
    sys.stderr.flush()


def exit_code(returncode: int) -> int:
    """A process's status as a shell reports it: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``exit code 3``, ``signal SIGKILL`` or ``exit code 137 (signal SIGKILL)``."""
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    if returncode > 128 and returncode - 128 in signal.valid_signals():
        return f"exit code {returncode} (signal {signal.Signals(returncode - 128).name})"
    if returncode == PREEMPTED_EXIT:
        return f"exit code {returncode} (preempted: SIGTERM, checkpoint saved)"
    return f"exit code {returncode}"


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports and ``bind(port=0)`` (Linux; IANA's elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A TCP port free on every interface of this host right now, chosen outside the kernel's ephemeral range.

    A port the OS hands out for ``bind(0)`` comes from the range every outgoing connection also takes its source
    port from: in the seconds before rank 0 binds it (mpirun and ssh open connections meanwhile) another process
    can get it (EADDRINUSE). Outside that range (from 20000 up to it, or above it) only an explicit ``bind`` takes a
    port, so the pick stays free unless another process picks the same one.
    """
    low, high = _ephemeral_ports()
    outside = [*range(20000, low), *range(high + 1, 65536)]
    if outside:
        rng = random.Random()  # its own generator: the user's random state is theirs
        for port in rng.sample(outside, min(64, len(outside))):
            if port_in_use(port) is False:
                return port
    with socket.socket() as s:  # no port outside the range, or none of them free: the OS's pick
        s.bind(("", 0))
        return s.getsockname()[1]


def port_in_use(port: int, address: str = "") -> bool | None:
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


def is_local_address(address: str) -> bool:
    """Whether ``address`` names this host (binding works only on this host's addresses)."""
    if address in ("127.0.0.1", "localhost", "0.0.0.0", "::1", socket.gethostname()):
        return True
    return port_in_use(0, address) is not None


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
try:
    _prctl: Any | None = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
    _prctl = None


def signal_when_parent_dies(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere nothing).

    Meant as ``preexec_fn``: it runs in the child between fork and exec, where only async-signal-safe work is
    allowed, so it makes one C call and takes no Python-level lock.
    """
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
