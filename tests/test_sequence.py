"""Sequence parallelism end to end (``HPUDeepSpeedStrategy(sequence_parallel_size=K)``), as two real jobs of
tests/jobs/sequence_job.py on 2 and 4 CPU ranks (gloo, DeepSpeed's engine): the loss and gradients of a K-way step
against the same step without it, training in bf16 and with activation checkpointing, the Fabric strategy, the
errors that need processes, and checkpoints written at K = 2 resumed at K = 1, on 4 ranks and converted with
``lightning-gaudi-ds convert --to hf``."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import JOBS, run_job

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5  # fp32: losses and gradients of the K-way step against the step without it


def _job(folder: Path, devices: int, *args: str, timeout: float) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    run_job([sys.executable, str(JOBS / "sequence_job.py"), "--out", str(folder), "--devices", str(devices), *args],
            timeout, ranks=devices).check()
    results = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    assert len(results) == devices, results
    return results


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """2 ranks: every check (about 70 s on 2 busy cores)."""
    folder = tmp_path_factory.mktemp("sequence2")
    return _job(folder, 2, "--plan", "grads", "train", "fabric", "errors", "checkpoint", timeout=600)


@pytest.fixture(scope="module")
def four(two: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """4 ranks: the gradients, and the 2-rank job's K = 2 checkpoint loaded here."""
    folder = tmp_path_factory.mktemp("sequence4")
    checkpoint = _checkpoint_folder(two) / "k2.ckpt"
    return _job(folder, 4, "--plan", "grads", "checkpoint", "--load", str(checkpoint), timeout=600)


def _checkpoint_folder(results: list[dict[str, Any]]) -> Path:
    return Path(results[0]["out"])


