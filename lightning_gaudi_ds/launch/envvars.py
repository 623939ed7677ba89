"""The package's environment variables, in one place: each one's name, what it holds, its default.

Standard library only: the rank shim (:mod:`~lightning_gaudi_ds.launch.rank`, started by path so that no rank
imports the package) imports this module as a sibling. :func:`read` gives one variable's value (unset or empty: its
default); a value that does not parse is an :class:`EnvVarError` naming the variable, the value and what is
allowed. :func:`check` reads them all: ``lightning-gaudi-ds spawn`` calls it before anything starts, the strategies
before they launch. docs/launching.md lists them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALL", "LINK_TIMEOUT", "NUM_NODES", "RENDEZVOUS_TIMEOUT", "RESTART", "RUN_DIR", "RUN_ID", "SHM_COMM",
    "STOP_TIMEOUT", "EnvVar", "EnvVarError", "check", "read",
]


if __package__:
    from lightning_gaudi_ds.errors import EnvVarError
else:  # the rank shim's sibling, run by path without the package: the family's light members from their file
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location("_lightning_gaudi_ds_base_errors",
                                                   Path(__file__).resolve().parent.parent / "_base_errors.py")
    assert _spec is not None and _spec.loader is not None
    _errors = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_errors)
    EnvVarError = _errors.EnvVarError  # type: ignore[misc]


@dataclass(frozen=True)
class EnvVar:
    """One variable: ``parse`` turns its text into the value (``ValueError`` for text it does not take)."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    allowed: str  # what a value may be, said in the error


def _seconds(zero_ok: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise EnvVarError(text)
        return value

    return parse


def _whole(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < low:
            raise EnvVarError(text)
        return int(text)

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise EnvVarError(text)
        return value

    return parse


_PREFIX = "LIGHTNING_GAUDI_DS_"
# Set by `lightning-gaudi-ds spawn` for its ranks: where the rank shims keep logs and exit records (unset: the shim
# runs the script as is), the job's token (how the supervisor finds every process of the job), the shims' SIGTERM ->
# SIGKILL grace, the bound on the supervisor's heartbeat (unset: not watched), which start of the job this is (above
# 0 a fit without ckpt_path resumes from "last") and, on a restart on fewer hosts, the nodes it runs on.
RUN_DIR = EnvVar(_PREFIX + "RUN_DIR", str, None, "a directory")
RUN_ID = EnvVar(_PREFIX + "RUN_ID", str, None, "any text")
STOP_TIMEOUT = EnvVar(_PREFIX + "STOP_TIMEOUT", _seconds(zero_ok=True), 10.0,
                      "the seconds between SIGTERM and SIGKILL when a rank is stopped, a number >= 0")
LINK_TIMEOUT = EnvVar(_PREFIX + "LINK_TIMEOUT", _seconds(zero_ok=False), None,
                      "the seconds a rank waits for the supervisor's heartbeat, a number > 0")
RESTART = EnvVar(_PREFIX + "RESTART", _whole(0), 0, "which start of the job this is, a whole number >= 0")
NUM_NODES = EnvVar(_PREFIX + "NUM_NODES", _whole(1), None, "the nodes this start runs on, a whole number >= 1")
# Set by the user: how long the ranks may take to meet; DeepSpeed's CPU shared-memory all-reduce.
RENDEZVOUS_TIMEOUT = EnvVar(_PREFIX + "RENDEZVOUS_TIMEOUT", _seconds(zero_ok=False), 600.0,
                            "the seconds the ranks may take to meet, a number > 0")
SHM_COMM = EnvVar(_PREFIX + "SHM_COMM", _choice("off", "on"), "off", "one of off, on")

ALL = (RUN_DIR, RUN_ID, STOP_TIMEOUT, LINK_TIMEOUT, RESTART, NUM_NODES, RENDEZVOUS_TIMEOUT, SHM_COMM)


def read(var: EnvVar, environ: Mapping[str, str] = os.environ) -> Any:
    """``var``'s value in ``environ``: its default when unset or empty, else the parsed text."""
    text = environ.get(var.name, "")
    if not text.strip():
        return var.default
    try:
        return var.parse(text)
    except ValueError:
        shown = f"{var.default:g}" if isinstance(var.default, float) else var.default
        default = "" if var.default is None else f" (default {shown})"
        raise EnvVarError(f"{var.name}={text!r}: pass {var.allowed}{default}, or unset it.") from None


def check(environ: Mapping[str, str] = os.environ) -> None:
    """Read every package variable of ``environ``: the first bad one is an :class:`EnvVarError`."""
    for var in ALL:
        read(var, environ)
