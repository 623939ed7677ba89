"""Bad input a new user gives: each is refused before any rank or training starts, with an error that names the
value and how to fix it, and leaves no file or process behind. Items that are about processes start real ones
(tests/procs.py owns them) and are marked ``multiprocess``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_gaudi_ds.launch import DistributedRunner
from tests.procs import JobResult, LiveJob, run_job


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


# ------------------------------------------------------------------------------------- strategy and config
def _trainer(tmp_path: Path, strategy: object, **kwargs: object) -> object:
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, default_root_dir=tmp_path, logger=False,
                     **kwargs)


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_offload_parameters_with_a_stage_2_config_is_refused(empty_cwd: Path) -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    with pytest.raises(MisconfigurationException, match=r"offload_parameters=True\)` with the DeepSpeed config "
                                                        r"\(dict\) at ZeRO stage 2: parameter offload needs stage 3"):
        HPUDeepSpeedStrategy(offload_parameters=True, config={"zero_optimization": {"stage": 2}})
    with pytest.raises(MisconfigurationException, match=r"offload_param: parameter offload needs ZeRO stage 3"):
        HPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    HPUDeepSpeedStrategy(offload_parameters=True, config={"zero_optimization": {"stage": 3}})  # the working form
    assert _files(empty_cwd) == []


def test_nvme_offload_without_a_path_is_refused_and_creates_nothing(empty_cwd: Path) -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    existed = Path("/local_nvme").exists()
    with pytest.raises(MisconfigurationException) as err:
        _trainer(empty_cwd, "hpu_deepspeed_stage_3_offload_nvme")
    message = str(err.value)
    if not existed:
        assert "nvme_path='/local_nvme' does not exist" in message and "HPUDeepSpeedStrategy(nvme_path=...)" in message
        assert not Path("/local_nvme").exists()
    assert _files(empty_cwd) == []


def test_nvme_offload_checks_the_path_and_libaio(empty_cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy
    from lightning_gaudi_ds.config import ConfigError

    args = dict(stage=3, offload_optimizer=True, offload_parameters=True, remote_device="nvme",
                offload_params_device="nvme", offload_optimizer_device="nvme")
    monkeypatch.setattr("lightning_gaudi_ds.config.load.libaio_available", lambda: False)
    with pytest.raises(ConfigError, match=r"async_io op, which needs libaio.*apt-get install libaio-dev"):
        HPUDeepSpeedStrategy(nvme_path=str(empty_cwd), **args)
    (empty_cwd / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"nvme_path='{empty_cwd}/file' is not a directory"):
        HPUDeepSpeedStrategy(nvme_path=str(empty_cwd / "file"), **args)
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    with pytest.raises(ConfigError, match=r"offload_param.nvme_path: NVMe offload needs a directory.*set "
                                          r"zero_optimization.offload_param.nvme_path in the config \(dict\)"):
        HPUDeepSpeedStrategy(config=config)
    monkeypatch.setattr("lightning_gaudi_ds.config.load.libaio_available", lambda: True)
    HPUDeepSpeedStrategy(nvme_path=str(empty_cwd), **args)
    assert _files(empty_cwd) == [empty_cwd / "file"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"gradient_clipping": "1.0"}, 'gradient_clipping: "1.0" is not allowed; pass a finite number >= 0'),
        ({"gradient_clipping": float("nan")}, "gradient_clipping: NaN is not allowed"),
        ({"gradient_clipping": -1}, "gradient_clipping: -1 is not allowed"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu: 0 is not allowed; pass a whole"),
        ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps: 1.5 is not allowed"),
        ({"zero_optimization": True}, 'zero_optimization: expected a JSON object such as {"stage": 2}, got true.'
                                      ' DeepSpeed\'s old boolean form means {"stage": 1}'),
        ({"bf16": True}, 'bf16: expected a JSON object such as {"enabled": true}, got true'),
        ({"optimizer": "adam"}, 'optimizer: expected {"type": "<name>", "params": {...}}, got "adam"'),
    ],
    ids=["clip-str", "clip-nan", "clip-negative", "micro-0", "accum-float", "zero-true", "bf16-true", "optimizer-str"],
)
def test_config_values_of_the_wrong_type_are_refused_at_construction(empty_cwd: Path, config: dict,
                                                                      message: str) -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    with pytest.raises(MisconfigurationException) as err:
        _trainer(empty_cwd, HPUDeepSpeedStrategy(config=config))
    assert message in str(err.value)
    assert _files(empty_cwd) == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"devcie": "cpu"}}},
         "zero_optimization.offload_optimizer.devcie: not a DeepSpeed config key. Did you mean"
         " 'zero_optimization.offload_optimizer.device'?"),
        ({"bf16": {"enabeld": True}}, "bf16.enabeld: not a DeepSpeed config key. Did you mean 'bf16.enabled'?"),
        ({"fp16": {"loss_scale_windw": 100}}, "Did you mean 'fp16.loss_scale_window'?"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}},
         'zero_optimization.reduce_bucket_size: "big" is not valid: Input should be a valid integer'),
        ({"optimizer": {"type": "AdamW", "params": {"lrr": 0.001}}},
         "optimizer.params.lrr: not an argument of FusedAdam (DeepSpeed's 'AdamW' optimizer here). Did you mean"
         " 'optimizer.params.lr'?"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True, "weight_decy": 0.1}}},
         "optimizer.params.weight_decy: not an argument of AdamW"),
    ],
    ids=["offload-devcie", "bf16-enabeld", "fp16-window", "bucket-big", "adam-lrr", "torch-adam-decay"],
)
def test_nested_typos_and_types_are_named_with_did_you_mean(empty_cwd: Path, config: dict, message: str) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy
    from lightning_gaudi_ds.config import ConfigError

    with pytest.raises(ConfigError) as err:
        HPUDeepSpeedStrategy(config=config)
    assert message in str(err.value)
    assert len(str(err.value).splitlines()) <= 3  # the problem, not a traceback
    assert _files(empty_cwd) == []


def test_a_valid_nested_config_passes(empty_cwd: Path) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "bf16": {"enabled": "auto"}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95], "torch_adam": True}}}
    assert HPUDeepSpeedStrategy(config=config).config["zero_optimization"]["stage"] == 3


def test_config_path_that_is_a_directory(empty_cwd: Path) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy
    from lightning_gaudi_ds.config import ConfigError

    with pytest.raises(ConfigError, match=rf"DeepSpeed config path '{empty_cwd}' is a directory; pass the JSON file"):
        HPUDeepSpeedStrategy(config=str(empty_cwd))


def test_huge_configs_give_short_errors(empty_cwd: Path) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy
    from lightning_gaudi_ds.config import ConfigError

    with pytest.raises(ConfigError) as err:
        HPUDeepSpeedStrategy(config={f"unknown_key_{i}": i for i in range(20_000)})
    lines = str(err.value).splitlines()
    assert "20000 problems" in lines[0] and lines[-1] == "  ... and 19980 more" and len(lines) == 22
    huge = "x" * 5_000_000
    with pytest.raises(ConfigError) as err:
        HPUDeepSpeedStrategy(config=huge)
    assert len(str(err.value)) < 1000 and "(5000000 characters)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        HPUDeepSpeedStrategy(config={"gradient_clipping": huge})
    assert len(str(err.value)) < 1000


# ------------------------------------------------------------------------------------------------ rendezvous
_TWO_NODES = """
import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_gaudi_ds import HPUDeepSpeedStrategy

trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=HPUDeepSpeedStrategy(stage=2), max_steps=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(BoringModel())
print("TRAINED")
"""


@pytest.mark.multiprocess
def test_num_nodes_2_without_a_second_node_says_what_it_waits_for_and_fails_in_bounded_time(tmp_path: Path) -> None:
    script = tmp_path / "two_nodes.py"
    script.write_text(_TWO_NODES)
    job = LiveJob([sys.executable, str(script)], env={"LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT": "8"}, cwd=tmp_path)
    try:
        first = job.wait_for("waits for 2 processes (Trainer(num_nodes=2) x 1 per node) to meet at 127.0.0.1:",
                             timeout=120)
        result = job.wait(timeout=60)
    finally:
        job.kill()
    assert not result.timed_out, result.output[-3000:]
    ended = job.lines[-1][0]
    assert result.returncode != 0 and "TRAINED" not in result.output
    assert "The ranks did not meet within 8 s" in result.output and "NODE_RANK" in result.output
    assert "lightning-gaudi-ds spawn --hostfile hosts" in result.output and "LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT" in \
        result.output
    assert result.output.count("waited ") >= 2  # it keeps saying it
    assert ended - first < 30  # bounded: 8 s, plus start-up of the error path
    assert job.leftovers() == []
    assert _files(tmp_path) == [script]


def test_a_bad_rendezvous_timeout_is_refused_at_trainer_construction(empty_cwd: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    monkeypatch.setenv("LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT", "-3")
    with pytest.raises(ValueError, match=r"LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT='-3': pass the seconds"):
        _trainer(empty_cwd, HPUDeepSpeedStrategy(), num_nodes=2)
    assert _files(empty_cwd) == []


# ------------------------------------------------------------------------------------------------ checkpoints
def _stage_0_checkpoint(root: Path) -> Path:
    import torch

    from tests.test_checkpoint import fake_checkpoint

    path = fake_checkpoint(root, stage=0, world_size=1)
    model_states = path / "checkpoint" / "mp_rank_00_model_states.pt"
    state = torch.load(model_states, weights_only=False)
    state["module"] = {"w": torch.ones(2)}
    torch.save(state, model_states)
    return path


def test_convert_refuses_to_overwrite_and_leaves_nothing_behind(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_gaudi_ds.cli import main

    ckpt = _stage_0_checkpoint(tmp_path)
    existing = tmp_path / "existing.pt"
    existing.write_text("keep me")
    folder = tmp_path / "folder"
    folder.mkdir()
    before = _files(tmp_path)
    assert main(["convert", str(ckpt), str(existing)]) == 2
    assert f"error: output '{existing}' exists; pass --overwrite" in capsys.readouterr().out
    assert existing.read_text() == "keep me"
    assert main(["convert", str(ckpt), str(folder)]) == 2
    assert f"error: output '{folder}' is a directory; pass a file name" in capsys.readouterr().out
    assert main(["convert", str(ckpt), str(ckpt / "checkpoint" / "out.pt")]) == 2
    assert "is inside the checkpoint" in capsys.readouterr().out
    assert _files(tmp_path) == before  # no *.partial anywhere
    assert main(["convert", str(ckpt), str(existing), "--overwrite"]) == 0
    assert existing.read_bytes()[:2] == b"PK"  # a torch file now


def test_a_failed_conversion_removes_its_partial_file_and_new_folders(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_gaudi_ds.checkpoint import convert

    ckpt = _stage_0_checkpoint(tmp_path)
    before = _files(tmp_path)

    def broken(obj: object, out: Path, *args: object) -> None:
        Path(out).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(convert.torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        convert.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "new" / "dir" / "model.pt")
    assert _files(tmp_path) == before


def test_a_truncated_optimizer_shard_without_manifest_is_named(tmp_path: Path) -> None:
    from lightning_gaudi_ds.checkpoint import IncompleteCheckpointError, validate_checkpoint
    from tests.test_checkpoint import fake_checkpoint

    path = fake_checkpoint(tmp_path, stage=2)
    shard = path / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:-40])
    with pytest.raises(IncompleteCheckpointError,
                       match=r"missing: checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt \(truncated\)"):
        validate_checkpoint(path)


def test_every_file_the_example_configs_mention_exists() -> None:
    import re

    repo = Path(__file__).resolve().parents[1]
    mentioned = {m for cfg in (repo / "examples" / "configs").glob("*.yaml")
                 for m in re.findall(r"(?:examples|scripts|benchmarks)/[\w/.-]+\.(?:json|yaml|py|sh)", cfg.read_text())}
    assert mentioned and sorted(m for m in mentioned if not (repo / m).is_file()) == []


# ------------------------------------------------------------------------------------------------ first run
def test_the_op_cache_is_one_per_environment(tmp_path: Path) -> None:
    from lightning_gaudi_ds import _compat
    from lightning_gaudi_ds.jit_ops import locks

    tag = _compat.extensions_tag()
    assert locks.environment_cache_dir("/envs/a", "/usr", {}) == Path("/envs/a/torch_extensions", tag)
    assert locks.environment_cache_dir("/envs/b", "/usr", {}) != locks.environment_cache_dir("/envs/a", "/usr", {})
    conda = "/opt/conda/envs/c"
    assert locks.environment_cache_dir(conda, conda, {"CONDA_PREFIX": conda}) == Path(conda, "torch_extensions", tag)
    assert locks.environment_cache_dir("/usr", "/usr", {}) is None  # a system Python keeps torch's default
    environ: dict[str, str] = {}
    root = locks.extensions_root(environ)
    if sys.prefix != sys.base_prefix:
        assert root == Path(sys.prefix, "torch_extensions", tag)
    assert environ == {}  # chosen, not exported (tests/test_environ.py)
    mine = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    assert locks.extensions_root(mine) == tmp_path and mine == {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    assert _files(tmp_path) == []  # deciding creates nothing



def test_convert_to_a_folder_that_cannot_be_made_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_gaudi_ds.cli import main

    ckpt = _stage_0_checkpoint(tmp_path)
    (tmp_path / "file").write_text("")
    before = _files(tmp_path)
    assert main(["convert", str(ckpt), str(tmp_path / "file" / "sub" / "model.pt")]) == 2
    assert f"error: writing {tmp_path / 'file' / 'sub' / 'model.pt'}: " in capsys.readouterr().out
    assert _files(tmp_path) == before


# ------------------------------------------------------------------------------------------------ round 3 (issue 30)
@pytest.mark.parametrize(
    ("kwargs", "named", "allowed"),
    [
        ({"offload_optimizer": True, "offload_optimizer_device": "cpuu"}, "offload_optimizer_device='cpuu'",
         "Input should be 'none', 'cpu' or 'nvme'"),
        ({"reduce_bucket_size": -1}, "reduce_bucket_size=-1", "Input should be greater than"),  # 0.19: > 0, 0.16: >= 0
        ({"remote_device": "gpu"}, "remote_device='gpu'", "Allowed: None (the training device, the default), 'cpu'"
                                                          " or 'nvme'"),
        ({"number_checkpoints": -1}, "number_checkpoints=-1", "a whole number >= 1, or None"),
    ],
    ids=["offload-cpuu", "bucket-negative", "remote-gpu", "checkpoints-negative"],
)
def test_strategy_arguments_are_validated_like_a_config(empty_cwd: Path, kwargs: dict, named: str,
                                                         allowed: str) -> None:
    import torch

    from lightning_gaudi_ds import HPUDeepSpeedStrategy
    from lightning_gaudi_ds.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _trainer(empty_cwd, HPUDeepSpeedStrategy(stage=3, **kwargs), max_steps=1)
    message = str(err.value)
    assert named in message and allowed in message, message
    assert len(message.splitlines()) <= 2 and "Traceback" not in message  # the problem, not pydantic's report
    assert not torch.distributed.is_initialized()
    assert _files(empty_cwd) == []


def test_auto_stage_measure_activations_must_be_a_boolean(empty_cwd: Path) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy
    from lightning_gaudi_ds.config import ConfigError

    with pytest.raises(ConfigError, match=r"measure_activations='false'\)` is not a boolean; pass True or False"):
        _trainer(empty_cwd, HPUDeepSpeedStrategy(stage="auto", device_memory="1GiB", measure_activations="false"))
    assert _files(empty_cwd) == []


def test_bf16_enabled_yes_is_refused_at_construction_as_not_a_boolean(empty_cwd: Path) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy
    from lightning_gaudi_ds.config import ConfigError

    with pytest.raises(ConfigError) as err:
        HPUDeepSpeedStrategy(config={"bf16": {"enabled": "yes"}})  # before any Trainer exists
    assert 'bf16.enabled: "yes" is not a boolean; write true, false or "auto"' in str(err.value)
    assert _files(empty_cwd) == []


_NODE_KEYS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK",
              "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def test_num_nodes_2_with_no_cluster_environment_is_refused_at_once(empty_cwd: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lightning_gaudi_ds import HPUDeepSpeedStrategy
    from lightning_gaudi_ds.config import ConfigError

    for key in _NODE_KEYS:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError) as err:
        _trainer(empty_cwd, HPUDeepSpeedStrategy(), num_nodes=2)
    message = str(err.value)
    assert "Trainer(num_nodes=2)" in message and "none of MASTER_ADDR, MASTER_PORT, NODE_RANK" in message
    assert "lightning-gaudi-ds spawn --hostfile hosts" in message and "Trainer(num_nodes=1)" in message
    assert not torch.distributed.is_initialized()
    # Started by hand on every node (Lightning's documented way): the Trainer is built, the rendezvous waits
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("NODE_RANK", "1")
    trainer = _trainer(empty_cwd, HPUDeepSpeedStrategy(), num_nodes=2)
    assert (trainer.num_nodes, trainer.node_rank) == (2, 1)
    assert _files(empty_cwd) == []


def test_lightning_cli_lifts_the_strategys_own_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_gaudi_ds import LightningCLI

    monkeypatch.setattr("sys.argv", ["train.py"])
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    run = tmp_path / "configs" / "run.yaml"  # init_args.config relative to the YAML's folder, run from another one
    run.write_text("trainer:\n  accelerator: cpu\n  strategy:\n"
                   "    class_path: lightning_gaudi_ds.HPUDeepSpeedStrategy\n    init_args:\n      config: ds.json\n")
    monkeypatch.chdir(tmp_path)
    common = ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
    cases = [
        (["--config", str(run)], "path does not exist: 'ds.json'",
         f"A relative path is read from the current directory, {tmp_path}."),
        (["--trainer.accelerator", "cpu", "--trainer.strategy", "lightning_gaudi_ds.HPUDeepSpeedStrategy",
          "--trainer.strategy.stage", "5"], "`HPUDeepSpeedStrategy(stage=5)` is not a ZeRO stage",
         "Allowed: 0, 1, 2, 3"),
    ]
    for args, bad, allowed in cases:
        with pytest.raises(ValueError) as err:
            LightningCLI(BoringModel, args=common + args, run=False, save_config_callback=None)
        message = str(err.value)
        assert message.startswith("--trainer.strategy lightning_gaudi_ds.HPUDeepSpeedStrategy: "), message[:300]
        assert bad in message and allowed in message and "Expected a <class 'str'>" not in message
        assert err.value.__suppress_context__ and len(message.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["configs", "ds.json", "run.yaml"]


_PREDICT_WITH_POLICY = """
import sys
import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_gaudi_ds import HPUDeepSpeedStrategy


