"""argparse ``type=`` functions shared by the benchmark scripts: every flag is checked when it is parsed, before any
work starts. A bad value is argparse's own error (``argument --hidden: 0 is not allowed: ...``, exit code 2)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path


def _number(text: str, kind: type, what: str) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: pass {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: pass {what}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """A whole number >= ``low``."""
    what = f"a whole number >= {low}"

    def parse(text: str) -> int:
        value = int(_number(text, int, what))
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is not allowed: pass {what}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def _float(what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(_number(text, float, what))
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not allowed: pass {what}")
        return value

    return parse


positive_float = _float("a number > 0", lambda v: v > 0)
non_negative_float = _float("a number >= 0", lambda v: v >= 0)
fraction = _float("a fraction between 0 and 1 (exclusive), e.g. 0.05", lambda v: 0 < v < 1)
at_least_one = _float("a number >= 1", lambda v: v >= 1)


def size(text: str) -> int:
    """A byte size > 0: ``300MiB``, ``64KiB``, ``2GB`` or a plain number of bytes."""
    from lightning_gaudi_ds.planning.units import parse_bytes

    try:
        value = parse_bytes(text, "size")
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: pass a size such as 300MiB, 64KiB or 2GB"
                                         f" ({err})") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: pass a size > 0, such as 300MiB")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated whole numbers >= 1: ``1024,16384``."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() and int(item) >= 1 for item in items):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: pass whole numbers >= 1 separated by commas,"
                                         " e.g. 1024,16384")
    return [int(item) for item in items]


def file_stem(text: str) -> str:
    """A file name without folder: letters, digits, ``-``, ``_`` and ``.``."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: pass a file name stem (letters, digits, -, _"
                                         " and ., no folder), e.g. restart_two_hosts")
    return text


def existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder" + (" (it is a file)" if path.exists() else ""))
    return path


def existing_path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return path


def regex(text: str) -> str:
    """A Python regular expression."""
    try:
        re.compile(text)
    except re.error as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {err}") from None
    return text
