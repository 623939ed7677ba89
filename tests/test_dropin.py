"""Drop-in for Lightning's ``DeepSpeedStrategy``: the same exception types and semantics, right where Lightning fails.

The intent of each case of Lightning 2.6's own DeepSpeed strategy tests that can hold on CPU, with
``HPUDeepSpeedStrategy``: exception types, the config from a path or ``PL_DEEPSPEED_CONFIG_PATH``, precision
choice, ``logging_batch_size_per_gpu``, the CUDA device-index check (CUDA mocked as Lightning's tests mock it),
activation checkpointing. Where this strategy deliberately differs (config optimizer or precision that contradict
the code), the error says so. The multiprocess tests run tests/jobs/dropin_job.py for real on 2 (and 1) CPU ranks:
ZeRO-3 evaluation from a sharded checkpoint on a fresh Trainer, contiguous activation checkpointing,
``logging_batch_size_per_gpu``, and the warning about ZeRO-3 parameters after fit.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import lightning.fabric.accelerators.cuda
import lightning.pytorch.accelerators.cuda
import pytest
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins import DeepSpeedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_gaudi_ds
from lightning_gaudi_ds import ConfigError, HPUDeepSpeedStrategy
from lightning_gaudi_ds.config import AutoContext, ConfigResolver, resolve_config
from lightning_gaudi_ds.config.validate import check_device_indices
from tests.procs import JOBS, run_job

LIGHTNING_STYLE_CONFIG = {  # the shape of the config Lightning's tests use
    "optimizer": {"type": "SGD", "params": {"lr": 3e-5}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 100}},
}


def _mock_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """As Lightning's tests_pytorch conftest mocks CUDA devices."""
    monkeypatch.setattr(lightning.fabric.accelerators.cuda, "num_cuda_devices", lambda: count)
    monkeypatch.setattr(lightning.pytorch.accelerators.cuda, "num_cuda_devices", lambda: count)


def _trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _resolve(config: dict[str, Any], **ctx: Any) -> dict[str, Any]:
    return resolve_config(config, AutoContext(**ctx)).config


# --------------------------------------------------------------------------------- strategy and config
@pytest.mark.parametrize("strategy", ["hpu_deepspeed", HPUDeepSpeedStrategy])
def test_strategy_by_name_or_instance(strategy: Any) -> None:
    trainer = _trainer(accelerator="cpu", fast_dev_run=True, strategy=strategy if isinstance(strategy, str) else strategy())
    assert isinstance(trainer.strategy, HPUDeepSpeedStrategy)
    assert trainer.strategy.parallel_devices == [torch.device("cpu")]


def test_config_from_env_path_with_a_strategy_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(LIGHTNING_STYLE_CONFIG))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    assert HPUDeepSpeedStrategy().config == LIGHTNING_STYLE_CONFIG
    trainer = _trainer(accelerator="cpu", fast_dev_run=True, strategy="hpu_deepspeed")
    assert trainer.strategy.config == LIGHTNING_STYLE_CONFIG


def test_defaults_build_a_zero_config() -> None:
    assert isinstance(HPUDeepSpeedStrategy().config["zero_optimization"], dict)


def test_missing_config_path_is_a_misconfiguration() -> None:
    with pytest.raises(MisconfigurationException, match="path to a DeepSpeed config but the path does not exist") as err:
        HPUDeepSpeedStrategy(config="invalid_path.json")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, lightning_gaudi_ds.ConfigNotFoundError)
    assert "'invalid_path.json'. Pass an existing JSON file or a dict, or unset PL_DEEPSPEED_CONFIG_PATH" in str(err.value)


def test_precision_plugin_on_mocked_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _mock_cuda(monkeypatch, 1)
    trainer = _trainer(fast_dev_run=True, accelerator="gpu", strategy="hpu_deepspeed", precision="16-mixed")
    assert isinstance(trainer.strategy, HPUDeepSpeedStrategy)
    assert isinstance(trainer.strategy.precision_plugin, DeepSpeedPrecision)
    assert trainer.strategy.precision_plugin.precision == "16-mixed"


