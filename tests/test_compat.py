"""Every private Lightning/DeepSpeed/torch name in lightning_gaudi_ds/_compat.py still exists and behaves as used.

Each test fails with "<library> <version> removed/changed <name>, used by <part of this package>", so an upgrade
that breaks a touchpoint says which one. One section per area, matching _compat.py.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
import sys
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_gaudi_ds import _compat

LIGHTNING = f"Lightning {version('lightning')}"
DEEPSPEED = f"DeepSpeed {version('deepspeed')}"
TORCH = f"torch {version('torch')}"


def _attr(module: str, name: str, library: str, used_by: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.fail(f"{library} removed {module}.{name}, used by {used_by}")


# ================================================================ strategy, config and engine (layout-core)
@pytest.mark.parametrize(
    ("module", "name", "used_by"),
    [
        ("lightning.fabric.strategies", "_StrategyRegistry", "HPUDeepSpeedStrategy.register_strategies"),
        ("lightning.fabric.plugins.precision.precision", "_PRECISION_INPUT_STR_ALIAS_CONVERSION",
         "lightning_cli.check_trainer_arguments (precision shorthands such as '16')"),
        ("lightning.fabric.utilities.types", "_PATH", "HPUDeepSpeedStrategy's path arguments (config, checkpoints)"),
        ("lightning.fabric.strategies.deepspeed", "_format_precision_config",
         "config.StrategyConfig.resolve_for (Lightning's fp16 block)"),
        ("lightning.pytorch.core.optimizer", "_MockOptimizer",
         "engine.train.optimizer_sources (configure_optimizers returned None)"),
        ("lightning.pytorch.core.optimizer", "_init_optimizers_and_lr_schedulers",
         "engine.train.init_optimizers"),
        ("lightning.pytorch.strategies.deepspeed", "remove_module_hooks",
         "engine.inference.init_zero_engine"),
        ("lightning.fabric.strategies.deepspeed", "_validate_device_index_selection",
         "config.validate.check_device_indices (CUDA devices=[1] refused)"),
    ],
)
def test_lightning_private_names(module: str, name: str, used_by: str) -> None:
    assert _attr(module, name, LIGHTNING, used_by) is not None


def test_format_precision_config_signature() -> None:
    from lightning_gaudi_ds._compat import _format_precision_config

    params = list(inspect.signature(_format_precision_config).parameters)
    expected = ["config", "precision", "loss_scale", "loss_scale_window", "min_loss_scale", "initial_scale_power",
                "hysteresis"]
    assert params == expected, (
        f"{LIGHTNING} changed _format_precision_config's parameters to {params}; config.StrategyConfig.resolve_for"
        f" passes them positionally as {expected}"
    )
    config: dict[str, Any] = {}
    _format_precision_config(config, "16-mixed", 0, 1000, 1, 16, 2)
    assert config.get("fp16", {}).get("enabled") is True, f"{LIGHTNING}: _format_precision_config adds no fp16 block"


def _lightning_deepspeed_strategy(side: str) -> type:
    if side == "trainer":
        from lightning.pytorch.strategies import DeepSpeedStrategy
    else:
        from lightning.fabric.strategies import DeepSpeedStrategy
    return DeepSpeedStrategy


def _own_strategy(side: str) -> type:
    if side == "trainer":
        from lightning_gaudi_ds.strategy import HPUDeepSpeedStrategy
    else:
        from lightning_gaudi_ds.fabric import HPUDeepSpeedStrategy
    return HPUDeepSpeedStrategy


# One list for both strategies: (Trainer or Fabric side, private hook of Lightning's DeepSpeedStrategy overridden).
_HOOKS = [("trainer", name) for name in _compat.OVERRIDDEN_DEEPSPEED_STRATEGY_HOOKS] + [
    ("fabric", name) for name in _compat.OVERRIDDEN_FABRIC_DEEPSPEED_STRATEGY_HOOKS]
_COPIES = [("trainer", name, digest) for name, digest in _compat.COPIED_DEEPSPEED_STRATEGY_METHODS.items()] + [
    ("fabric", name, digest) for name, digest in _compat.COPIED_FABRIC_DEEPSPEED_STRATEGY_METHODS.items()]


@pytest.mark.parametrize(("side", "name"), _HOOKS)
def test_overridden_deepspeed_strategy_hooks_exist(side: str, name: str) -> None:
    base = _lightning_deepspeed_strategy(side)
    assert callable(getattr(base, name, None)), (
        f"{LIGHTNING} removed {side} DeepSpeedStrategy.{name}, overridden or called by HPUDeepSpeedStrategy:"
        " the override is no longer called"
    )


def test_every_private_override_is_listed() -> None:
    """Each private method of Lightning's DeepSpeedStrategy that either strategy (or their core) overrides is in
    _compat's lists, so that a rename upstream is caught."""
    for side in ("trainer", "fabric"):
        base, own = _lightning_deepspeed_strategy(side), _own_strategy(side)
        listed = {name for s, name in _HOOKS if s == side}
        ours = {name for klass in own.__mro__[: own.__mro__.index(base)] for name in klass.__dict__}
        private = {name for name in ours if name.startswith("_") and not name.startswith("__")
                   and callable(getattr(base, name, None))}
        assert private <= listed, f"{side}: overrides of private hooks not in _compat: {sorted(private - listed)}"


@pytest.mark.parametrize("side", ["trainer", "fabric"])
def test_deepspeed_strategy_attributes_exist(side: str) -> None:
    from lightning_gaudi_ds._compat import DEEPSPEED_STRATEGY_ATTRIBUTES

    strategy = _own_strategy(side)()
    missing = [name for name in DEEPSPEED_STRATEGY_ATTRIBUTES if not hasattr(strategy, name)]
    assert not missing, f"{LIGHTNING} removed {side} DeepSpeedStrategy attribute(s) {missing}, read by the strategy"


@pytest.mark.parametrize(("side", "name", "digest"), _COPIES)
def test_copied_lightning_methods_unchanged(side: str, name: str, digest: str) -> None:
    from lightning_gaudi_ds._compat import COPIED_FROM_LIGHTNING_VERSION, _source_digest

    now = _source_digest(getattr(_lightning_deepspeed_strategy(side), name))
    assert now == digest, (
        f"{LIGHTNING} changed the {side} DeepSpeedStrategy.{name}, which HPUDeepSpeedStrategy.{name} copies from"
        f" Lightning {COPIED_FROM_LIGHTNING_VERSION}: carry the change over, then set its hash in _compat.py to {now!r}"
    )