class Model(BoringModel):
    def predict_step(self, batch):
        print("PREDICT STEP RAN", flush=True)
        return super().predict_step(batch)


policy = {"class": {torch.nn.TransformerEncoderLayer: ("linear2",)}, "layer": {Model: ("no_such_linear",)}}[sys.argv[1]]
trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    strategy=HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 1}, injection_policy=policy))
trainer.predict(Model())
print("PREDICTED")
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(("which", "named"), [
    ("class", "TransformerEncoderLayer: the model has no module of this class"),
    ("layer", "Model: no linear layer named 'no_such_linear' (its linear layers: ['layer'])"),
])
def test_injection_policy_that_matches_nothing_is_refused_at_tp_size_1(tmp_path: Path, which: str,
                                                                        named: str) -> None:
    script = tmp_path / "predict.py"
    script.write_text(_PREDICT_WITH_POLICY)
    done = run_job([sys.executable, str(script), which], timeout=240, cwd=tmp_path, warm=True)
    assert not done.timed_out and done.returncode != 0, done.output[-3000:]
    assert "injection_policy=...) does not match the model" in done.output and named in done.output, \
        done.output[-3000:]
    assert "PREDICT STEP RAN" not in done.output and "PREDICTED" not in done.output
    assert _files(tmp_path) == [script]