def test_fp16_loss_scale_arguments_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    _mock_cuda(monkeypatch, 1)
    strategy = HPUDeepSpeedStrategy(loss_scale=10, initial_scale_power=11, loss_scale_window=12, hysteresis=13,
                                    min_loss_scale=14)
    _trainer(accelerator="gpu", devices=1, precision="16-mixed", strategy=strategy)
    strategy._format_config()
    fp16 = strategy.config["fp16"]
    assert fp16["enabled"] is True
    assert (fp16["loss_scale"], fp16["initial_scale_power"], fp16["loss_scale_window"], fp16["hysteresis"],
            fp16["min_loss_scale"]) == (10, 11, 12, 13, 14)


def test_config_with_offload_turned_off_stays_off() -> None:
    config = {**LIGHTNING_STYLE_CONFIG, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    strategy = HPUDeepSpeedStrategy(config=config)
    _trainer(accelerator="cpu", strategy=strategy)
    strategy._format_config()
    assert strategy.config["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    # Lightning's test writes `false`, which DeepSpeed 0.19's schema refuses: kept as Lightning keeps it, and left out
    # of what DeepSpeed gets (tests/test_config.py)
    config["zero_optimization"]["offload_optimizer"] = False
    assert HPUDeepSpeedStrategy(config=config).config["zero_optimization"]["offload_optimizer"] is False


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_sharded_context_partitions_only_under_zero3(stage: int) -> None:
    import deepspeed

    strategy = HPUDeepSpeedStrategy(stage=stage)
    _trainer(accelerator="cpu", strategy=strategy)
    with mock.patch.object(deepspeed.zero, "Init") as zero_init, strategy.model_sharded_context():
        pass
    zero_init.assert_called_once_with(enabled=stage == 3, remote_device=None, config_dict_or_path=mock.ANY)


def test_zero_init_starts_in_the_environments_op_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """zero.Init builds ZeRO-Infinity's NVMe swapper as it starts, which loads the async_io and pin_memory ops: from
    the op cache the set-up built them in (torch's shared default would build them again), for its start only."""
    import contextlib
    import os

    import deepspeed

    from lightning_gaudi_ds.jit_ops.locks import extensions_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    seen: list[str | None] = []

    def start(**kwargs: Any) -> contextlib.AbstractContextManager[None]:
        seen.append(os.environ.get("TORCH_EXTENSIONS_DIR"))
        return contextlib.nullcontext()

    strategy = HPUDeepSpeedStrategy(stage=3)
    _trainer(accelerator="cpu", strategy=strategy)
    with mock.patch.object(deepspeed.zero, "Init", side_effect=start), strategy.model_sharded_context():
        assert "TORCH_EXTENSIONS_DIR" not in os.environ  # the user's configure_model runs without it
    assert seen == [str(extensions_root())] and "TORCH_EXTENSIONS_DIR" not in os.environ


@pytest.mark.parametrize("platform", ["Linux", "Windows"])
def test_distributed_environment_variables(platform: str) -> None:
    import deepspeed

    trainer = _trainer(accelerator="cpu", strategy=HPUDeepSpeedStrategy(stage=3))
    strategy = trainer.strategy
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    with mock.patch.dict("os.environ") as environ, \
            mock.patch.object(deepspeed, "init_distributed") as init_distributed, \
            mock.patch("platform.system", return_value=platform):
        for key in keys:
            environ.pop(key, None)
        strategy._init_deepspeed_distributed()
        seen = {key: environ.get(key) for key in keys}
    init_distributed.assert_called_once_with("gloo", distributed_port=mock.ANY, timeout=mock.ANY)
    if platform == "Windows":  # DeepSpeed sets them up itself there
        assert all(value is None for value in seen.values())
    else:
        env = strategy.cluster_environment
        assert seen == {"MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port),
                        "RANK": str(strategy.global_rank), "WORLD_SIZE": str(strategy.world_size),
                        "LOCAL_RANK": str(strategy.local_rank)}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: HPUDeepSpeedStrategy(stage=5), r"stage=5\)` is not a ZeRO stage"),
        (lambda: HPUDeepSpeedStrategy(stage=2, offload_parameters=True), "parameter offload needs ZeRO stage 3"),
        (lambda: HPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 7}}), "is not a ZeRO stage"),
    ],
)
def test_bad_arguments_and_configs_are_misconfigurations(make: Any, match: str) -> None:
    with pytest.raises(MisconfigurationException, match=match) as err:
        make()
    assert isinstance(err.value, ValueError)  # what callers caught before


