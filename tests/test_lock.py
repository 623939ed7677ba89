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
    for name in ("torch==2.13.0", "lightning==", "deepspeed==", "setuptools==", "uv=="):
        assert name in text, name
    assert "lightning==2.6.2 " not in text and "lightning==2.6.3 " not in text
    if "0.16.1" in lock.name:
        assert "deepspeed==0.16.1 " in text


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_setup_takes_uv_with_its_hashes_from_the_lock(lock: Path) -> None:
    """scripts/setup.sh installs uv with pip from the lock's own uv lines (its awk program), then the lock with uv."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    program = next(line.strip() for line in setup.splitlines() if line.strip().startswith("awk "))
    assert program.endswith('"$LOCK" > "$uv_lock"'), program
    lines = subprocess.run(["bash", "-c", program.replace('"$LOCK" > "$uv_lock"', '"$1"'), "awk", str(lock)],
                           capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert lines[0].startswith("uv==") and lines[0].endswith(" \\"), lines[:1]
    assert len(lines) > 2 and all(x.strip().startswith("--hash=sha256:") for x in lines[1:]), lines
    assert all(x.endswith(" \\") for x in lines[1:-1]) and not lines[-1].endswith("\\"), lines


def test_a_stale_lock_is_refused_with_the_refresh_command(tmp_path: Path) -> None:
    stale = tmp_path / "lock.txt"
    lines = LOCKS[-1].read_text().splitlines()
    stale.write_text("\n".join(line.replace("sha256: ", "sha256: 0") if line.startswith("# requirements") else line
                               for line in lines))
    result = check(stale)
    assert result.returncode == 1 and "bash scripts/lock.sh" in result.stderr


def test_a_missing_lock_lists_the_versions_that_have_one(tmp_path: Path) -> None:
    result = check(REPO / "requirements" / "lock-deepspeed-9.9.9.txt")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "lock-deepspeed-9.9.9.txt: no such lock file" in result.stderr and "(0.16.1:" in result.stderr
    assert "LIGHTNING_GAUDI_DS_DEEPSPEED" in result.stderr


@pytest.mark.multiprocess
def test_setup_refuses_a_deepspeed_version_without_a_lock_before_making_a_venv(tmp_path: Path) -> None:
    """scripts/setup.sh in a copy of the repository, with stand-ins for the system tools it would install."""
    import os
    import shutil

    copy = tmp_path / "repo"
    for name in ("scripts", "requirements"):
        shutil.copytree(REPO / name, copy / name)
    shutil.copy(REPO / "pyproject.toml", copy)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for tool, code in (("mpirun", 0), ("pdsh", 0), ("apt-get", 1), ("sudo", 1)):
        (stubs / tool).write_text(f"#!/bin/sh\nexit {code}\n")
        (stubs / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "LIGHTNING_GAUDI_DS_DEEPSPEED": "9.9.9",
           "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(copy / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no such lock file" in result.stderr and "(0.16.1:" in result.stderr and "Traceback" not in result.stderr
    assert not (copy / ".venv-deepspeed-9.9.9").exists()