def test_lightning_module_trainer_attribute() -> None:
    import lightning as L

    from lightning_gaudi_ds._compat import attached_trainer

    module = L.LightningModule()
    assert attached_trainer(module) is None
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module.trainer = trainer
    assert attached_trainer(module) is trainer, (
        f"{LIGHTNING} no longer keeps the Trainer in LightningModule._trainer, read by HPUDeepSpeedStrategy"
        " (config resolution, Trainer flag checks)"
    )


def test_fit_loop_combined_loader() -> None:
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader

    from lightning_gaudi_ds._compat import train_dataloaders

    class Model(BoringModel):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(RandomDataset(32, 8), batch_size=2)

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=1)
    model = Model()
    model.trainer = trainer
    trainer.strategy.connect(model)
    trainer.fit_loop._data_source.instance = model  # what Trainer.fit sets before setup
    try:
        loaders = train_dataloaders(trainer)
    except AttributeError as err:
        pytest.fail(f"{LIGHTNING} changed the fit loop ({err}); fit_loop._combined_loader / setup_data are used by"
                    " HPUDeepSpeedStrategy to read the train DataLoader's batch size for the DeepSpeed config")
    assert loaders is not None and [getattr(d, "batch_size", None) for d in loaders] == [2], (
        f"{LIGHTNING}: fit_loop._combined_loader.flattened no longer lists the train DataLoaders"
    )


def test_deepspeed_accelerator_name() -> None:
    from lightning_gaudi_ds._compat import deepspeed_accelerator_name

    try:
        name = deepspeed_accelerator_name()
    except AttributeError:
        pytest.fail(f"{DEEPSPEED} removed the accelerator's _name, read by _compat.set_deepspeed_accelerator")
    assert name in ("cpu", "cuda", "hpu", "xpu", "npu", "mps", "mlu")


@pytest.mark.parametrize("name", ["_REMOVED_TOP_LEVEL_CONFIG_KEYS", "_REMOVED_ZERO_CONFIG_KEYS"])
def test_deepspeed_removed_key_tables(name: str) -> None:
    from packaging.version import Version

    if Version(version("deepspeed")) < Version("0.19.8"):  # older releases (Habana's 0.16 fork) have no tables
        pytest.skip(f"{DEEPSPEED} predates the removed-key tables; validate_config names no removed keys there")
    table = _attr("deepspeed.runtime.config", name, DEEPSPEED, "config.load.validate_config (names removed keys)")
    assert isinstance(table, dict)


def test_zero3_top_module_reset_hook() -> None:
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    used_by = "_compat.reset_zero3_trace_at_outer_forward_only (ZeRO-3's step reset at the outer forward only)"
    setup = inspect.getsource(DeepSpeedZeRoOffload.setup_zero_stage3_hooks)
    if "_start_of_forward_hook" not in setup and "_end_of_forward_hook" in setup:
        pytest.skip(f"{DEEPSPEED} (Habana's fork) resets ZeRO-3's step in no forward pre-hook: nothing to replace")
    with_handle = "self.fwd_pre_hook = self.module.register_forward_pre_hook" in setup  # 0.19
    without = "def _start_of_forward_hook" in setup and "self.module.register_forward_pre_hook(_start_of" in setup  # 0.16
    assert (with_handle or without) and "reset_step()" in setup, (
        f"{DEEPSPEED} no longer resets ZeRO-3's coordinator in a forward pre-hook of the top module; {used_by}")
    assert "self.forward_hooks" in inspect.getsource(DeepSpeedZeRoOffload._remove_module_hooks), used_by
    for name in ("get_param_coordinator",):
        assert hasattr(DeepSpeedZeRoOffload, name), f"{DEEPSPEED} removed DeepSpeedZeRoOffload.{name}; {used_by}"
    for name in ("reset_step", "is_complete_trace", "is_invalid_trace"):
        assert hasattr(PartitionedParameterCoordinator, name), f"{DEEPSPEED} removed coordinator.{name}; {used_by}"


def test_zero3_gather_wait_is_read_from_deepspeed() -> None:
    """0.16.1 (and Habana's fork on it) waits for the last all-gather of a multi-parameter gather only; 0.19.8 waits
    for each (deepspeedai/DeepSpeed#8539). The partitioner's names the fix reaches are still there."""
    from deepspeed.runtime.zero import partition_parameters

    used_by = "_compat.complete_zero3_gathers (every all-gather of a ZeRO-3 gather complete on gloo)"
    release = version("deepspeed").split("+")[0]
    if release in ("0.16.1", "0.19.8"):
        assert _compat.zero3_gather_waits_for_last_only() is (release == "0.16.1"), f"{DEEPSPEED}: {used_by}"
    for name in ("_allgather_params_coalesced", "get_partition_dp_group", "_convert_to_deepspeed_param"):
        assert hasattr(partition_parameters.Init, name), f"{DEEPSPEED} removed zero.Init.{name}; {used_by}"
    converter = inspect.getsource(partition_parameters.Init._convert_to_deepspeed_param)
    assert re.search(r"def all_gather\(param_list=None.*\n.*\n.*\n.*\n\s*return self\._all_gather\(", converter), (
        f"{DEEPSPEED}: a ZeRO-3 parameter's all_gather no longer calls its zero.Init's _all_gather; {used_by}")
    assert "top_level_context" in vars(partition_parameters), f"{DEEPSPEED} removed top_level_context; {used_by}"


def test_torch_lr_scheduler_step_marks() -> None:
    import torch

    source = inspect.getsource(torch.optim.lr_scheduler)
    for mark in ("_wrapped_by_lr_sched", "_opt_called"):
        assert mark in source, (
            f"{TORCH} no longer marks the wrapped optimizer step with {mark}; engine.train.to_cpu_adam copies the"
            " marks (_compat.mark_step_wrapped_for_lr_scheduler) so a re-pointed scheduler does not warn"
        )