def test_error_classes_are_lightnings_types_too() -> None:
    from lightning_gaudi_ds import (
        CheckpointError,
        CheckpointNotFoundError,
        ConfigNotFoundError,
        IncompleteCheckpointError,
        NotACheckpointError,
    )

    assert issubclass(ConfigError, MisconfigurationException) and issubclass(ConfigError, ValueError)
    assert issubclass(ConfigNotFoundError, FileNotFoundError) and issubclass(ConfigNotFoundError, ConfigError)
    assert issubclass(CheckpointError, MisconfigurationException) and issubclass(CheckpointError, ValueError)
    for error in (CheckpointNotFoundError, NotACheckpointError, IncompleteCheckpointError):
        assert issubclass(error, CheckpointError) and issubclass(error, FileNotFoundError)


def test_checkpoint_path_validation_suggests_the_parent(tmp_path: Path) -> None:
    strategy = HPUDeepSpeedStrategy()
    with pytest.raises(FileNotFoundError, match="The provided path is not a valid DeepSpeed checkpoint") as err:
        strategy.load_checkpoint(checkpoint_path=tmp_path)
    assert isinstance(err.value, lightning_gaudi_ds.NotACheckpointError) and "(contents: empty)" in str(err.value)
    tag = tmp_path / "checkpoint"  # the sub-folder Lightning saves into
    tag.mkdir()
    with pytest.raises(FileNotFoundError, match=f"Try to load using this parent directory instead: {tmp_path}"):
        strategy.load_checkpoint(checkpoint_path=tag)
    shard = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"  # a file inside that sub-folder
    shard.touch()
    with pytest.raises(FileNotFoundError, match=f"Try to load using this parent directory instead: {tmp_path}"):
        strategy.load_checkpoint(checkpoint_path=shard)
    single = tmp_path / "model.ckpt"  # a single-file Lightning checkpoint
    torch.save({"state_dict": {}}, single)
    with pytest.raises(FileNotFoundError, match=r"is a file, not a DeepSpeed ZeRO checkpoint directory.*"
                                                r"load_full_weights=True"):
        strategy.load_checkpoint(checkpoint_path=single)


def test_gradient_clipping_by_value_is_a_misconfiguration() -> None:
    trainer = _trainer(accelerator="cpu", strategy=HPUDeepSpeedStrategy(), gradient_clip_algorithm="value",
                       gradient_clip_val=0.5)
    model = BoringModel()
    model.trainer = trainer
    trainer.strategy.connect(model)
    with pytest.raises(MisconfigurationException, match="does not support clipping gradients by value") as err:
        trainer.strategy.setup_environment()  # before the process group starts
    assert "gradient_clip_algorithm='norm'" in str(err.value) and isinstance(err.value, ValueError)


