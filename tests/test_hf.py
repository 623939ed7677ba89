"""Hugging Face models end to end: ``from_pretrained`` inside ``configure_model`` under ZeRO-3, and the export of a
sharded checkpoint back to a ``from_pretrained`` directory (tests/jobs/hf_job.py, 2 real ranks on gloo)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.procs import JOBS, JobResult, run_job

pytestmark = pytest.mark.multiprocess


def _run(tmp_path: Path, *args: str, timeout: float = 300) -> list[dict]:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' DeepSpeed integration (HfDeepSpeedConfig) needs it
    run_job([sys.executable, str(JOBS / "hf_job.py"), "--out", str(tmp_path), *args], timeout, ranks=2).check()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == 2, results
    return results


def _check_pretrained_loaded(results: list[dict], tolerance: float) -> None:
    for r in results:
        assert len(r["shards"]) > 1, r["shards"]  # a sharded safetensors checkpoint was loaded
        assert r["zero3_inside"] is True, r  # transformers knew ZeRO-3 was on inside configure_model ...
        assert r["zero3_after"] is False and r["hf_ref_after"] is False, r  # ... and nothing of it is left behind
        # the first step's loss is the pretrained model's on that batch: the saved weights were loaded
        assert abs(r["losses"][0] - r["reference_loss"]) <= tolerance * abs(r["reference_loss"]), r
        # partitioned from the start: this rank never held much more than its half of the parameters
        assert r["peak_bytes"] < 0.6 * r["total_bytes"], r


def test_zero3_from_pretrained_loads_into_partitions_and_exports_back(tmp_path: Path) -> None:
    results = _run(tmp_path, "--stage", "3", "--export")
    _check_pretrained_loaded(results, 1e-6)
    assert results[0]["dtypes"] == ["torch.float32"]
    exported = results[0]
    assert exported["loading_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [],
                                        "error_msgs": []}
    assert "config.json" in exported["export_files"] and "model.safetensors" in exported["export_files"]
    assert exported["logit_diff"] <= 1e-5 * exported["logit_scale"], exported
    # the CLI writes the same directory from the same checkpoint
    out = tmp_path / "cli_hf"
    cli = run_job([sys.executable, "-m", "lightning_gaudi_ds", "convert", str(tmp_path / "trained.ckpt"), str(out),
                   "--to", "hf", "--max-shard-size", "100KB"], 120, warm=True).check()
    assert "wrote" in cli.output
    check = (
        "import sys, torch; from transformers import AutoModelForCausalLM;"
        "m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True);"
        "ref = torch.load(sys.argv[2]);"
        "d = (m.eval()(input_ids=ref['probe']).logits - ref['logits']).abs().max().item();"
        "bad = {k: v for k, v in info.items() if v}; assert not bad, bad; assert d < 1e-5, d; print('equal', d)"
    )
    loaded = run_job([sys.executable, "-c", check, str(out), str(tmp_path / "trained_logits.pt")], 120,
                     warm=True).check()
    assert "equal" in loaded.output
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    # --to safetensors: the LightningModule's state dict in one file, the same tensors as the export's
    from safetensors.torch import load_file

    plain = tmp_path / "model.safetensors"
    run_job([sys.executable, "-m", "lightning_gaudi_ds", "convert", str(tmp_path / "trained.ckpt"), str(plain),
             "--to", "safetensors"], 120, warm=True).check()
    state, hf_state = load_file(plain), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(state) == sorted("model." + k for k in hf_state)
    assert all(state["model." + k].equal(v) for k, v in hf_state.items())


def test_zero3_from_pretrained_in_bf16(tmp_path: Path) -> None:
    results = _run(tmp_path, "--stage", "3", "--dtype", "bf16", "--max-shard-size", "100KB")
    _check_pretrained_loaded(results, 1e-3)
    for r in results:
        assert r["dtypes"] == ["torch.bfloat16"], r


def test_zero2_tied_embeddings_export_round_trip(tmp_path: Path) -> None:
    results = _run(tmp_path, "--stage", "2", "--tied", "--export")
    for r in results:  # outside ZeRO-3 nothing changes: transformers is not told about DeepSpeed
        assert r["zero3_inside"] is False and r["zero3_after"] is False, r
        assert r["losses"][0] == pytest.approx(r["reference_loss"], rel=1e-6)
    exported = results[0]
    assert not any(exported["loading_info"].values()), exported["loading_info"]
    assert exported["tied_after_export"] is True
    assert exported["logit_diff"] <= 1e-5 * exported["logit_scale"], exported


def test_zero3_peft_lora_after_from_pretrained(tmp_path: Path) -> None:
    if importlib.util.find_spec("peft") is None:  # not imported here: importing it makes torch's inductor write
        pytest.skip("peft is not installed")  # TORCHINDUCTOR_CACHE_DIR into this process's environment
    results = _run(tmp_path, "--stage", "3", "--peft", "--export", "--max-shard-size", "100KB")
    # LoRA's B starts at zero (built under zero3_init_paused): the first loss is still the pretrained model's
    _check_pretrained_loaded(results, 1e-6)
    for r in results:
        assert r["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r["trainable"]), r["trainable"]
    exported = results[0]
    # the adapters alone, loaded onto the pretrained model, give the trained model's logits (which the training
    # moved away from the pretrained model's) ...
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(exported["adapter_files"]), exported
    assert exported["adapter_logit_diff"] <= 1e-5 * exported["logit_scale"], exported
    assert exported["pretrained_logit_diff"] > 100 * max(exported["adapter_logit_diff"], 1e-7), exported
    # ... and so does the merged model, a plain from_pretrained directory
    assert not any(exported["loading_info"].values()), exported["loading_info"]
    assert exported["logit_diff"] <= 1e-5 * exported["logit_scale"], exported


def _moe(out: Path, *args: str, timeout: float = 240) -> tuple[JobResult, list[dict]]:
    out.mkdir()
    job = run_job([sys.executable, str(JOBS / "moe_job.py"), "--out", str(out), *args], timeout, ranks=2)
    return job, [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def test_zero3_leaf_modules_for_experts_that_ranks_route_differently(tmp_path: Path) -> None:
    job, zero3 = _moe(tmp_path / "zero3", "--strategy", "zero3")
    job.check()
    _, ddp = _moe(tmp_path / "ddp", "--strategy", "ddp")
    assert len(zero3) == len(ddp) == 2
    assert all(r["leaf"] for r in zero3)
    # the premise: the two ranks ran different experts in some step
    assert any(a != b for a, b in zip(zero3[0]["ran"], zero3[1]["ran"])), zero3
    for z, d in zip(zero3, ddp):  # and trained as Lightning's DDP does on the same ranks and data
        assert z["ran"] == d["ran"]
        assert z["losses"] == pytest.approx(d["losses"], rel=1e-5, abs=1e-6)
    # without the leaf modules, ZeRO-3 fetches per expert, and the ranks' fetch orders disagree
    failed, _ = _moe(tmp_path / "no_leaf", "--strategy", "zero3", "--no-leaf", timeout=150)
    assert failed.timed_out or failed.returncode != 0, failed.output[-2000:]


def test_finetune_hf_example_fine_tunes_under_zero3_and_exports(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    examples = Path(__file__).resolve().parents[1] / "examples"
    job = run_job([sys.executable, str(examples / "finetune_hf.py"), "fit", "--config",
                   str(examples / "configs" / "hf" / "zero3_finetune.yaml"), "--trainer.max_steps", "2"], 400,
                  cwd=tmp_path).check()
    assert "from_pretrained: no missing or unexpected keys" in job.output, job.output[-3000:]
    exported = next(tmp_path.glob("runs/finetune_hf/lightning_logs/version_*/hf"))
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names, names
    assert (tmp_path / "runs" / "finetune_hf" / "tiny-llama" / "config.json").is_file()  # made by the example
