"""Whether a lock file was made from today's requirements (pyproject.toml's dependencies and extras, pins.in).

``python requirements/lockcheck.py LOCK`` exits 1, naming the refresh command, when the digest recorded in LOCK's
header differs, and listing the locks there are when LOCK does not exist; ``--header CMD [PIN]`` prints the header
scripts/lock.sh writes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "# requirements sha256: "


def digest(extra_pin: str = "") -> str:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [line.strip() for line in (ROOT / "requirements" / "pins.in").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    data = {"dependencies": project["dependencies"], "extras": project["optional-dependencies"], "pins": pins,
            "extra_pin": extra_pin}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def missing(lock: Path) -> str:
    """Why ``lock`` cannot be used, and which DeepSpeed versions have a lock (scripts/setup.sh's
    LIGHTNING_GAUDI_DS_DEEPSPEED)."""
    versions = sorted(p.name[len("lock-deepspeed-"):-len(".txt")] for p in (ROOT / "requirements").glob(
        "lock-deepspeed-*.txt"))
    return (f"{lock}: no such lock file. LIGHTNING_GAUDI_DS_DEEPSPEED takes a DeepSpeed version that has a lock"
            f" ({', '.join(versions) or 'none'}: requirements/lock-deepspeed-<version>.txt), or leave it unset for"
            " the main tier (requirements/lock.txt). A lock for another version is made by adding it to"
            " scripts/lock.sh.")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--header"]:
        command, pin = argv[1], (argv[2] if len(argv) > 2 else "")
        print(f"# The dev, test and CI set-up, hash-locked ({'with ' + pin if pin else 'main tier'}). Refresh: {command}")
        print(f"{MARK}{digest(pin)} {pin}".rstrip())
        return 0
    lock = Path(argv[0])
    if not lock.is_file():
        print(missing(lock), file=sys.stderr)
        return 1
    line = next((x for x in lock.read_text().splitlines() if x.startswith(MARK)), None)
    recorded, _, pin = (line[len(MARK):].partition(" ") if line else ("", "", ""))
    if recorded != digest(pin.strip()):
        print(f"{lock} was made from other requirements than pyproject.toml's and requirements/pins.in's today:"
              " refresh it with `bash scripts/lock.sh` and commit the result.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
