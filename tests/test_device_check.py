"""``scripts/device_check.sh``, the CUDA check for a machine with GPUs: what can be checked without one.

Here the script must refuse clearly (no CUDA), its JSON-line runner must train a case on CPU processes
(``DEVICE_CHECK_ACCELERATOR=cpu``), and its verdict must fail a case on the wrong backend or device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import pytest
import torch

from tests.procs import REPO, run_job

SCRIPT = REPO / "scripts" / "device_check.sh"


def _runner():
    spec = importlib.util.spec_from_file_location("device_check", REPO / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda_result(**changes):
    result = {"steps": 5, "finite": True, "backend": "nccl", "root_device": "cuda:1", "engine_device": "cuda:1",
              "param_dtype": "bfloat16"}
    return {**result, **changes}


def test_verdict_passes_a_clean_cuda_case():
    args = argparse.Namespace(steps=5, accelerator="cuda", precision="bf16-mixed")
    assert _runner().verdict(_cuda_result(), args) == []


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"steps": 3}, "ran 3 of 5 steps"),
        ({"finite": False}, "a loss is not finite"),
        ({"backend": "gloo"}, "process-group backend gloo, expected nccl"),
        ({"engine_device": "cuda:0"}, "DeepSpeed's engine is on cuda:0, the strategy on cuda:1"),
        ({"param_dtype": "float32"}, "parameters are float32 under bf16-mixed"),
    ],
)
def test_verdict_names_what_went_wrong(changes, problem):
    args = argparse.Namespace(steps=5, accelerator="cuda", precision="bf16-mixed")
    assert _runner().verdict(_cuda_result(**changes), args) == [problem]


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_clearly_without_a_gpu():
    result = run_job(["bash", str(SCRIPT)], timeout=60, env={"PYTHON": sys.executable})
    assert result.returncode == 2, result.output
    assert "no CUDA GPU is visible" in result.output and "DEVICE_CHECK_ACCELERATOR=cpu" in result.output
    assert not any(line.startswith("{") for line in result.output.splitlines())


@pytest.mark.multiprocess
def test_runs_a_case_on_two_cpu_ranks_and_prints_one_json_line(tmp_path):
    env = {"PYTHON": sys.executable, "DEVICE_CHECK_ACCELERATOR": "cpu", "DEVICE_CHECK_STAGES": "1",
           "DEVICE_CHECK_STEPS": "2", "DEVICE_CHECK_DEVICES": "2", "DEVICE_CHECK_TIMEOUT": "240",
           "DEVICE_CHECK_LOG": str(tmp_path / "device_check.log")}
    result = run_job(["bash", str(SCRIPT)], timeout=300, env=env).check()
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert len(lines) == 2, result.output
    stack, case = lines[0]["stack"], lines[1]
    assert stack["torch"] == torch.__version__ and stack["gpus"] == []
    assert case["case"] == "zero1-bf16-mixed-cpu" and case["ok"] is True, case
    assert case["world_size"] == 2 and case["backend"] == "gloo" and case["param_dtype"] == "bfloat16"
    assert case["steps"] == 2 and case["finite"] and case["loss_last"] < case["loss_first"]
