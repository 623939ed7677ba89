"""A SLURM allocation as the hosts of a launch, read from the variables ``salloc`` and ``sbatch`` set.

``SLURM_JOB_NODELIST`` is a hostlist expression (``n[0-3,7]``, ``rack[1-2]-gpu[01-04]``, ``a1,b[2-3]``), expanded as
``scontrol show hostnames`` does, without running it; ``SLURM_TASKS_PER_NODE`` (``8(x2),4``) gives each node's
ranks, and ``SLURM_NTASKS_PER_NODE`` (set by ``--ntasks-per-node``) must agree with it. Standard library only, as
:mod:`~lightning_gaudi_ds.launch.hostfile` (``lightning-gaudi-ds spawn`` starts without torch).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_gaudi_ds.errors import AllocationError
from lightning_gaudi_ds.launch.hostfile import Host

__all__ = ["AllocationError", "Allocation", "allocation", "expand_hostlist", "expand_tasks_per_node",
           "job_id", "requeue", "restart_count", "without_slurm"]

NODELIST_KEYS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
NUM_NODES_KEYS = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")
RESTART_COUNT = "SLURM_RESTART_COUNT"
_HOW = ("Run `lightning-gaudi-ds spawn` once, from the batch script or the salloc shell, with the allocation's"
        " variables as SLURM set them (or pass --hostfile, which takes precedence).")


@dataclass(frozen=True)
class Allocation:
    """The allocation's nodes in SLURM's order, each with its ranks (``Host.line``: its position, from 1), and the
    variables they were read from, for messages."""

    hosts: tuple[Host, ...]
    source: str

    @property
    def world_size(self) -> int:
        return sum(h.slots for h in self.hosts)


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise AllocationError("nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise AllocationError("a ']' without its '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise AllocationError("a '[' without its ']'")
    parts.append(text[start:])
    return parts


def _range(spec: str) -> list[str]:
    """``01-03`` -> ``01 02 03`` (zero padding kept, as SLURM does), ``7`` -> ``7``."""
    low, sep, high = spec.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise AllocationError(f"range {spec!r} is not N or N-M")
    if not sep:
        return [low]
    if int(high) < int(low):
        raise AllocationError(f"range {spec!r} goes down")
    width = len(low) if low.startswith("0") or len(low) == len(high) else 0
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def _expand_one(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    numbers = [n for spec in match.group(1).split(",") for n in _range(spec.strip())]
    return [head + n + rest for n in numbers for rest in _expand_one(tail)]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's hostlist expression as ``scontrol show hostnames`` prints it: ``n[0-1],gpu[08-10]`` ->
    ``n0 n1 gpu08 gpu09 gpu10``. ``ValueError`` for text SLURM would not write."""
    if not text.strip():
        raise AllocationError("empty")
    names: list[str] = []
    for part in _split_top(text.strip()):
        if not part or part.strip() != part:
            raise AllocationError(f"empty or spaced entry {part!r}")
        names.extend(_expand_one(part))
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise AllocationError(f"{part!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def allocation(environ: Mapping[str, str] = os.environ) -> Allocation | None:
    """The hosts of the SLURM allocation this process runs in, each with ``SLURM_TASKS_PER_NODE``'s ranks; None
    outside one (no ``SLURM_JOB_ID`` or no node list). :class:`AllocationError` names the variable that cannot be
    read, or the two that disagree."""
    key = next((k for k in NODELIST_KEYS if environ.get(k)), None)
    if not environ.get("SLURM_JOB_ID") or key is None:
        return None
    nodelist, tasks = environ[key], environ.get(TASKS_PER_NODE, "")
    try:
        names = expand_hostlist(nodelist)
    except ValueError as err:
        raise AllocationError(f"{key}={nodelist!r} is not a SLURM hostlist ({err}). {_HOW}") from None
    if len(set(names)) != len(names):
        raise AllocationError(f"{key}={nodelist!r} lists a node twice. {_HOW}")
    source = f"{key}={nodelist}"
    nodes_key = next((k for k in NUM_NODES_KEYS if environ.get(k)), None)
    if nodes_key is not None and environ[nodes_key].strip() != str(len(names)):
        raise AllocationError(f"{source} names {len(names)} node(s), but {nodes_key}={environ[nodes_key]}. {_HOW}")
    if not tasks:
        raise AllocationError(f"{source} is set, but {TASKS_PER_NODE} is not: how many ranks each node runs is"
                              f" unknown. Allocate with --ntasks-per-node N (salloc/sbatch), or pass --hostfile.")
    try:
        counts = expand_tasks_per_node(tasks)
    except ValueError as err:
        raise AllocationError(f"{TASKS_PER_NODE}={tasks!r} is not SLURM's N(xM),... form ({err}). {_HOW}") from None
    if len(counts) != len(names) or min(counts) < 1:
        raise AllocationError(f"{TASKS_PER_NODE}={tasks} gives {len(counts)} node(s) their ranks, but {source} names"
                              f" {len(names)}. {_HOW}")
    per_node = environ.get(NTASKS_PER_NODE, "").strip()
    if per_node and any(str(c) != per_node for c in counts):
        raise AllocationError(f"{NTASKS_PER_NODE}={per_node} (--ntasks-per-node) disagrees with {TASKS_PER_NODE}="
                              f"{tasks}: allocate with one of --ntasks-per-node or --ntasks, or pass --hostfile.")
    hosts = tuple(Host(name, count, index) for index, (name, count) in enumerate(zip(names, counts,
                                                                                      strict=True), start=1))
    return Allocation(hosts, f"{source}, {TASKS_PER_NODE}={tasks}")


def restart_count(environ: Mapping[str, str] = os.environ) -> int:
    """How often SLURM requeued this job (``SLURM_RESTART_COUNT``; 0 when unset or unreadable)."""
    text = environ.get(RESTART_COUNT, "").strip()
    return int(text) if text.isdigit() else 0


def without_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less SLURM's job variables: ranks that another launcher starts inside an allocation are not
    srun's tasks (Lightning would take ``SLURM_NTASKS`` and ``SLURM_PROCID`` for theirs, and Open MPI would start
    its daemons with srun)."""
    return {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}


def job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """This job's id as ``scontrol`` takes it (an array task's ``<array job>_<task>``, as Lightning's requeue)."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID", ""), environ.get("SLURM_ARRAY_TASK_ID", "")
    found = f"{array}_{task}" if array and task else environ.get("SLURM_JOB_ID", "")
    return found if re.fullmatch(r"\d+(_\d+)?", found) else None


def requeue(environ: Mapping[str, str] = os.environ, timeout: float = 30.0) -> tuple[bool, str]:
    """``scontrol requeue <this job>``: whether it worked, and what to say."""
    job = job_id(environ)
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if job is None or scontrol is None:
        what = "no SLURM_JOB_ID" if job is None else "scontrol is not on PATH"
        return False, f"cannot requeue the job ({what}); it ends here, to be resubmitted."
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"`scontrol requeue {job}` failed ({err}); the job ends here, to be resubmitted."
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return False, f"`scontrol requeue {job}` failed: {why[0]}; the job ends here, to be resubmitted."
    return True, f"requeued SLURM job {job} (`scontrol requeue {job}`): it starts again and resumes from 'last'."
