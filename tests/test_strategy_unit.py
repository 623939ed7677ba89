"""Tier 1-2: registry, device table, and every bad-input error of the core strategy (no processes)."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_gaudi_ds
from lightning_gaudi_ds import HPUAccelerator, HPUDeepSpeedStrategy
from lightning_gaudi_ds.devices import DEVICES, device_spec, validate_precision

NAMES = {
    "hpu_deepspeed": dict(stage=2, offload_optimizer=False, offload_param=False),
    "hpu_deepspeed_stage_1": dict(stage=1, offload_optimizer=False, offload_param=False),
    "hpu_deepspeed_stage_2": dict(stage=2, offload_optimizer=False, offload_param=False),
    "hpu_deepspeed_stage_2_offload": dict(stage=2, offload_optimizer=True, offload_param=False),
    "hpu_deepspeed_stage_3": dict(stage=3, offload_optimizer=False, offload_param=False),
    "hpu_deepspeed_stage_3_offload": dict(stage=3, offload_optimizer=True, offload_param=True),
    "hpu_deepspeed_stage_3_offload_nvme": dict(stage=3, offload_optimizer=True, offload_param=True),
}


@pytest.mark.multiprocess
def test_import_needs_no_gaudi_stack_and_exports_public_api():
    code = (
        "import sys, lightning_gaudi_ds as m; "
        "assert m.HPUDeepSpeedStrategy and m.HPUAccelerator; "
        "assert not [k for k in sys.modules if k.startswith('habana_frameworks')], 'habana imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.multiprocess
def test_the_import_hook_fires_once_and_removes_itself() -> None:
    code = (
        "import sys; hooked = lambda: [f for f in sys.meta_path if type(f).__name__ == '_RegisterAfterImport'];"
        " import lightning_gaudi_ds; assert 'lightning' not in sys.modules and len(hooked()) == 1, hooked();"
        " import lightning; from lightning.pytorch.strategies import StrategyRegistry;"
        " assert 'hpu_deepspeed_stage_2' in StrategyRegistry and not hooked(), hooked();"
        " import lightning_gaudi_ds.planning, lightning_gaudi_ds; assert not hooked()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    already = ("import lightning, lightning_gaudi_ds, sys;"
               " assert not [f for f in sys.meta_path if type(f).__name__ == '_RegisterAfterImport']")
    subprocess.run([sys.executable, "-c", already], check=True, timeout=120)  # Lightning first: never installed


@pytest.mark.multiprocess
@pytest.mark.parametrize("first", ["lightning_gaudi_ds.config", "lightning_gaudi_ds.checkpoint",
                                   "lightning_gaudi_ds._compat", "lightning_gaudi_ds.engine.train"])
def test_submodule_imported_before_lightning_registers_the_names(first: str) -> None:
    # The submodule's own import of Lightning must not import the strategy while the submodule is half-built.
    code = (
        f"import {first}; from lightning.pytorch.strategies import StrategyRegistry; "
        "from lightning.pytorch.accelerators import AcceleratorRegistry; "
        "assert 'hpu_deepspeed_stage_3' in StrategyRegistry and 'hpu' in AcceleratorRegistry"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_registered_names_resolve_as_strings(name, tmp_path, monkeypatch):
    spec: Any = name
    if name.endswith("nvme"):  # needs an existing nvme_path and libaio (tests/test_bad_input.py: without them)
        monkeypatch.setattr("lightning_gaudi_ds.config.load.libaio_available", lambda: True)
        entry = StrategyRegistry[name]
        spec = entry["strategy"](**{**entry["init_params"], "nvme_path": str(tmp_path)})
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=spec, logger=False)
    strategy = trainer.strategy
    assert type(strategy) is HPUDeepSpeedStrategy
    zero = strategy.config["zero_optimization"]
    want = NAMES[name]
    assert zero["stage"] == want["stage"]
    assert ("offload_optimizer" in zero) == want["offload_optimizer"]
    assert ("offload_param" in zero) == want["offload_param"]
    if name.endswith("nvme"):
        assert zero["offload_param"]["device"] == "nvme" and strategy.remote_device == "nvme"


def test_importing_twice_is_harmless():
    importlib.reload(lightning_gaudi_ds)
    importlib.reload(lightning_gaudi_ds)
    assert StrategyRegistry["hpu_deepspeed_stage_3"]["strategy"].__name__ == "HPUDeepSpeedStrategy"


def test_device_table():
    assert {k: v.backend for k, v in DEVICES.items()} == {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}
    assert device_spec(torch.device("cuda", 3)).backend == "nccl"
    with pytest.raises(ValueError, match=r"Device type 'mps' is not supported.*cpu, cuda, hpu"):
        device_spec("mps")


@pytest.mark.parametrize(("accelerator", "backend"), [("cpu", "gloo"), ("auto", "gloo")])
def test_backend_follows_device(accelerator, backend):
    trainer = L.Trainer(accelerator=accelerator, devices=2, strategy=HPUDeepSpeedStrategy(), logger=False)
    assert trainer.strategy._get_process_group_backend() == backend
    assert trainer.strategy._deepspeed_args().device_rank == 0  # CPU devices have no index: local rank


def test_explicit_backend_wins_on_cpu():
    strategy = HPUDeepSpeedStrategy(process_group_backend="mpi")
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert strategy._get_process_group_backend() == "mpi"


@pytest.mark.parametrize("stage", [-1, 4, "2", True, 2.5])
def test_bad_stage(stage):
    with pytest.raises(ValueError, match=r"stage=.*is not a ZeRO stage\. Allowed: 0, 1, 2, 3"):
        HPUDeepSpeedStrategy(stage=stage)


def test_parameter_offload_needs_stage_3():
    with pytest.raises(ValueError, match=r"parameter offload needs ZeRO stage 3\. Use stage=3"):
        HPUDeepSpeedStrategy(stage=2, offload_parameters=True)


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_fp16_on_cpu_is_refused_at_trainer_construction(precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}'.*not supported.*on 'cpu'.*bf16-mixed"):
        L.Trainer(accelerator="cpu", devices=2, precision=precision, strategy=HPUDeepSpeedStrategy(), logger=False)


PRECISIONS = {  # what each device supports: fp16 has no fast path on CPU
    "cpu": {"32-true", "bf16-mixed", "bf16-true"},
    "cuda": {"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"},
    "hpu": {"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"},
}


@pytest.mark.parametrize("device", sorted(PRECISIONS))
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"])
def test_precision_table(device, precision):
    if precision in PRECISIONS[device]:
        validate_precision(precision, device)  # accepted: no error
    else:
        with pytest.raises(ValueError, match=rf"precision='{precision}'.*not supported.*on '{device}'"):
            validate_precision(precision, device)


def test_hpu_accelerator_without_gaudi_says_what_is_missing():
    with pytest.raises(RuntimeError, match=r"habana_frameworks\.torch` is not installed.*Habana's PyTorch container"):
        L.Trainer(accelerator="hpu", devices=1, strategy=HPUDeepSpeedStrategy(), logger=False)
    assert HPUAccelerator.is_available() is False


def test_gradient_clip_by_value_is_refused_before_the_process_group(monkeypatch):
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(), gradient_clip_val=0.5,
        gradient_clip_algorithm="value", logger=False,
    )
    model = BoringModel()
    model.trainer = trainer
    trainer.strategy._lightning_module = model
    monkeypatch.setattr(trainer.strategy, "setup_distributed", lambda: pytest.fail("process group started"))
    with pytest.raises(ValueError, match=r"gradient_clip_algorithm='value'.*gradient_clip_val=0.5, gradient_clip_algorithm='norm'"):
        trainer.strategy.setup_environment()


def test_more_than_one_optimizer_is_refused():
    class TwoOptimizers(BoringModel):
        automatic_optimization = False  # Lightning itself refuses two optimizers with automatic optimization

        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())]

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(), logger=False)
    model = TwoOptimizers()
    model.trainer = trainer
    trainer.strategy._lightning_module = model
    with pytest.raises(MisconfigurationException, match=r"returned 2 optimizers \['SGD', 'Adam'\].*exactly one"):
        trainer.strategy._init_optimizers()  # Lightning's type; a ValueError too, as before


def test_cpu_local_size_spares_deepspeed_a_numactl_subprocess_per_call(monkeypatch):
    import subprocess as sp

    from deepspeed.accelerator import get_accelerator

    monkeypatch.setenv("LOCAL_SIZE", "x")
    monkeypatch.delenv("LOCAL_SIZE")  # recorded, so pytest restores the variable's absence afterwards
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HPUDeepSpeedStrategy(stage=3), logger=False)
    monkeypatch.setattr(trainer.strategy, "setup_distributed", lambda: None)
    trainer.strategy.setup_environment()
    assert "LOCAL_SIZE" not in os.environ  # the user's process and the processes it starts never see it
    with monkeypatch.context() as m:
        m.setattr(sp, "check_output", lambda *a, **k: pytest.fail(f"DeepSpeed forked {a}"))
        assert get_accelerator().device_count() == 2
    with trainer.strategy._runtime.deepspeed_calls():  # the shm op reads it inside deepspeed.init_distributed
        assert os.environ["LOCAL_SIZE"] == "2"
    trainer.strategy.teardown()
    assert "LOCAL_SIZE" not in os.environ and "device_count" not in vars(get_accelerator())  # DeepSpeed's own again


@pytest.mark.parametrize("cls", [HPUDeepSpeedStrategy, HPUAccelerator, lightning_gaudi_ds.DistributedRunner])
def test_init_annotations_resolve(cls: type) -> None:
    # jsonargparse (LightningCLI) and API docs evaluate the annotations; a name that is not importable raises.
    import typing

    hints = typing.get_type_hints(cls.__init__)
    assert hints["return"] is type(None)


def test_error_types_exported() -> None:
    for name in ("ConfigError", "ConfigNotFoundError", "CheckpointError", "CheckpointNotFoundError",
                 "NotACheckpointError", "IncompleteCheckpointError",
                 "HostfileError", "BuildLockError"):
        err = getattr(lightning_gaudi_ds, name)
        assert issubclass(err, Exception) and name in lightning_gaudi_ds.__all__


def test_cli_sees_lightning_arguments_through_kwargs() -> None:
    # LightningCLI learns the parameters **kwargs accepts from the super().__init__ call's source.
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(HPUDeepSpeedStrategy, "strategy")
    args = parser.parse_args(["--strategy.stage=3", "--strategy.reduce_bucket_size=1000"])
    assert (args.strategy.stage, args.strategy.reduce_bucket_size) == (3, 1000)


def test_the_exit_walk_reads_no_deprecated_torch_object() -> None:
    """engine/shutdown.py walks every object at exit: `torch.distributed.reduce_op` warns when read (a FutureWarning
    per rank on every run's last lines), so the walk tells parameters by type."""
    import warnings

    import torch.distributed

    from lightning_gaudi_ds.engine import shutdown

    assert torch.distributed.reduce_op is not None  # the deprecated object exists (and is among gc's objects)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shutdown._drop_deepspeed_group_references()


def test_the_exit_walk_drops_the_group_handles_of_deepspeeds_objects_and_parameters_only() -> None:
    """What the walk at exit releases: a handle on a process group (alone, or in a list) held by an object of a
    DeepSpeed class or by a parameter; the user's objects and every other attribute stay as they were."""
    import torch
    import torch.distributed as dist

    from lightning_gaudi_ds.engine import shutdown

    group = dist.ProcessGroup(dist.HashStore(), 0, 1)
    deepspeeds = type("Partitioner", (), {"__module__": "deepspeed.runtime.zero.fake"})()
    users = type("Partitioner", (), {"__module__": "my_project.deepspeed_tools"})()
    parameter = torch.nn.Parameter(torch.zeros(1))
    for holder in (deepspeeds, users, parameter):
        holder.ds_process_group, holder.groups, holder.size = group, [group], 1
    shutdown._drop_deepspeed_group_references()
    for holder in (deepspeeds, parameter):
        assert (holder.ds_process_group, holder.groups, holder.size) == (None, None, 1), type(holder)
    assert users.ds_process_group is group and users.groups == [group] and users.size == 1


def test_torchs_deprecated_collectives_deepspeed_calls_are_silenced_inside_engine_calls_only() -> None:
    """DeepSpeed's ZeRO-3 reduces gradients with torch's deprecated `reduce_scatter_tensor` and gathers with
    `all_gather_into_tensor`: inside the strategy's engine calls neither warns (each call used to print it again); the
    user's own calls still do."""
    import warnings

    import torch
    import torch.distributed as dist

    from lightning_gaudi_ds.engine.step import third_party_deprecations_silenced

    def call_both(show_all: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            if show_all:
                warnings.simplefilter("always")
            for collective in (dist.reduce_scatter_tensor, dist.all_gather_into_tensor):
                with contextlib.suppress(Exception):  # no process group here: torch warns before it looks for one
                    collective(torch.zeros(2), torch.zeros(2))
        return [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]

    outside = call_both(show_all=True)
    assert any("reduce_scatter_tensor` is deprecated" in m for m in outside), outside
    assert any("all_gather_into_tensor` is deprecated" in m for m in outside), outside
    with third_party_deprecations_silenced():
        assert [m for m in call_both(show_all=False) if "is deprecated" in m] == []