# ================================================================================================= Gaudi (gaudi)
def test_created_deepspeed_accelerator() -> None:
    import deepspeed.accelerator.real_accelerator as real_accelerator
    from deepspeed.accelerator import get_accelerator

    from lightning_gaudi_ds._compat import created_deepspeed_accelerator

    assert hasattr(real_accelerator, "ds_accelerator"), (
        f"{DEEPSPEED} removed deepspeed.accelerator.real_accelerator.ds_accelerator, used by HPUDeepSpeedStrategy"
        " (was DeepSpeed's HPU accelerator, which forces deterministic mode, created before the Trainer?)"
    )
    assert created_deepspeed_accelerator() == get_accelerator()._name


# ============================================================================ launching (lightning_gaudi_ds.launch)
def test_deepspeed_launcher_still_exports_rank_variables_and_cross_rank() -> None:
    import deepspeed.constants
    import deepspeed.launcher.launch as ds_launch

    from lightning_gaudi_ds import _compat

    source = inspect.getsource(ds_launch.main)
    node_rank = _compat.DEEPSPEED_NODE_RANK_ENV
    by_constant = getattr(deepspeed.constants, "CROSS_RANK", None) == node_rank and "current_env[CROSS_RANK]" in source
    assert by_constant or f'current_env["{node_rank}"]' in source, (  # 0.19 / 0.16
        f"{DEEPSPEED} changed deepspeed.launcher.launch: it no longer sets {node_rank} for its ranks, used by"
        " launch/environments.py's DeepSpeedLauncherEnvironment.node_rank. Find the new variable and update"
        " _compat.DEEPSPEED_NODE_RANK_ENV."
    )
    missing = [key for key in _compat.DEEPSPEED_LAUNCHER_ENV
               if key != node_rank and f'current_env["{key}"]' not in source]
    assert not missing, (f"{DEEPSPEED} changed deepspeed.launcher.launch: it no longer sets {missing}, used by"
                         " DeepSpeedLauncherEnvironment.detect() to recognise its ranks.")


