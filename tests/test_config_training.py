"""Real 2-rank training (gloo, the real DeepSpeed engine) from DeepSpeed JSON configs: every shipped example, a
config whose values all come from "auto", Lightning's default config, and a contradicting config that must stop
before training. The job is tests/jobs/train_job.py with the arguments in ``CONFIG_JOB`` (a width-64 model whose
optimizer hyperparameters are what "auto" resolves from)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.procs import JOBS, REPO, JobResult, job_ranks, run_job

pytestmark = pytest.mark.multiprocess

EXAMPLES = REPO / "examples" / "configs"
# hidden 64: the largest 2-D parameter is 64 x 64, so reduce_bucket_size "auto" = 4096
CONFIG_JOB = ["--width", "64", "--precision", "bf16-mixed", "--optimizer", "adamw", "--lr", "0.01", "--betas", "0.9",
              "0.99", "--eps", "1e-7", "--weight-decay", "0.01", "--warmup-steps", "2", "--max-steps", "3",
              "--batch-size", "8", "--no-eval"]
BUCKETS = {"reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686, "stage3_param_persistence_threshold": 640}


def run_config_job(out: Path, *args: str, env: Optional[dict[str, str]] = None, timeout: float = 420) -> JobResult:
    return run_job([sys.executable, str(JOBS / "train_job.py"), "--out", str(out), *CONFIG_JOB, *args], timeout, env,
                   ranks=job_ranks(args))


def ranks_of(out: Path, result: JobResult) -> list[dict[str, Any]]:
    result.check()
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["config"] == ranks[1]["config"]
    for r in ranks:
        assert r["global_step"] >= 3 and all(math.isfinite(x) for x in r["step_losses"])
    written = json.loads((Path(ranks[0]["log_dir"]) / "deepspeed_config.json").read_text())  # next to the logs
    assert written == ranks[0]["config"]
    assert result.output.count("DeepSpeed config resolved") == 1  # logged once, on rank 0
    assert '"zero_optimization": {' not in result.output  # one line per filled key; the JSON stays in the file
    assert "all_gather_into_tensor" not in result.output  # DeepSpeed's use of a deprecated torch call, silenced
    return ranks


def test_seed_config_verbatim_from_env_var(tmp_path: Path) -> None:
    path = EXAMPLES / "zero2_bf16.json"
    result = run_config_job(tmp_path, "--batch-size", "8", env={"PL_DEEPSPEED_CONFIG_PATH": str(path)})
    r = ranks_of(tmp_path, result)[0]
    seed = json.loads(path.read_text())
    assert r["config"] == {**seed, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
                           "gradient_accumulation_steps": 1}
    assert (r["zero_stage"], r["gradient_clipping"], r["basic_optimizer"]) == (2, 1.0, "AdamW")
    # on CPU the AdamW that left fused to torch steps ZeRO's partition with torch's fused kernel, and the log says so
    assert r["fused"] == [True]
    assert result.output.count("optimizer: AdamW(fused=True) from configure_optimizers (cpu default:") == 1


@pytest.mark.parametrize("name", ["zero1_bf16", "zero3_bf16"])
def test_shipped_config(tmp_path: Path, name: str) -> None:
    result = run_config_job(tmp_path, "--config", str(EXAMPLES / f"{name}.json"), "--batch-size", "4", "--csv-logger")
    r = ranks_of(tmp_path, result)[0]
    assert r["log_dir"] == str(tmp_path / "lightning_logs" / "version_0")  # the logger's directory
    assert "exists and is not empty" not in result.output  # written after the logger created its directory
    zero = r["config"]["zero_optimization"]
    stage = int(name[4])
    assert r["zero_stage"] == stage
    assert (r["config"]["train_micro_batch_size_per_gpu"], r["config"]["train_batch_size"]) == (4, 8)
    assert zero["reduce_bucket_size"] == 4096  # hidden 64 -> 64**2, not DeepSpeed's 5e8
    if stage == 3:
        assert {k: zero[k] for k in BUCKETS} == BUCKETS
    else:
        assert zero["allgather_bucket_size"] == 4096


def test_zero2_offload_trains_torch_adamw_as_cpu_adam(tmp_path: Path) -> None:
    result = run_config_job(tmp_path, "--config", str(EXAMPLES / "zero2_offload_bf16.json"), timeout=600)
    r = ranks_of(tmp_path, result)
    assert [(x["basic_optimizer"], x["adam_w_mode"]) for x in r] == [("DeepSpeedCPUAdam", True)] * 2
    assert r[0]["config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert result.output.count("ZeRO-Offload: training with DeepSpeedCPUAdam (adamw_mode=True) in place of the"
                               " torch.optim.AdamW") == 1


def test_zero3_offload_keeps_the_module_scheduler(tmp_path: Path) -> None:
    result = run_config_job(tmp_path, "--config", str(EXAMPLES / "zero3_offload_bf16.json"),
                            "--optimizer", "adam_sched", timeout=600)
    r = ranks_of(tmp_path, result)[0]
    assert (r["basic_optimizer"], r["adam_w_mode"], r["zero_stage"]) == ("DeepSpeedCPUAdam", False, 3)
    assert r["step_lrs"] == pytest.approx([0.01 / 2, 0.01 / 3, 0.01 / 4])  # LambdaLR 1/(step+1), stepped per step
    assert "overridden after learning rate scheduler" not in result.output


def test_all_auto_config(tmp_path: Path) -> None:
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
    }
    path = tmp_path / "all_auto.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "out"
    result = run_config_job(out, "--config", str(path), "--optimizer", "none", "--accumulate", "2", "--clip", "0.5",
                            "--batch-size", "8", "--max-steps", "4")
    r = ranks_of(out, result)[0]
    c = r["config"]
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (8, 2, 32)
    assert (c["gradient_clipping"], c["bf16"], c["fp16"]) == (0.5, {"enabled": True}, {"enabled": False})
    assert c["optimizer"]["params"] == {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-7, "weight_decay": 0.01,
                                        "torch_adam": True}  # the job's hparams
    assert c["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                        "total_num_steps": 4}
    assert {k: c["zero_optimization"][k] for k in BUCKETS} == BUCKETS
    # the engine runs what the config says: DeepSpeed's own optimizer and scheduler, accumulation and clipping
    assert (r["basic_optimizer"], r["gradient_accumulation_steps"], r["gradient_clipping"]) == ("AdamW", 2, 0.5)
    assert r["global_step"] == 4 and len(r["step_losses"]) == 8
    lrs = r["step_lrs"][1::2]  # after each optimizer step: warm-up to 0.01 in 2 steps, then decay
    assert lrs[1] == pytest.approx(0.01) and lrs[0] < lrs[1] and lrs[3] < lrs[2]


def test_default_config_sizes_buckets_from_the_model(tmp_path: Path) -> None:
    r = ranks_of(tmp_path, run_config_job(tmp_path, "--stage", "3"))[0]
    zero = r["config"]["zero_optimization"]
    assert {k: zero[k] for k in BUCKETS} == BUCKETS  # not Lightning's 2e8 (400 MB per bf16 bucket)
    assert r["config"]["train_micro_batch_size_per_gpu"] == 8 and r["zero_stage"] == 3


def test_contradictions_stop_before_training(tmp_path: Path) -> None:
    config = json.loads((EXAMPLES / "zero2_bf16.json").read_text())
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, gradient_clipping=1.0)
    path = tmp_path / "contradicts.json"
    path.write_text(json.dumps(config))
    result = run_config_job(tmp_path / "out", "--config", str(path), "--stage", "3", "--clip", "0.5", timeout=300)
    assert not result.timed_out and result.returncode != 0
    out = result.output
    assert f"ConfigError: DeepSpeed config ({path}) does not fit this Trainer: 4 problems:" in out
    for line in (
        "zero_optimization.stage: the config has 2, HPUDeepSpeedStrategy(stage=3) gives 3; remove the key or the"
        " argument",
        'gradient_accumulation_steps: the config has 2, Trainer(accumulate_grad_batches=1) gives 1; set it to "auto"',
        "train_micro_batch_size_per_gpu: the config has 4, the train DataLoader's batch_size gives 8; set it to"
        ' "auto"',
        'gradient_clipping: the config has 1.0, Trainer(gradient_clip_val=0.5) gives 0.5; set it to "auto"',
    ):
        assert f"  - {line}" in out
    assert "rank 0 done" not in out and not list((tmp_path / "out").glob("rank*.json"))