# ------------------------------------------------- where this strategy refuses what Lightning silently takes
def test_config_precision_block_contradicting_the_trainer_says_how_lightning_differs() -> None:
    with pytest.raises(MisconfigurationException) as err:  # Lightning would enable fp16 beside the config's bf16
        _resolve({"bf16": {"enabled": True}}, precision="16-mixed")
    message = str(err.value)
    assert "bf16.enabled: the config has true, Trainer(precision='16-mixed') gives false" in message
    assert "Trainer(precision='bf16-mixed')" in message and "Lightning's DeepSpeedStrategy would silently" in message


def test_config_precision_block_under_a_32_bit_trainer_wins_as_in_lightning() -> None:
    with pytest.warns(UserWarning, match=r"wins over Trainer\(precision='32-true'\), as in Lightning's"):
        assert _resolve({"bf16": {"enabled": True}}, precision="32-true")["bf16"]["enabled"] is True


@pytest.mark.parametrize(("block", "precision"), [("bf16", "bf16-mixed"), ("fp16", "16-mixed")])
def test_config_precision_block_agreeing_with_the_trainer(block: str, precision: str) -> None:
    assert _resolve({block: {"enabled": True}}, precision=precision)[block]["enabled"] is True


# -------------------------------------------------------------------------------- logging_batch_size_per_gpu
def _resolved_with(strategy: HPUDeepSpeedStrategy, loader_batch: int | None, world_size: int = 2) -> dict[str, Any]:
    resolver: ConfigResolver = strategy._resolver
    start = resolver.start(strategy.config, hidden=None)
    return resolver.resolve(start, AutoContext(world_size=world_size, micro_batch_size=loader_batch))


@pytest.mark.parametrize(("value", "loader_batch", "expected"), [("auto", 16, 16), (10, 16, 10), ("auto", 1, 1),
                                                                 (10, 1, 10)])
def test_logging_batch_size_sets_deepspeeds_micro_batch(value: Any, loader_batch: int, expected: int) -> None:
    strategy = HPUDeepSpeedStrategy(logging_batch_size_per_gpu=value, zero_optimization=False)
    config = _resolved_with(strategy, loader_batch)
    assert config["train_micro_batch_size_per_gpu"] == expected
    resolved, hints = strategy._resolver.take_unpublished()
    differs = expected != loader_batch
    assert len(resolved.notes) == int(differs) and hints[: len(resolved.notes)] == list(resolved.notes)
    if differs:
        assert resolved.notes[0].startswith(f"DeepSpeed's train_micro_batch_size_per_gpu is {expected}"
                                            f" (HPUDeepSpeedStrategy(logging_batch_size_per_gpu={expected}))")
        assert f"DataLoader's batch_size is {loader_batch}" in resolved.notes[0]


def test_logging_batch_size_fills_a_user_configs_auto_and_contradicts_its_number() -> None:
    filled = HPUDeepSpeedStrategy(logging_batch_size_per_gpu=10, config={"train_micro_batch_size_per_gpu": "auto"})
    assert _resolved_with(filled, 16)["train_micro_batch_size_per_gpu"] == 10
    clash = HPUDeepSpeedStrategy(logging_batch_size_per_gpu=10, config={"train_micro_batch_size_per_gpu": 8})
    with pytest.raises(MisconfigurationException, match=r"train_micro_batch_size_per_gpu: the config has 8,"
                                                        r" HPUDeepSpeedStrategy\(logging_batch_size_per_gpu=10\)"
                                                        r" gives 10"):
        _resolved_with(clash, 16)


# ------------------------------------------------------------------------------ CUDA device indices
@pytest.mark.parametrize("device_indices", [[1], [1, 0], [0, 2], [3, 2, 1]])
def test_cuda_device_indices_must_match_local_ranks(device_indices: list[int]) -> None:
    strategy = HPUDeepSpeedStrategy(accelerator=mock.Mock(spec=CUDAAccelerator),
                                    parallel_devices=[torch.device("cuda", i) for i in device_indices])
    message = f"device indices {device_indices!r} don't match the local rank values of processes"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        strategy.setup_distributed()