@pytest.mark.parametrize("case", ["one node", "hostfile, node_rank", "one-host hostfile"])
def test_deepspeed_runner_accepts_the_flags_the_plan_passes(tmp_path: Path, case: str) -> None:
    from deepspeed.launcher.runner import parse_args

    from lightning_gaudi_ds.launch import plan

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n0 slots=1\nn1 slots=1\n" if case == "hostfile, node_rank" else "localhost slots=2\n")
    kwargs = {"one node": {"world_size": 2}, "hostfile, node_rank": {"hostfile": hostfile, "node_rank": 1},
              "one-host hostfile": {"hostfile": hostfile}}[case]
    spec = plan.resolve(use_deepspeed=True, **kwargs)
    argv = plan.launch_argv(spec, ["t.py"], 29500, plan.Machine(sys.executable, "mpirun", False, 2))
    flags = argv[4:argv.index(plan.SHIM)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parse_args(argv[4:])
        except SystemExit:
            pytest.fail(f"{DEEPSPEED} changed `python -m deepspeed.launcher.runner`: it refuses the flags"
                        f" launch/plan.py passes for {case!r} ({' '.join(flags)}): {err.getvalue().strip()}")


def test_lightning_fabric_run_command_and_its_torchrun_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run as torchrun

    used_by = "lightning_gaudi_ds.fabric_cli (`lightning-gaudi-ds fabric run`)"
    command = _compat.fabric_run_command()
    if command is None:
        pytest.fail(f"{LIGHTNING} removed lightning.fabric.cli._run (Lightning's `fabric run`), used by {used_by}")
    names = {param.name for param in command.params}
    assert {"script", "accelerator", "strategy", "devices", "script_args"} <= names, names
    for key in ("LT_CLI_USED", "LT_ACCELERATOR", "LT_STRATEGY", "LT_DEVICES", "LT_NUM_NODES", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, "")  # Lightning's body exports them: monkeypatch puts back what was there
        monkeypatch.delenv(key)
    started: list[list[str]] = []
    monkeypatch.setattr(torchrun, "main", started.append)
    options = {"accelerator": "cpu", "strategy": "ddp", "devices": "2", "num_nodes": 1, "node_rank": 0,
               "main_address": "127.0.0.1", "main_port": 29400, "precision": None}
    _compat.fabric_run_module(options, ["some.module", "train.py", "--lr", "1"])
    assert started and started[0][-5:] == ["-m", "some.module", "train.py", "--lr", "1"], (
        f"{LIGHTNING}'s `fabric run` no longer ends torchrun's command line with the script and its arguments, as"
        f" _compat.fabric_run_module relies on ({used_by}): {started}")
    assert "--nproc_per_node=2" in started[0]
    monkeypatch.undo()
    assert "LT_STRATEGY" not in os.environ


# ==================================================================== checkpoints (lightning_gaudi_ds.checkpoint)
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_checkpoint_file_names_are_deepspeeds(zero_stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = SimpleNamespace(checkpoint_mp_rank=1, zero_optimization_partition_weights=lambda: zero_stage == 3,
                             _get_zero_ckpt_prefix=lambda dp, bf16_mode: DeepSpeedEngine._get_zero_ckpt_prefix(
                                 None, dp, bf16_mode),
                             # DeepSpeed 0.16 asks the model-parallel unit and the process group for the ranks
                             mpu=SimpleNamespace(get_model_parallel_rank=lambda: 1), load_universal_checkpoint=lambda:
                             False, optimizer=SimpleNamespace(dp_process_group=None))
    if "pp_placeholder" in inspect.signature(DeepSpeedEngine._get_ckpt_name).parameters:  # 0.19
        model = Path(DeepSpeedEngine._get_ckpt_name(engine, "root", "tag", pp_placeholder="3")).name
    else:
        monkeypatch.setattr(ds_engine.dist, "get_rank", lambda group=None: 3)
        model = Path(DeepSpeedEngine._get_ckpt_name(engine, "root", "tag")).name
    assert model == _compat.model_states_name(zero_stage, 3, 1), (
        f"{DEEPSPEED} renamed its model-states files (DeepSpeedEngine._get_ckpt_name): update"
        " _compat.model_states_name")
    for bf16 in (False, True):
        optim = Path(DeepSpeedEngine._get_rank_zero_ckpt_name(engine, "root", "tag", 1, 3, bf16)).name
        assert optim == _compat.optim_states_name(3, 1, bf16), (
            f"{DEEPSPEED} renamed its ZeRO optimizer shards (DeepSpeedEngine._get_rank_zero_ckpt_name): update"
            " _compat.optim_states_name")


def test_model_states_metadata_keys_are_written_by_deepspeed() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    writer = getattr(DeepSpeedEngine, "_common_checkpoint_state", None) or DeepSpeedEngine._save_checkpoint  # 0.19/0.16
    source = inspect.getsource(writer)
    for key in ("ds_config", "dp_world_size", "mp_world_size"):
        assert f"{key}=" in source, (
            f"{DEEPSPEED} no longer writes {key!r} into model-states files (DeepSpeedEngine.{writer.__name__}):"
            " update _compat.model_states_meta")
    state = {"ds_config": {"zero_optimization": {"stage": 3}}, "dp_world_size": 4, "mp_world_size": 1}
    assert _compat.model_states_meta(state) == (3, 4, 1)


def test_ds_to_universal_takes_the_namespace_its_parser_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.checkpoint import ds_to_universal

    assert callable(getattr(ds_to_universal, "main", None)), (
        f"{DEEPSPEED} removed deepspeed.checkpoint.ds_to_universal.main, used by checkpoint.reshard")
    monkeypatch.setattr(sys, "argv", ["ds_to_universal", "--input_folder", "in", "--output_folder", "out"])
    expected = set(vars(ds_to_universal.parse_arguments()))
    passed: list[object] = []
    monkeypatch.setattr(ds_to_universal, "main", passed.append)
    _compat.ds_to_universal(Path("in"), Path("out"))
    assert set(vars(passed[0])) == expected, (
        f"{DEEPSPEED}: ds_to_universal's arguments changed (parse_arguments): update the Namespace in"
        " _compat.ds_to_universal")


def test_universal_loading_is_the_engine_config_flag() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "load_universal_checkpoint" in inspect.getsource(DeepSpeedConfig), (
        f"{DEEPSPEED}: DeepSpeedConfig has no load_universal_checkpoint any more: update"
        " _compat.universal_checkpoint_loading")
    engine = SimpleNamespace(_config=SimpleNamespace(load_universal_checkpoint=False))
    with _compat.universal_checkpoint_loading(engine):
        assert DeepSpeedEngine.load_universal_checkpoint(engine) is True, (
            f"{DEEPSPEED}: DeepSpeedEngine.load_universal_checkpoint() no longer reads"
            " engine._config.load_universal_checkpoint: update _compat.universal_checkpoint_loading")
    assert DeepSpeedEngine.load_universal_checkpoint(engine) is False


def test_checkpoint_safe_globals_are_deepspeeds_classes() -> None:
    names = {f"{c.__module__}.{c.__qualname__}" for c in _compat.checkpoint_safe_globals()}
    assert names == {"deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address"}, (
        f"{DEEPSPEED} moved a class its checkpoints pickle: update _compat.checkpoint_safe_globals (the names are"
        " what torch.serialization.get_unsafe_globals_in_checkpoint lists for a shard)")


def test_lightning_still_drops_weights_only_when_restoring_after_setup() -> None:
    import lightning.pytorch as pl

    run = inspect.signature(pl.Trainer._run)
    assert "weights_only" in run.parameters, (
        f"{LIGHTNING}: Trainer._run takes no weights_only: update _compat.weights_only_dropped_by_lightning")
    source = inspect.getsource(pl.Trainer._run)
    assert "_restore_modules_and_callbacks(ckpt_path)" in source, (
        f"{LIGHTNING} forwards weights_only when restoring after setup: _compat.weights_only_dropped_by_lightning"
        " (and its call in HPUDeepSpeedStrategy.load_checkpoint) can go")

    class Probe:  # stands in for the Trainer: its _run's code object is what the lookup finds
        def _run(self, model: Any, ckpt_path: Any = None, weights_only: bool | None = None) -> Any:
            return _compat.weights_only_dropped_by_lightning()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl.Trainer, "_run", Probe._run)
        assert [Probe()._run(None, weights_only=v) for v in (False, True, None)] == [False, True, None]
    assert _compat.weights_only_dropped_by_lightning() is None  # outside a Trainer run


# ================================================================== JIT-built ops (lightning_gaudi_ds.jit_ops)
def test_extensions_root_follows_torchs_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.cpp_extension as cpp

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp, "get_default_build_root", lambda: str(tmp_path))
    assert Path(cpp._get_build_directory("some_op", verbose=False)) == _compat.extensions_root() / "some_op", (
        f"{TORCH} changed where it builds extensions (cpp_extension._get_build_directory): update"
        " _compat.extensions_root")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "own"))
    assert Path(cpp._get_build_directory("some_op", verbose=False)) == _compat.extensions_root() / "some_op"


def test_build_lock_file_name_is_torchs() -> None:
    import torch.utils.cpp_extension as cpp

    source = inspect.getsource(cpp._jit_compile)
    assert re.search(rf"FileBaton\(os\.path\.join\(build_directory, ['\"]{_compat.BUILD_LOCK_NAME}['\"]\)\)", source), (
        f"{TORCH}: the JIT build no longer locks <build dir>/lock with FileBaton (cpp_extension._jit_compile): update"
        " _compat.BUILD_LOCK_NAME and jit_ops/locks.py")


def test_forget_jit_extension_clears_torchs_versioner() -> None:
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    assert isinstance(getattr(JIT_EXTENSION_VERSIONER, "entries", None), dict), (
        f"{TORCH} removed JIT_EXTENSION_VERSIONER.entries: update _compat.forget_jit_extension")
    JIT_EXTENSION_VERSIONER.bump_version_if_changed(
        "lgds_compat_probe", [], build_arguments=[[]], build_directory="/nonexistent", with_cuda=False,
        with_sycl=False, is_python_module=True, is_standalone=False)
    assert JIT_EXTENSION_VERSIONER.get_version("lgds_compat_probe") is not None
    _compat.forget_jit_extension("lgds_compat_probe")
    assert JIT_EXTENSION_VERSIONER.get_version("lgds_compat_probe") is None