def _plan(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> JobResult:
    return run_job([sys.executable, "-m", "lightning_gaudi_ds", "plan", *argv], timeout=120, cwd=cwd, env=env,
                   warm=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("argv", "expected"), [
    (["--params", "inf"], "argument --params: 'inf' is not allowed; pass a whole, finite number of trainable"
                          " parameters > 0"),
    (["--params", "nan"], "argument --params: 'nan' is not allowed"),
    (["--params", "-7e9"], "argument --params: '-7e9' is not allowed"),
    (["--params", "7e9", "--devices", "0"], "argument --devices: 0 is not allowed; pass a whole number >= 1"),
    (["--params", "7e9", "--param-groups", "0"], "argument --param-groups: 0 is not allowed; pass a whole number"),
    (["--params", "7e9", "--param-groups", "-3"], "argument --param-groups: -3 is not allowed"),
    (["--params", "7e9", "--hidden-size", "-4096"], "argument --hidden-size: -4096 is not allowed; pass a whole"),
    (["--params", "7e9", "--hidden-size", "0"], "argument --hidden-size: 0 is not allowed"),
    (["--params", "7e9", "--device-memory", "-24GiB"], "--device-memory='-24GiB' must be a positive size. Use a"
                                                       " number of bytes"),
    (["--hf-config", "hf"], "hidden_size=-4096 is not allowed; a model size is a whole number >= 1"),
    (["--model", "examples.train_lm"], "--model 'examples.train_lm' is a module; add ':ClassName' to name the model"
                                       " class in it. The torch.nn.Module classes there: "),
], ids=["params-inf", "params-nan", "params-negative", "devices-0", "groups-0", "groups-negative", "hidden-negative",
        "hidden-0", "memory-negative", "hf-negative-hidden", "model-without-class"])
def test_plan_refuses_bad_values_in_one_line(tmp_path: Path, argv: list[str], expected: str) -> None:
    from tests.procs import REPO

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": -4096, "num_hidden_layers": 2, "num_attention_heads": 32,'
        ' "intermediate_size": 1000, "vocab_size": 1000}')
    argv = [str(tmp_path / "hf") if a == "hf" else a for a in argv]
    done = _plan(*argv, cwd=REPO if "--model" in argv else tmp_path)
    lines = [line for line in done.output.splitlines() if "[WARNING]" not in line]  # DeepSpeed's import notice
    assert done.returncode == 2 and len(lines) == 1, done.output[-3000:]
    assert lines[0].startswith("lightning-gaudi-ds plan: error: ") and expected in lines[0], lines[0]
    if "--model" in argv:
        assert "examples.train_lm:GPT" in lines[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "hf"]