@pytest.mark.parametrize("devices", [[1], [0, 2]])
def test_cuda_device_indices_are_refused_when_the_trainer_is_built(monkeypatch: pytest.MonkeyPatch,
                                                                   devices: list[int]) -> None:
    _mock_cuda(monkeypatch, 4)
    with pytest.raises(RuntimeError, match=re.escape(f"CUDA_VISIBLE_DEVICES={','.join(map(str, devices))}")):
        _trainer(accelerator="cuda", devices=devices, strategy=HPUDeepSpeedStrategy())


def test_cuda_devices_in_local_rank_order_and_devices_without_index_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    _mock_cuda(monkeypatch, 4)
    trainer = _trainer(accelerator="cuda", devices=2, strategy=HPUDeepSpeedStrategy())
    assert trainer.strategy.parallel_devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    for devices in ([torch.device("cpu")] * 2, [torch.device("hpu")] * 2):
        check_device_indices(devices)


# ------------------------------------------------------------------------------ activation checkpointing
def test_activation_checkpointing_arguments_reach_the_config() -> None:
    strategy = HPUDeepSpeedStrategy(partition_activations=True, cpu_checkpointing=True,
                                    contiguous_memory_optimization=True, synchronize_checkpoint_boundary=True,
                                    number_checkpoints=12)
    section = strategy.config["activation_checkpointing"]
    assert section["partition_activations"] and section["cpu_checkpointing"]
    assert section["contiguous_memory_optimization"] and section["synchronize_checkpoint_boundary"]
    assert section["number_checkpoints"] == 12


def test_contiguous_checkpointing_without_a_count_is_refused_when_the_trainer_is_built() -> None:
    strategy = HPUDeepSpeedStrategy(partition_activations=True, contiguous_memory_optimization=True)
    with pytest.raises(MisconfigurationException, match=r"activation_checkpointing\.number_checkpoints:"
                                                        r" contiguous_memory_optimization needs the number of") as err:
        _trainer(accelerator="cpu", strategy=strategy)
    assert '"number_checkpoints": N' in str(err.value) and "HPUDeepSpeedStrategy(number_checkpoints=N)" in str(err.value)


def test_contiguous_checkpointing_without_partitioning_is_refused() -> None:
    config = {"activation_checkpointing": {"contiguous_memory_optimization": True, "number_checkpoints": 4}}
    with pytest.raises(MisconfigurationException, match=r"only works with partitioned activations; set"
                                                        r" partition_activations to true"):
        _trainer(accelerator="cpu", strategy=HPUDeepSpeedStrategy(config=config))


def test_number_checkpoints_from_config_or_argument() -> None:
    section = {"partition_activations": True, "contiguous_memory_optimization": True}
    _trainer(accelerator="cpu", strategy=HPUDeepSpeedStrategy(
        config={"activation_checkpointing": {**section, "number_checkpoints": 4}}))
    strategy = HPUDeepSpeedStrategy(config={"activation_checkpointing": dict(section)}, number_checkpoints=6)
    _trainer(accelerator="cpu", strategy=strategy)
    assert strategy.config["activation_checkpointing"]["number_checkpoints"] == 6
    with pytest.raises(MisconfigurationException, match=r"number_checkpoints=6\) and the DeepSpeed config's"
                                                        r" activation_checkpointing\.number_checkpoints=4 disagree"):
        HPUDeepSpeedStrategy(config={"activation_checkpointing": {**section, "number_checkpoints": 4}},
                             number_checkpoints=6)