def test_disabling_an_op_stops_deepspeed_building_the_shm_op(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    from lightning_gaudi_ds.jit_ops.build import SHM_COMM

    table = deepspeed.ops.__compatible_ops__
    assert isinstance(table, dict), (
        f"{DEEPSPEED} removed deepspeed.ops.__compatible_ops__: update _compat.disable_deepspeed_op")
    if _compat.deepspeed_accelerator_name() != "cpu":
        pytest.skip("the shm op exists on DeepSpeed's CPU accelerator only")
    monkeypatch.setitem(table, SHM_COMM, True)
    assert _compat.deepspeed_op_enabled(SHM_COMM)
    _compat.disable_deepspeed_op(SHM_COMM)
    assert not _compat.deepspeed_op_enabled(SHM_COMM)
    assert build_shm_op() is None, (
        f"{DEEPSPEED}: deepspeed.comm.torch.build_shm_op no longer reads deepspeed.ops.__compatible_ops__: the shm"
        " op would be built although disabled; update _compat.disable_deepspeed_op")


def test_unimplemented_builders_are_recognised() -> None:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    builder = CPU_Accelerator().create_op_builder("NoSuchBuilder")
    assert builder is not None and _compat.is_unimplemented_builder(builder), (
        f"{DEEPSPEED}: the accelerators return {type(builder).__name__} for an op they lack, no NotImplementedBuilder:"
        " update _compat.is_unimplemented_builder")
    assert not _compat.is_unimplemented_builder(CPU_Accelerator().create_op_builder("CPUAdamBuilder"))


def test_shm_segment_name_is_deepspeeds() -> None:
    import deepspeed

    source = Path(deepspeed.__file__).parent / "ops" / "csrc" / "cpu" / "comm" / "shm.cpp"
    assert source.is_file(), f"{DEEPSPEED}: {source} is gone: check how DeepSpeed names its shm segments now"
    text = source.read_text()
    assert f'#define SHM_BUFFER_NAME "{_compat.SHM_SEGMENT_PREFIX}"' in text and '"%s_%d_%s_%s"' in text, (
        f"{DEEPSPEED}: the shm op names its segments differently (shm.cpp shm_initialize): update"
        " _compat.SHM_SEGMENT_PREFIX and jit_ops.startup.shm_segment_name")


# ================================================================ tensor-parallel inference (tp-inference)
def test_autotp_parser_refuses_a_model_it_cannot_split() -> None:
    import torch

    from lightning_gaudi_ds._compat import autotp_parse

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    class NoModelName(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block()])

    _attr("deepspeed.module_inject.auto_tp", "AutoTP", DEEPSPEED, "engine.inference.check_splittable")
    with pytest.raises(AssertionError, match="policy"):
        autotp_parse(NoModelName())


def test_tensor_parallel_layers_and_row_parallel_lm_head() -> None:
    import torch

    from lightning_gaudi_ds._compat import lm_head_allreduce, tensor_parallel_config_keys, tensor_parallel_layer_class

    base = tensor_parallel_layer_class()
    for name in ("LinearLayer", "LinearAllreduce", "LmHeadLinearAllreduce"):
        cls = _attr("deepspeed.module_inject.layers", name, DEEPSPEED, "engine.inference.is_split / lm_head split")
        assert issubclass(cls, base), f"{DEEPSPEED}: {name} is no longer one of the tensor-parallel layer classes"
    if isinstance(base, tuple):  # 0.16: the weight is cut by tp_shard's rule before the layer is built
        _attr("deepspeed.module_inject.tp_shard", "get_shard_size_list", DEEPSPEED, "engine.inference (lm_head)")
    else:
        _attr("deepspeed.module_inject.tp_shard", "AutoTPMeta", DEEPSPEED, "engine.inference (lm_head shard sizes)")
    head = lm_head_allreduce(torch.nn.Linear(8, 16, bias=False), None, None, 4)  # no group: one rank keeps it all
    assert isinstance(head, base) and tuple(head.weight.shape) == (16, 8)
    assert {"tp_size", "enabled", "tp_group", "mpu"} <= set(tensor_parallel_config_keys())


# ================================================================ memory planner (planner)
def test_torch_dispatch_mode() -> None:
    mode = _attr("torch.utils._python_dispatch", "TorchDispatchMode", TORCH,
                 "planning.activations.HostPeak (activation and peak memory measured on CPU)")
    assert hasattr(mode, "__torch_dispatch__") and hasattr(mode, "__enter__")


# ====================================================================== DeepSpeed 0.16 (Habana's fork) surface
def test_bf16_optimizer_gets_a_zero_grad_where_it_has_none() -> None:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from lightning_gaudi_ds._compat import give_bf16_optimizer_zero_grad

    used_by = "_compat.give_bf16_optimizer_zero_grad (Lightning's optimizer_zero_grad under ZeRO-0 bf16)"
    if not hasattr(BF16_Optimizer, "zero_grad"):  # DeepSpeed 0.16: what the given zero_grad calls must exist
        for name in ("clear_lp_grads", "clear_hp_grads"):
            assert hasattr(BF16_Optimizer, name), f"{DEEPSPEED} removed BF16_Optimizer.{name}; {used_by}"
    calls: list[str] = []
    bare = SimpleNamespace(clear_lp_grads=lambda: calls.append("lp"), clear_hp_grads=lambda: calls.append("hp"))
    give_bf16_optimizer_zero_grad(bare)
    bare.zero_grad()
    assert calls == ["lp", "hp"]
    own = SimpleNamespace(zero_grad=lambda set_to_none=True: calls.append("own"), clear_hp_grads=lambda: None)
    give_bf16_optimizer_zero_grad(own)
    own.zero_grad()
    assert calls[-1] == "own"  # an optimizer with its own zero_grad keeps it


def test_precision_config_models_check_the_keys_this_deepspeed_reads() -> None:
    from pydantic import ValidationError

    from lightning_gaudi_ds._compat import precision_config_models

    models = precision_config_models()
    assert models["bf16"] is models["bfloat16"]
    assert {"enabled"} <= set(models["bf16"].model_fields)
    assert {"enabled", "loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"} <= set(
        models["fp16"].model_fields)
    models["fp16"](enabled=True, loss_scale=0, loss_scale_window=100)
    with pytest.raises(ValidationError):
        models["bf16"](enabeld=True)


