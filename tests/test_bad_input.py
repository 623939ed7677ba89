"""Bad input a new user gives: each is refused before any rank or training starts, with an error that names the
value and how to fix it, and leaves no file or process behind. Items that are about processes start real ones
(tests/procs.py owns them) and are marked ``multiprocess``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_gaudi_ds.launch import DistributedRunner
from tests.procs import LiveJob, run_job


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*"))


# ------------------------------------------------------------------------------------------------ launcher
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop_timeout": -1}, r"stop_timeout=-1: .*finite number >= 0"),
        ({"stop_timeout": float("nan")}, r"stop_timeout=nan"),
        ({"timeout": -5}, r"timeout=-5: .*> 0, or None"),
        ({"timeout": 0}, r"timeout=0: "),
        ({"tail_lines": -1}, r"tail_lines=-1"),
    ],
)
def test_runner_numbers_are_checked_before_any_rank_starts(tmp_path: Path, kwargs: dict, match: str) -> None:
    script = tmp_path / "ran.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(ValueError, match=match):
        DistributedRunner([str(script)], world_size=2, **kwargs).run()
    assert _files(tmp_path) == [script]


def test_runner_with_no_command_is_refused() -> None:
    with pytest.raises(ValueError, match=r"command_list=\[\]: nothing to run"):
        DistributedRunner([], world_size=2)


def test_log_dir_that_cannot_be_created_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=rf"log_dir='{blocker}/logs': not a directory \({blocker} is a file\)"):
        DistributedRunner(["t.py"], log_dir=blocker / "logs")
    assert _files(tmp_path) == [blocker]


@pytest.mark.multiprocess
def test_spawn_stop_timeout_negative_exits_2_with_the_value(tmp_path: Path) -> None:
    script = tmp_path / "ran.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    done = run_job([sys.executable, "-m", "lightning_gaudi_ds", "spawn", "--world_size", "2", "--stop_timeout", "-1",
                    str(script)], timeout=60)
    assert done.returncode == 2 and "error: stop_timeout=-1.0: " in done.output, done.output
    assert _files(tmp_path) == [script]


@pytest.mark.multiprocess
@pytest.mark.parametrize("missing", ["missing.py", "-m no_such_package_xyz.train"])
def test_spawn_missing_script_is_refused_before_any_rank(tmp_path: Path, missing: str) -> None:
    done = run_job([sys.executable, "-m", "lightning_gaudi_ds", "spawn", "--world_size", "2", "--master_port", "0",
                    *missing.split()], timeout=60, cwd=tmp_path)
    name = missing.split()[-1]
    assert done.returncode == 2 and name in done.output, done.output
    assert "torchrun" not in done.output and "rank 0" not in done.output  # nothing was launched
    assert len(done.output.strip().splitlines()) == 1
    assert _files(tmp_path) == []
