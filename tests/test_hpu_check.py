"""``scripts/hpu_check.sh``, the first command to run on a Gaudi machine: what can be checked without one.

On this machine the script must refuse clearly (no habana_frameworks), and its JSON-line runner must train a case
on CPU (``HPU_CHECK_ACCELERATOR=cpu``). Its stack report is checked against the habana_frameworks double.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import deepspeed  # noqa: F401  (imported before the double, so module-level DeepSpeed state stays CPU's for the session)
import pytest
import torch

from tests import hpu_double
from tests.procs import REPO, run_job

SCRIPT = REPO / "scripts" / "hpu_check.sh"


def _runner():
    spec = importlib.util.spec_from_file_location("hpu_check", REPO / "scripts" / "hpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stack_line_reports_the_imported_mode_and_deepspeed_accelerator(monkeypatch):
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        hpu_double.install(monkeypatch)
        info = _runner().stack()["stack"]
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    assert info["mode"] == "eager" and info["device"] == "GAUDI2" and info["devices"] == 8
    assert info["deepspeed_accelerator"] == "hpu" and info["compile_backend"] == "hpu_backend"


@pytest.mark.multiprocess
def test_refuses_clearly_without_the_gaudi_stack():
    result = run_job(["bash", str(SCRIPT)], timeout=60, env={"PYTHON": sys.executable})
    assert result.returncode == 2, result.output
    assert "habana_frameworks" in result.output and "HPU_CHECK_ACCELERATOR=cpu" in result.output


@pytest.mark.multiprocess
def test_runs_a_case_on_cpu_and_prints_one_json_line(tmp_path):
    env = {"PYTHON": sys.executable, "HPU_CHECK_ACCELERATOR": "cpu", "HPU_CHECK_STAGES": "3", "HPU_CHECK_STEPS": "2",
           "HPU_CHECK_DEVICES": "1", "HPU_CHECK_LOG": str(tmp_path / "hpu_check.log")}
    result = run_job(["bash", str(SCRIPT)], timeout=300, env=env).check()
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    stack, case = lines[0]["stack"], lines[1]
    assert stack["torch"] == torch.__version__ and stack["PT_HPU_LAZY_MODE"] == "0"
    assert case["case"] == "zero3-bf16-mixed" and case["ok"] is True and case["steps"] == 2
    assert case["finite"] and case["tied_weights_kept"] and case["loss_last"] < case["loss_first"]
    assert len(lines) == 2


@pytest.mark.multiprocess
def test_a_case_that_runs_too_long_is_stopped_and_reported(tmp_path):
    env = {"PYTHON": sys.executable, "HPU_CHECK_ACCELERATOR": "cpu", "HPU_CHECK_STAGES": "1", "HPU_CHECK_DEVICES": "1",
           "HPU_CHECK_TIMEOUT": "2", "HPU_CHECK_LOG": str(tmp_path / "hpu_check.log")}
    result = run_job(["bash", str(SCRIPT)], timeout=120, env=env)
    assert result.returncode == 1, result.output
    case = json.loads(next(line for line in result.output.splitlines() if line.startswith('{"case"')))
    assert case == {"case": "zero1-bf16-mixed", "stage": 1, "ok": False, "error": "timed out after 2s"}