def test_the_engine_gets_a_copy_of_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed 0.16 pops torch_adam/adam_w_mode out of the optimizer params of the dict it is given: a second
    engine from the same strategy (a second fit, an evaluation engine) must still see them."""
    import deepspeed
    import torch

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    strategy = HPUDeepSpeedStrategy(config={
        "optimizer": {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1})
    given = []

    def initialize(**kwargs):
        given.append(kwargs["config"])
        kwargs["config"]["optimizer"]["params"].pop("torch_adam")  # what DeepSpeed 0.16's engine does
        return SimpleNamespace(optimizer=None), SimpleNamespace(), None, None

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setattr(strategy, "_deepspeed_args", lambda: None)
    for _ in range(2):
        strategy._setup_model_and_optimizer(torch.nn.Linear(2, 2), None)
    assert given[0] is not strategy.config and strategy.config["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in given[0]["optimizer"]["params"] and len(given) == 2


def test_zero3_training_mode_assertion_is_read_from_deepspeed() -> None:
    from deepspeed.runtime.zero import parameter_offload

    from lightning_gaudi_ds._compat import zero3_backward_requires_training_mode

    source = inspect.getsource(parameter_offload)
    assert "sub_module.training" in source, (
        f"{DEEPSPEED} no longer mentions sub_module.training in ZeRO-3's backward hooks;"
        " _compat.zero3_backward_requires_training_mode (the fork's eval-mode assertion) reads it")
    fork = "DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API" in inspect.getsource(
        __import__("deepspeed.accelerator.hpu_accelerator", fromlist=["x"]))
    assert zero3_backward_requires_training_mode() is fork  # the fork asserts; upstream has it commented out


def test_deepspeed_op_builder_has_no_build_directory_argument() -> None:
    from deepspeed.ops.op_builder.builder import OpBuilder

    source = inspect.getsource(OpBuilder.jit_load)
    assert "load(" in source and "build_directory" not in source, (
        f"{DEEPSPEED}: OpBuilder.jit_load now passes a build_directory to torch's load(): pass the op cache there"
        " instead of setting TORCH_EXTENSIONS_DIR around the load (jit_ops.locks.op_cache)")


# ====================================================================== the ranks Lightning's launcher starts
def test_subprocess_launcher_starts_its_children_in_call_children_scripts() -> None:
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    source = inspect.getsource(_SubprocessScriptLauncher._call_children_scripts)
    assert "os.environ.copy()" in source and "Popen(" in source, (
        f"{LIGHTNING}: _SubprocessScriptLauncher._call_children_scripts no longer starts the children with a copy of"
        " os.environ: update _compat.start_children_with (the Gaudi ranks' PT_HPU_LAZY_MODE and defaults)")


# ======================================================== sequence parallelism (lightning_gaudi_ds.sequence)
def test_ulysses_distributed_attention_as_called() -> None:
    """``DistributedAttention(local_attention, group)`` and its forward ``(query, key, value, batch_dim_idx,
    rotary_pos_emb, *args)``, which passes ``args`` to the local attention (sequence.attention.Exchange)."""
    used_by = "sequence.attention.Exchange (Ulysses' all-to-all)"
    assert _compat.ulysses_missing() is None, f"{DEEPSPEED}: {_compat.ulysses_missing()}, used by {used_by}"
    cls = _attr("deepspeed.sequence.layer", "DistributedAttention", DEEPSPEED, used_by)
    init = list(inspect.signature(cls.__init__).parameters)
    assert init[1:3] == ["local_attention", "sequence_process_group"], f"{DEEPSPEED} changed {init}; {used_by}"
    forward = inspect.signature(cls.forward).parameters
    assert list(forward)[1:6] == ["query", "key", "value", "batch_dim_idx", "rotary_pos_emb"], (
        f"{DEEPSPEED} changed DistributedAttention.forward{list(forward)}; {used_by}")
    assert any(p.kind is p.VAR_POSITIONAL for p in forward.values()), f"{DEEPSPEED}: no *args; {used_by}"
    assert "self.local_attn(query_layer, key_layer, value_layer, *args, **kwargs)" in inspect.getsource(cls.forward)


def test_ulysses_missing_reads_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    fake = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: fake)
    assert "no " in (_compat.ulysses_missing() or "")
    (tmp_path / "sequence").mkdir()
    (tmp_path / "sequence" / "layer.py").write_text("class Other: pass\n")
    assert "has no DistributedAttention" in (_compat.ulysses_missing() or "")


def test_autotp_kv_heads_global_of_deepspeed_016() -> None:
    import deepspeed.sequence.layer as layer

    if not hasattr(layer, "get_num_kv_heads"):  # 0.17+: the all-to-all takes the count from the key tensor
        assert "num_kv_heads" in inspect.signature(layer.single_all_to_all).parameters, DEEPSPEED
        assert _compat.reset_autotp_kv_heads() is False
        return
    from deepspeed.module_inject import tp_shard

    tp_shard.set_num_kv_heads(4)
    assert layer.get_num_kv_heads() == 4
    assert _compat.reset_autotp_kv_heads() is True and layer.get_num_kv_heads() is None
    assert _compat.reset_autotp_kv_heads() is False


def test_deepspeed_keeps_the_mpu_in_groups() -> None:
    groups = importlib.import_module("deepspeed.utils.groups")
    assert hasattr(groups, "mpu"), f"{DEEPSPEED} removed deepspeed.utils.groups.mpu, cleared by _compat.forget_mpu"
    engine = inspect.getsource(importlib.import_module("deepspeed.runtime.engine").DeepSpeedEngine)
    assert "groups.mpu = self.mpu" in engine, f"{DEEPSPEED}: the engine no longer sets groups.mpu (forget_mpu)"
    mine, other = object(), object()
    groups.mpu = mine
    try:
        _compat.forget_mpu(other)
        assert groups.mpu is mine
        _compat.forget_mpu(mine)
        assert groups.mpu is None
    finally:
        groups.mpu = None


def test_zero3_reads_sequence_parallel_size_at_each_reduction() -> None:
    """ZeRO-3 divides by ``world / self.sequence_parallel_size`` where it corrects for sequence parallelism (and its
    reduce-scatter path averages over the world): _compat.zero3_average_over_every_rank sets the attribute to 1."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(DeepSpeedZeroOptimizer_Stage3)
    assert "self.sequence_parallel_size = groups._get_sequence_parallel_world_size()" in source, DEEPSPEED
    uses = re.findall(r"/ float\(self\.sequence_parallel_size\)", source)
    assert uses, f"{DEEPSPEED}: ZeRO-3 no longer corrects by self.sequence_parallel_size; see sequence.runtime"
    optimizer = SimpleNamespace(sequence_parallel_size=4)
    _compat.zero3_average_over_every_rank(optimizer)
    assert optimizer.sequence_parallel_size == 1


