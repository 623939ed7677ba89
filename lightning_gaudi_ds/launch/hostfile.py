"""DeepSpeed's hostfile format, which Open MPI reads too: one ``hostname slots=N`` per line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lightning_gaudi_ds.errors import HostfileError

__all__ = ["Host", "HostfileError", "parse_hostfile", "parse_hostfile_text"]


@dataclass(frozen=True)
class Host:
    """One hostfile entry: the host, its slots (ranks to start there) and the line it was read from."""

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


def parse_hostfile(path: str | os.PathLike) -> list[Host]:
    """Read and parse a hostfile; :class:`HostfileError` names the file and line of anything wrong."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise HostfileError(f"cannot read hostfile {str(path)!r}: {err.strerror}. Pass an existing file.") from err
    return parse_hostfile_text(text, source=str(path))
