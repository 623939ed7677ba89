"""Memory sizes as people write them: ``96GiB``, ``24GB``, ``1.5e9``, ``512 MiB``."""

from __future__ import annotations

import re

from lightning_gaudi_ds.errors import PlanError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")  # sign: refused below


def parse_bytes(value: int | float | str, name: str = "memory") -> int:
    """Bytes from an int, a float or a string with an optional unit (B, KB/MB/GB/TB = 1000^n, KiB/MiB/GiB/TiB
    = 1024^n; case-insensitive). Raises ``ValueError`` naming the value and the allowed forms."""
    allowed = ("a number of bytes (e.g. 25769803776 or 1.5e9) or a size with a unit: B, KB, MB, GB, TB, KiB, MiB,"
               " GiB, TiB")
    if isinstance(value, bool):
        raise PlanError(f"{name}={value!r} is not a memory size. Use {allowed}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str) and (match := _PATTERN.match(value)) and match.group(2).lower() in _UNITS:
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise PlanError(f"{name}={value!r} is not a memory size. Use {allowed} ('96GiB', '24GB', '512MiB')")
    result = number * _UNITS[unit]
    if not result > 0 or result != result or result == float("inf"):
        raise PlanError(f"{name}={value!r} must be a positive size. Use {allowed}")
    return int(result)


def format_bytes(n: int | float | None) -> str:
    """``12.34 GiB``-style text (binary units)."""
    if n is None:
        return "?"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