def test_transformers_attention_registry_and_config_field() -> None:
    pytest.importorskip("transformers")
    from transformers import AttentionInterface, LlamaConfig
    from transformers.modeling_utils import PreTrainedModel

    library = f"transformers {version('transformers')}"
    assert callable(_compat.attention_function("sdpa")), library
    _compat.register_attention_function("lightning_gaudi_ds_test", _compat.attention_function("sdpa"))
    assert "lightning_gaudi_ds_test" in AttentionInterface._global_mapping
    AttentionInterface._global_mapping.pop("lightning_gaudi_ds_test")
    config = LlamaConfig(num_hidden_layers=1)
    assert "_attn_implementation_internal" in vars(config), f"{library} renamed the config's attention field"
    _compat.with_attention_implementation(config, "eager")
    assert config._attn_implementation == "eager"
    setter = PreTrainedModel.loss_function.fset  # sequence.hf sets a model's loss function
    assert setter is not None, f"{library}: PreTrainedModel.loss_function can no longer be set"


# ================================================================ Hugging Face transformers (lightning_gaudi_ds.hf)
def test_transformers_deepspeed_config_global() -> None:
    pytest.importorskip("transformers")
    library = f"transformers {version('transformers')}"
    _attr("transformers.integrations.deepspeed", "_hf_deepspeed_config_weak_ref", library,
          "hf.zero3_loading (puts back the HfDeepSpeedConfig transformers referred to before)")
    for name in ("HfDeepSpeedConfig", "set_hf_deepspeed_config", "unset_hf_deepspeed_config"):
        _attr("transformers.integrations.deepspeed", name, library, "hf.zero3_loading")
    assert _compat.hf_deepspeed_config_ref() is None


def test_zero_init_pause() -> None:
    import torch

    for name in ("top_level_context", "shutdown_init_context", "restore_init_context"):
        _attr("deepspeed.runtime.zero.partition_parameters", name, DEEPSPEED,
              "hf.zero3_init_paused (whole modules inside configure_model under ZeRO-3, e.g. PEFT's adapters)")
    # outside any zero.Init: nothing to pause (inside one: tests/test_hf.py, PEFT under ZeRO-3, needs a process group)
    with _compat.zero_init_paused():
        assert torch.nn.Linear(2, 2).weight.numel() == 4


def test_zero3_param_coordinator_per_deepspeed() -> None:
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    from lightning_gaudi_ds._compat import zero3_param_coordinator

    params = inspect.signature(DeepSpeedZeRoOffload.get_param_coordinator).parameters
    assert set(params) <= {"self", "training"}, f"{DEEPSPEED} changed DeepSpeedZeRoOffload.get_param_coordinator"
    upstream = SimpleNamespace(get_param_coordinator=lambda: "the coordinator")
    fork = SimpleNamespace(get_param_coordinator=lambda training: f"training={training}")
    assert zero3_param_coordinator(upstream) == "the coordinator"
    assert zero3_param_coordinator(fork) == "training=True" and zero3_param_coordinator(fork, False) == "training=False"


def test_lightning_converter_drops_the_keys_the_reader_drops() -> None:
    """checkpoint.read_full_checkpoint keeps the Lightning state as Lightning's converter does: the list of DeepSpeed
    keys it drops is a local in Lightning's function, read here from its source."""
    import ast
    import inspect

    from lightning.pytorch.utilities import deepspeed as lightning_deepspeed

    from lightning_gaudi_ds._compat import LIGHTNING_CONVERTER_DROPPED_KEYS

    tree = ast.parse(inspect.getsource(lightning_deepspeed.convert_zero_checkpoint_to_fp32_state_dict))
    lists = [ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "deepspeed_states" for t in node.targets)]
    assert lists, f"{LIGHTNING}'s converter no longer has a `deepspeed_states` list: check which keys it drops now"
    assert tuple(lists[0]) == LIGHTNING_CONVERTER_DROPPED_KEYS, (
        f"{LIGHTNING}'s converter drops {lists[0]}: set _compat.LIGHTNING_CONVERTER_DROPPED_KEYS to it"
    )


def test_autotp_names_a_policy_layer_by_its_parent_and_its_own_name() -> None:
    """_compat.autotp_policy_names gives the names AutoTP tests an injection policy against: ``prev_name + '.' +
    name`` in AutoTP._replace_module (a direct child of the policy's class: "." + its name)."""
    import inspect

    import torch
    from deepspeed.module_inject.auto_tp import AutoTP

    from lightning_gaudi_ds._compat import autotp_policy_names

    source = inspect.getsource(AutoTP._replace_module)
    assert "self.linear_policies[child.__class__](child, prev_name + '.' + name" in source, (
        f"{DEEPSPEED} names the linear layers it matches against an injection policy differently: update"
        " _compat.autotp_policy_names")
    assert "self._replace_module(child, name, class_name)" in source
    block = torch.nn.Module()
    block.fc2 = torch.nn.Linear(2, 2)
    block.attn = torch.nn.Module()
    block.attn.proj = torch.nn.Linear(2, 2)
    block.attn.inner = torch.nn.Module()
    block.attn.inner.out = torch.nn.Linear(2, 2)
    assert autotp_policy_names(block, ("fc2", "attn.proj", "out")) == ("fc2", "attn.proj", "out", ".fc2", "inner.out")