@pytest.mark.multiprocess
def test_plan_on_cpu_says_to_pass_device_memory(tmp_path: Path) -> None:
    done = _plan("--params", "1e9", "--devices", "2", cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})  # a CPU
    assert done.returncode == 0 and "device memory ?" in done.output, done.output[-3000:]
    assert "fits: no accelerator here to read the device memory from" in done.output
    assert "pass --device-memory, the memory of one device (e.g. --device-memory 96GB)" in done.output
    assert _files(tmp_path) == []


@pytest.mark.multiprocess
def test_spawn_log_dir_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "ran.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    done = run_job([sys.executable, "-m", "lightning_gaudi_ds", "spawn", "--world_size", "2", "--master_port", "0",
                    "--log_dir", "/proc/nope/logs", str(script)], timeout=60, cwd=tmp_path)
    lines = done.output.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.output[-3000:]
    assert "error: log_dir='/proc/nope/logs': " in lines[0] and "Traceback" not in done.output
    assert "pass a directory you can write to" in lines[0]
    assert _files(tmp_path) == [script]  # no rank ran


@pytest.mark.multiprocess
def test_num_nodes_2_alone_fails_at_once_without_waiting(tmp_path: Path) -> None:
    script = tmp_path / "two_nodes.py"
    script.write_text(_TWO_NODES)
    # What a user's shell has: no launcher, no MASTER_ADDR/MASTER_PORT (job_env sets them for other tests)
    done = run_job([sys.executable, str(script)], timeout=120, cwd=tmp_path,
                   env={"MASTER_ADDR": None, "MASTER_PORT": None}, warm=True)
    assert not done.timed_out and done.returncode != 0, done.output[-3000:]
    assert "Trainer(num_nodes=2), but this process runs on its own" in done.output, done.output[-3000:]
    assert "waits for" not in done.output and "TRAINED" not in done.output
    assert done.seconds < 60  # not the 600 s rendezvous time-out
    assert _files(tmp_path) == [script]