def test_activation_checkpointing_settings_are_all_forwarded_to_deepspeed() -> None:
    import deepspeed

    strategy = HPUDeepSpeedStrategy(partition_activations=True, cpu_checkpointing=True,
                                    contiguous_memory_optimization=True, synchronize_checkpoint_boundary=True,
                                    number_checkpoints=3)
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

    with mock.patch.object(deepspeed.checkpointing, "configure") as configure:
        strategy._set_deepspeed_activation_checkpointing()
    configure.assert_called_once()
    assert configure.call_args.args == (None,) and set(configure.call_args.kwargs) == {"deepspeed_config"}
    passed = configure.call_args.kwargs["deepspeed_config"]
    assert passed == strategy.config and passed is not strategy.config  # a copy: DeepSpeed 0.16 pops keys
    read = DeepSpeedActivationCheckpointingConfig(passed)  # what configure() reads from the config it is given
    assert (read.partition_activations, read.contiguous_memory_optimization, read.number_checkpoints,
            read.cpu_checkpointing, read.synchronize_checkpoint_boundary, read.profile) == (True, True, 3, True, True,
                                                                                            False)


# ---------------------------------------------------------------------------- ZeRO-3 parameters after fit
def test_zero3_fit_end_warns_when_parameters_are_partitions() -> None:
    strategy = HPUDeepSpeedStrategy(stage=3)
    model = BoringModel()
    strategy.connect(model)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    strategy.on_train_end()  # full parameters: nothing to say
    model.layer.weight.ds_status = ZeroParamStatus.AVAILABLE  # gathered (a persistent parameter, or inside a gather)
    strategy.on_train_end()
    model.layer.weight.ds_status = ZeroParamStatus.NOT_AVAILABLE  # partitioned, as ZeRO-3 leaves them after fit
    model.layer.weight.data = torch.empty(0)
    with pytest.warns(UserWarning, match=r"ZeRO-3: after fit.*`model.state_dict\(\)` returns empty tensors") as rec:
        strategy.on_train_end()
    message = str(rec[0].message)
    assert "trainer.save_checkpoint(path)" in message and "lightning-gaudi-ds convert path model.pt" in message
    assert "deepspeed.zero.GatheredParameters" in message