def test_trainer_hooks_used_by_resume() -> None:
    """checkpoint.resume hooks the Trainer when ``_run`` connects the strategy, which must come before it restores
    (``resume_start``) from the path ``_select_ckpt_path`` made; its SIGTERM watch sets the signal connector's flag
    just before the epoch loop broadcasts it, and calls the handler Lightning found before the fit."""
    import inspect

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    used_by = "checkpoint.resume (ckpt_path='last', restarts)"
    run = inspect.getsource(Trainer._run)
    assert run.index("self.strategy.connect(model)") < run.index("_restore_modules_and_callbacks(ckpt_path"), used_by
    assert "self.resume_start(checkpoint_path" in inspect.getsource(
        _CheckpointConnector._restore_modules_and_callbacks), used_by
    assert list(inspect.signature(_CheckpointConnector.resume_start).parameters) == [
        "self", "checkpoint_path", "weights_only"], used_by
    parse = inspect.signature(_CheckpointConnector._parse_ckpt_path)
    assert list(parse.parameters) == ["self", "state_fn", "ckpt_path", "model_provided", "model_connected"], used_by
    assert callable(getattr(ModelCheckpoint, "_find_last_checkpoints", None)), used_by
    find_last = inspect.getsource(ModelCheckpoint._find_last_checkpoints)  # _compat.interrupted_last_checkpoints
    assert 'rf"^{self.CHECKPOINT_NAME_LAST}(-(\\d+))?"' in find_last and "self.FILE_EXTENSION" in find_last, used_by
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    connector = _SignalConnector(object())  # type: ignore[arg-type]
    assert connector.received_sigterm is False and connector._original_handlers == {}, "resume.PreemptionWatch"
    assert "received_sigterm" in inspect.getsource(Trainer.received_sigterm.fget), "resume.PreemptionWatch"
    advance = inspect.getsource(_TrainingEpochLoop.advance)
    assert "self._broadcast_sigterm_tensor()" in advance, "resume.PreemptionWatch"
    broadcast = inspect.getsource(_TrainingEpochLoop._broadcast_sigterm_tensor)
    assert 'getattr(self.trainer, "received_sigterm"' in broadcast and "src=0" in broadcast, "resume.PreemptionWatch"
    assert "raise SIGTERMException" in broadcast, "resume.PreemptionWatch"


# ================================================================================================ ZeRO++ (hpZ, qwZ, qgZ)
def test_deepspeeds_hpz_group_is_one_per_process_and_read_when_an_engine_is_built() -> None:
    """What _compat.zero_param_intra_group manages: DeepSpeed's process-wide hpZ group, created once (zero.Init and the
    ZeRO-3 optimizer assert it is unset, or reuse it) and read only while an engine is built."""
    from deepspeed.runtime.zero import partition_parameters, stage3
    from deepspeed.utils import groups

    assert hasattr(groups, "_ZERO_PARAM_INTRA_PARALLEL_GROUP"), (
        f"{DEEPSPEED} removed deepspeed.utils.groups._ZERO_PARAM_INTRA_PARALLEL_GROUP, used by"
        " _compat.zero_param_intra_group (hpZ's group per engine)")
    create = inspect.getsource(groups._create_zero_param_parallel_group)
    assert "_ZERO_PARAM_INTRA_PARALLEL_GROUP is None" in create, (
        f"{DEEPSPEED}: _create_zero_param_parallel_group no longer asserts the group is unset: review"
        " _compat.zero_param_intra_group")
    for module in (partition_parameters, stage3):
        assert "groups._get_zero_param_intra_parallel_group()" in inspect.getsource(module), (
            f"{DEEPSPEED}: {module.__name__} no longer reads the hpZ group from deepspeed.utils.groups: review"
            " _compat.zero_param_intra_group")


def test_zero_param_intra_group_gives_each_engine_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain ZeRO-3 engine sees no group; an hpZ one reuses a group of its size, or gets a new one where the group
    has another size; afterwards the hpZ group stays for the next hpZ engine."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    sizes = {"g2": 2, "g4": 4, "g4b": 4}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: sizes[group])
    monkeypatch.setattr(groups, "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "g2")
    with _compat.zero_param_intra_group(1):
        assert groups._ZERO_PARAM_INTRA_PARALLEL_GROUP is None
    assert groups._ZERO_PARAM_INTRA_PARALLEL_GROUP == "g2"
    with _compat.zero_param_intra_group(2):
        assert groups._ZERO_PARAM_INTRA_PARALLEL_GROUP == "g2"
    with _compat.zero_param_intra_group(4):
        assert groups._ZERO_PARAM_INTRA_PARALLEL_GROUP is None  # DeepSpeed makes one of size 4
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = "g4"
    assert groups._ZERO_PARAM_INTRA_PARALLEL_GROUP == "g4"
    with _compat.zero_param_intra_group(4, zero_init=True):  # zero.Init asserts there is none, and makes one
        assert groups._ZERO_PARAM_INTRA_PARALLEL_GROUP is None
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = "g4b"
    assert groups._ZERO_PARAM_INTRA_PARALLEL_GROUP == "g4b"


def test_quantized_collectives_need_the_quantizer_op_of_the_devices_accelerator() -> None:
    """qwZ and qgZ load QuantizerBuilder through the device's accelerator: the CPU accelerator returns its
    NotImplementedBuilder for it, as _compat.runs_quantized_collectives says."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import partition_parameters

    assert "QuantizerBuilder" in inspect.getsource(coalesced_collectives)
    assert "CUDAQuantizer()" in inspect.getsource(partition_parameters)
    builder = CPU_Accelerator().create_op_builder("QuantizerBuilder")
    assert _compat.is_unimplemented_builder(builder) == (not _compat.runs_quantized_collectives("cpu")), (
        f"{DEEPSPEED}: the CPU accelerator's QuantizerBuilder disagrees with _compat.runs_quantized_collectives")
    assert not _compat.runs_quantized_collectives("hpu") and _compat.runs_quantized_collectives("cuda")


def test_zero3_optimizer_can_drop_hpz_secondary_partitions() -> None:
    """_compat.drop_hpz_secondary_partitions calls the ZeRO-3 optimizer's invalidate_secondary_tensor after a load;
    DeepSpeed 0.19 calls it itself there (checkpoint_event_epilogue), 0.16.1 does not."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    assert callable(getattr(DeepSpeedZeroOptimizer_Stage3, "invalidate_secondary_tensor", None)), (
        f"{DEEPSPEED} removed DeepSpeedZeroOptimizer_Stage3.invalidate_secondary_tensor, used by"
        " _compat.drop_hpz_secondary_partitions (hpZ resume)")
    calls = []
    _compat.drop_hpz_secondary_partitions(SimpleNamespace(optimizer=SimpleNamespace(
        invalidate_secondary_tensor=lambda: calls.append(1))))
    _compat.drop_hpz_secondary_partitions(SimpleNamespace(optimizer=None))  # an engine without one: nothing
    assert calls == [1]