def _check_grads(results: list[dict[str, Any]], devices: int) -> None:
    for rank, result in enumerate(results):
        cases = {k: v for k, v in result.items() if k.startswith("grads/")}
        assert {f"grads/{m}/z{z}/k{devices}" for m in ("llama", "gpt2") for z in (2, 3)} <= cases.keys(), cases
        for name, case in cases.items():
            size = int(name.rsplit("/k", 1)[1])
            assert case["loss"] == pytest.approx(case["reference_loss"], rel=TOLERANCE, abs=TOLERANCE), (name, case)
            assert case["grad_diff"] <= TOLERANCE, (name, case)
            assert case["grad_scale"] > 100 * TOLERANCE, (name, case)  # the gradients are not all zero
            assert case["same_loss_in_group"] is True, (name, case)
            # the K ranks of a group read the same samples: the sampler has world / K replicas
            assert case["sampler"] == {"num_replicas": devices // size, "rank": rank // size}, (name, case)


def test_two_ranks_sequence_parallel_step_equals_the_step_without_it(two: list[dict[str, Any]]) -> None:
    _check_grads(two, 2)
    assert {"grads/own/z2/k2", "grads/llama/z0/k2", "grads/llama/z1/k2"} <= two[0].keys()
    # the other families the attention registry serves: Mistral (a sliding window shorter than the sequence),
    # Qwen2 and Mixtral (mixture of experts)
    assert {"grads/mistral/z2/k2", "grads/qwen2/z2/k2", "grads/mixtral/z2/k2"} <= two[0].keys()


def test_four_ranks_sequence_parallel_step_equals_the_step_without_it(four: list[dict[str, Any]]) -> None:
    _check_grads(four, 4)
    assert {"grads/own/z2/k4", "grads/llama/z2/k2", "grads/gpt2/z3/k2"} <= four[0].keys()


def test_activation_checkpointing_validate_and_bf16(two: list[dict[str, Any]]) -> None:
    for result in two:
        case = result["train/checkpointing"]  # the attention recomputed in backward: the same gradients
        assert case["loss"] == pytest.approx(case["reference_loss"], rel=TOLERANCE)
        assert case["grad_diff"] <= TOLERANCE and case["grad_scale"] > 100 * TOLERANCE, case
        case = result["train/validate"]  # trainer.validate: ZeRO-3's evaluation engine, the batches split
        assert case["loss"] == pytest.approx(case["reference_loss"], rel=TOLERANCE), case
        for kind in ("llama", "gpt2"):
            case = result[f"train/bf16/{kind}"]
            assert len(case["losses"]) == 3 and all(math.isfinite(x) for x in case["losses"]), case
            assert case["same_loss_in_group"] is True
            assert case["losses"] == pytest.approx(case["reference_losses"], rel=2e-3), case  # bf16 rounding


def test_fabric_strategy(two: list[dict[str, Any]]) -> None:
    for result in two:
        case = result["fabric"]
        assert case["batch_length"] == 15, case  # fabric.setup_dataloaders: half of each 30-token sequence
        assert case["sampler"] == {"num_replicas": 1, "rank": 0}, case
        assert case["same_loss_in_group"] is True
        assert case["losses"] == pytest.approx(case["reference_losses"], rel=TOLERANCE), case


def test_refused_with_processes(two: list[dict[str, Any]]) -> None:
    errors = two[0]["errors"]
    assert errors["no_attention"]["type"] == "ConfigError", errors
    assert "sequence_parallel_modules=[MyAttention]" in errors["no_attention"]["message"]
    assert errors["predict"]["type"] == "ConfigError", errors
    assert "trainer.predict" in errors["predict"]["message"]
    assert "sequence_parallel_size=1" in errors["predict"]["message"]
    assert errors["heads"]["type"] == "ConfigError", errors
    assert "3 attention heads" in errors["heads"]["message"]


def test_checkpoint_of_k2_resumes_at_k1_and_on_four_ranks(two: list[dict[str, Any]],
                                                          four: list[dict[str, Any]]) -> None:
    case = two[0]["checkpoint"]
    assert case["trained_diff"] <= TOLERANCE, case  # 2 steps at K = 2 and at K = 1: the same weights
    assert case["resumed_k1_diff"] <= TOLERANCE, case  # the K = 2 checkpoint resumed at K = 1
    for result in four:  # saved by 2 ranks, loaded by 4, at K = 2 and K = 1
        for size in (2, 1):
            load = result[f"checkpoint/load/k{size}"]
            assert load["diff"] <= TOLERANCE, load
            assert all(math.isfinite(x) for x in load["losses"]), load


def test_convert_to_hf_of_k2_checkpoint_equals_k1_weights(two: list[dict[str, Any]], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    folder = _checkpoint_folder(two)
    out = tmp_path / "hf"
    cli = run_job([sys.executable, "-m", "lightning_gaudi_ds", "convert", str(folder / "k2.ckpt"), str(out),
                   "--to", "hf"], 180, warm=True).check()  # a command line tool: warm, as the other convert tests
    assert "wrote" in cli.output, cli.output[-2000:]
    exported = load_file(out / "model.safetensors")
    reference = torch.load(folder / "k1_weights.pt")  # the K = 1 run's weights, by the LightningModule's names
    assert sorted("model." + name for name in exported) == sorted(reference), (sorted(exported), sorted(reference))
    assert max(float((exported[n[len("model."):]] - t).abs().max()) for n, t in reference.items()) <= TOLERANCE


def test_long_sequence_example_trains_with_two_ranks_per_sequence(tmp_path: Path) -> None:
    """examples/finetune_hf_long.py at its default length (one that K = 1 cannot train under the benchmark's cap),
    one step: each rank holds half of each sequence and prints the same loss."""
    pytest.importorskip("transformers")
    example = Path(__file__).resolve().parents[1] / "examples" / "finetune_hf_long.py"
    job = run_job([sys.executable, str(example), "--max-steps", "1"], 600, cwd=tmp_path, ranks=2).check()
    lines = [line for line in job.output.splitlines() if line.startswith("rank ") and ": step 0," in line]
    assert len(lines) == 2, job.output[-3000:]
    losses = {line.split("loss ")[1].split(",")[0] for line in lines}
    assert len(losses) == 1 and math.isfinite(float(losses.pop())), lines
    default = int(re.search(r'"--seq-len", type=int, default=(\d+)', example.read_text()).group(1))
    assert all(f"{default // 2:,} of the {default:,} tokens" in line for line in lines), lines