# ------------------------------------------------------------------------ real runs (2 and 1 CPU ranks)
def _run(tmp_path: Path, name: str, *args: str, devices: int = 2) -> tuple[list[dict[str, Any]], str]:
    out = tmp_path / name
    result = run_job([sys.executable, str(JOBS / "dropin_job.py"), "--out", str(out), "--devices", str(devices),
                      *args], timeout=420, ranks=devices).check()
    files = sorted(out.glob("rank*.json"))
    assert len(files) == devices, result.output[-3000:]
    return [json.loads(f.read_text()) for f in files], result.output


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-rank ZeRO-3 bf16 fit that saves a checkpoint, then fresh Trainers evaluate it on 2 ranks and on 1."""
    tmp = tmp_path_factory.mktemp("zero3")
    ckpt = str(tmp / "zero3.ckpt")
    fit, fit_output = _run(tmp, "fit", "--scenario", "fit", "--ckpt", ckpt)
    same, _ = _run(tmp, "eval2", "--scenario", "eval", "--ckpt", ckpt)
    other, _ = _run(tmp, "eval1", "--scenario", "eval", "--ckpt", ckpt, "--single-file", devices=1)
    return {"fit": fit, "fit_output": fit_output, "same": same, "other": other}


@pytest.mark.multiprocess
def test_zero3_checkpoint_evaluates_on_a_fresh_trainer_as_at_the_end_of_fit(zero3_runs: dict[str, Any]) -> None:
    end = zero3_runs["fit"][0]["end_of_fit"]
    assert end["predict_rows"] == 256 and end["val_loss"] > 0
    for rank in zero3_runs["same"]:  # the same 2 ranks: the same numbers
        assert rank["world_size"] == 2 and rank["from_checkpoint"] == end
    (one,) = zero3_runs["other"]  # 1 rank: the same model, batches summed in another order
    assert one["world_size"] == 1
    assert one["from_checkpoint"] == {k: pytest.approx(v, rel=1e-5) for k, v in end.items()}


@pytest.mark.multiprocess
def test_zero3_single_file_loads_with_full_weights_only(zero3_runs: dict[str, Any]) -> None:
    end = zero3_runs["fit"][0]["end_of_fit"]
    (one,) = zero3_runs["other"]
    assert one["single_file"] == {k: pytest.approx(v, rel=1e-5) for k, v in end.items()}
    refused = one["single_file_sharded_loader"]  # without load_full_weights: Lightning's type and words
    assert "FileNotFoundError" in refused["types"] and "MisconfigurationException" in refused["types"]
    assert refused["message"].startswith("The provided path is not a valid DeepSpeed checkpoint: ")
    assert "load_full_weights=True" in refused["message"]


@pytest.mark.multiprocess
def test_zero3_fit_end_says_parameters_are_partitions(zero3_runs: dict[str, Any]) -> None:
    for rank in zero3_runs["fit"]:
        after = rank["after_fit"]  # only parameters under ZeRO-3's persistence threshold keep their values
        assert after["state_dict_tensors"] == 6 and after["state_dict_numel"] < after["model_numel"] / 50
    assert zero3_runs["fit_output"].count("ZeRO-3: after fit, the module's parameters are this rank's partitions") == 1


@pytest.fixture(scope="module")
def feature_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    return _run(tmp_path_factory.mktemp("features"), "features", "--scenario", "features")


@pytest.mark.multiprocess
def test_logging_batch_size_is_bookkeeping_only(feature_runs: tuple[list[dict[str, Any]], str]) -> None:
    ranks, output = feature_runs
    for rank in ranks:
        default, logging = rank["batch_default"], rank["batch_logging_10"]
        assert default["deepspeed_batch"] == {"micro": 16, "train": 32}
        assert logging["deepspeed_batch"] == {"micro": 10, "train": 20}
        assert logging["losses"] == default["losses"] and len(logging["losses"]) == 4
        assert logging["val_loss"] == default["val_loss"]
    assert output.count("DeepSpeed's train_micro_batch_size_per_gpu is 10 (HPUDeepSpeedStrategy("
                        "logging_batch_size_per_gpu=10)), the train DataLoader's batch_size is 16") == 1


@pytest.mark.multiprocess
def test_contiguous_activation_checkpointing_trains_as_without(feature_runs: tuple[list[dict[str, Any]], str]) -> None:
    ranks, _ = feature_runs
    for rank in ranks:
        plain, contiguous = rank["act_plain"], rank["act_contiguous"]
        section = contiguous["config"]["activation_checkpointing"]
        assert section["contiguous_memory_optimization"] and section["number_checkpoints"] == 4
        assert len(contiguous["losses"]) == 4 and contiguous["losses"] == plain["losses"]
        assert contiguous["val_loss"] == plain["val_loss"]  # validation: 4 batches x 4 checkpoints, no overrun
    assert ranks[0]["act_plain"]["losses"] != ranks[1]["act_plain"]["losses"]  # each rank saw its own batches


@pytest.mark.multiprocess
def test_inherited_lightning_behaviours_hold(feature_runs: tuple[list[dict[str, Any]], str]) -> None:
    ranks, _ = feature_runs
    for rank in ranks:
        scheduler = rank["scheduler"]  # the module's scheduler config survives DeepSpeed's wrapping
        assert scheduler["name"] == "Sean" and scheduler["interval"] == "step" and scheduler["type"] == "StepLR"
        assert scheduler["inner_optimizer"] == "SGD"
        # Lightning refuses it before DeepSpeed's precision plugin would (its MisconfigurationException on 1 device)
        skipped = rank["skip_backward"]
        assert skipped["types"][0] == "RuntimeError"
        assert "Skipping the `training_step` by returning None in distributed training is not supported" in (
            skipped["message"])
    assert ranks[0]["scheduler"]["monitor"] == {"Sean": [0.1, 0.05, 0.025]}
    assert any("handles gradient clipping internally" in w for w in ranks[0]["clip_hook_warnings"])
