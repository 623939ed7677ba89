"""The hash-locked set-up: every lock file matches today's requirements (scripts/setup.sh refuses a stale one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO

LOCKS = sorted((REPO / "requirements").glob("lock*.txt"))


def check(lock: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "requirements" / "lockcheck.py"), str(lock)],
                          capture_output=True, text=True, timeout=60)


def test_there_is_a_lock_per_tier() -> None:
    assert [p.name for p in LOCKS] == ["lock-deepspeed-0.16.1.txt", "lock.txt"]


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_lock_matches_the_requirements_and_pins_every_file(lock: Path) -> None:
    result = check(lock)
    assert result.returncode == 0, result.stderr
    text = lock.read_text()
    assert "--hash=sha256:" in text
    assert not [x for x in text.splitlines() if x.startswith(("lightning-gaudi-ds", "lightning_gaudi_ds"))]  # deps only
    for name in ("torch==2.13.0", "lightning==", "deepspeed==", "setuptools=="):
        assert name in text, name
    assert "lightning==2.6.2 " not in text and "lightning==2.6.3 " not in text
    if "0.16.1" in lock.name:
        assert "deepspeed==0.16.1 " in text


def test_a_stale_lock_is_refused_with_the_refresh_command(tmp_path: Path) -> None:
    stale = tmp_path / "lock.txt"
    lines = LOCKS[-1].read_text().splitlines()
    stale.write_text("\n".join(line.replace("sha256: ", "sha256: 0") if line.startswith("# requirements") else line
                               for line in lines))
    result = check(stale)
    assert result.returncode == 1 and "bash scripts/lock.sh" in result.stderr
