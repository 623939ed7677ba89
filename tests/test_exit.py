"""A rank that finished its job exits cleanly: the process group's C++ threads are joined before the interpreter
finalizes (lightning_gaudi_ds/engine/shutdown.py), so no rank dies with SIGABRT ("terminate called without an active
exception") at exit and no launcher reports a successful rank as failed."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.procs import JOBS, run_job

pytestmark = pytest.mark.multiprocess

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")
CASES = {
    "zero2-offload": ["--stage", "2", "--offload-optimizer", "--optimizer", "adamw"],
    "zero3-eval": ["--stage", "3", "--optimizer", "adamw"],
}


def exit_threads(output: str) -> dict[str, dict[str, int]]:
    """Per rank, the threads its last atexit handler saw (train_job.py --exit-probe)."""
    found = re.findall(r"^exit-threads rank=(\d+) (\{.*\})$", output, flags=re.MULTILINE)
    return {rank: ast.literal_eval(names) for rank, names in found}


def short_job(out: Path, case: str, *extra: str) -> tuple[int, str]:
    args = [sys.executable, str(JOBS / "train_job.py"), "--out", str(out), "--exit-probe", "--width", "16",
            "--max-steps", "2", "--batch-size", "8", *CASES[case], *extra]
    result = run_job(args, timeout=300)
    assert not result.timed_out, result.output[-4000:]
    return result.returncode, result.output


@pytest.mark.parametrize("case", list(CASES))
def test_process_group_threads_end_before_finalization(tmp_path: Path, case: str) -> None:
    returncode, output = short_job(tmp_path, case, *([] if case == "zero3-eval" else ["--no-eval"]))
    assert returncode == 0, output[-4000:]
    seen = exit_threads(output)
    assert sorted(seen) == ["0", "1"], output[-4000:]
    for rank, names in seen.items():
        left = {name: n for name, n in names.items() if name in GLOO_THREADS}
        assert not left, f"rank {rank} still runs {left} when the interpreter finalizes"


@pytest.mark.slow
def test_thirty_short_jobs_never_abort_at_exit(tmp_path: Path) -> None:
    failures = []
    for i in range(30):
        case = list(CASES)[i % len(CASES)]
        returncode, output = short_job(tmp_path / str(i), case, "--no-eval")
        aborted = "terminate called" in output or returncode != 0
        left = {r: {k: v for k, v in names.items() if k in GLOO_THREADS} for r, names in exit_threads(output).items()}
        if aborted or any(left.values()) or len(left) != 2:
            failures.append(f"job {i} ({case}): rc={returncode}, gloo threads at exit {left}\n{output[-1500:]}")
    assert not failures, "\n\n".join(failures)
