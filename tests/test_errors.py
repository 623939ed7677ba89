"""The package's error family (lightning_gaudi_ds.errors): each class is also the type Lightning or torch raises in
the same situation, importable from its old places, and what the modules that were mixing types now raise."""

from __future__ import annotations

import pickle

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gaudi_ds import errors


@pytest.mark.parametrize(("name", "bases"), [
    ("ConfigError", (MisconfigurationException, ValueError)),
    ("ConfigNotFoundError", (MisconfigurationException, ValueError, FileNotFoundError)),
    ("CheckpointError", (MisconfigurationException, ValueError)),
    ("CheckpointNotFoundError", (MisconfigurationException, FileNotFoundError)),
    ("NotACheckpointError", (MisconfigurationException, FileNotFoundError)),
    ("IncompleteCheckpointError", (MisconfigurationException, FileNotFoundError)),
    ("UnsafeCheckpointError", (MisconfigurationException, pickle.UnpicklingError)),
    ("HostfileError", (ValueError,)),
    ("AllocationError", (ValueError,)),
    ("EnvVarError", (ValueError,)),
    ("BuildLockError", (RuntimeError,)),
])
def test_each_error_is_also_lightnings_type(name, bases):
    cls = getattr(errors, name)
    assert issubclass(cls, bases) and name in errors.__all__


def test_old_import_paths_are_the_same_classes():
    from lightning_gaudi_ds import checkpoint, config, jit_ops
    from lightning_gaudi_ds.checkpoint import io
    from lightning_gaudi_ds.config import load
    from lightning_gaudi_ds.launch import hostfile

    assert config.ConfigError is load.ConfigError is errors.ConfigError
    assert config.ConfigNotFoundError is errors.ConfigNotFoundError
    for name in ("CheckpointError", "CheckpointNotFoundError", "NotACheckpointError", "IncompleteCheckpointError",
                 "UnsafeCheckpointError"):
        assert getattr(checkpoint, name) is getattr(io, name) is getattr(errors, name)
    assert hostfile.HostfileError is errors.HostfileError and jit_ops.BuildLockError is errors.BuildLockError


def test_inference_planning_and_precision_errors_are_config_errors(tmp_path):
    from lightning_gaudi_ds.devices import device_spec, validate_precision
    from lightning_gaudi_ds.engine import inference
    from lightning_gaudi_ds.planning import auto

    with pytest.raises(errors.ConfigError, match="tp_size must be a positive integer"):
        inference.settings_from({"tensor_parallel": {"tp_size": 0}}, {})
    with pytest.raises(errors.ConfigError, match="chooses offload itself"):
        auto.from_strategy_arguments("auto", None, False, offload_optimizer=True, offload_parameters=False)
    with pytest.raises(errors.ConfigError, match=r"stage='auto'\): no fit"):
        auto.adopt(auto.Decision(error="no fit"), {})
    with pytest.raises(errors.ConfigError, match="not supported by HPUDeepSpeedStrategy on 'cpu'"):
        validate_precision("16-mixed", torch.device("cpu"))
    with pytest.raises(errors.ConfigError, match="Device type 'mps' is not supported"):
        device_spec("mps")
    with pytest.raises(errors.ConfigError, match="has no `example_input_array`"):
        auto.activation_bytes_of(torch.nn.Linear(2, 2), "32-true", torch.device("cpu"))
    for read in (inference.checkpoint_hparams, inference.load_full_state_dict):
        with pytest.raises(errors.CheckpointNotFoundError, match="no such checkpoint file or directory"):
            read(tmp_path / "missing")


# ------------------------------------------------------------------ narrowed excepts (issue 22, design point)
def _ds_module(tmp_path, monkeypatch, source: str) -> None:
    """A real ``deepspeed.git_version_info`` module file with ``source``, found first on deepspeed's path."""
    import sys

    import deepspeed

    (tmp_path / "git_version_info.py").write_text(source)
    monkeypatch.setattr(deepspeed, "__path__", [str(tmp_path), *deepspeed.__path__])
    monkeypatch.delitem(sys.modules, "deepspeed.git_version_info", raising=False)


def test_a_broken_deepspeed_install_is_not_taken_for_jit_builds(tmp_path, monkeypatch):
    from lightning_gaudi_ds.jit_ops.build import installed_ops

    _ds_module(tmp_path, monkeypatch, "import lightning_gaudi_ds_no_such_dependency\n")
    with pytest.raises(ImportError, match="lightning_gaudi_ds_no_such_dependency"):
        installed_ops()


def test_a_deepspeed_build_without_installed_ops_means_none_installed(tmp_path, monkeypatch):
    from lightning_gaudi_ds.jit_ops.build import installed_ops

    _ds_module(tmp_path, monkeypatch, "version = '0'\n")
    assert installed_ops() == {}


def test_a_model_states_file_that_needs_a_missing_module_is_not_called_truncated(tmp_path, monkeypatch):
    """With weights_only=False an unpickled class whose module is gone raises its own error (not "cut short")."""
    import sys

    from lightning_gaudi_ds.checkpoint import validate_checkpoint
    from tests.test_checkpoint import fake_checkpoint

    (tmp_path / "lgds_gone_module.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import lgds_gone_module  # type: ignore[import-not-found]

    path = fake_checkpoint(tmp_path / "c", stage=0, world_size=1)
    states = path / "checkpoint" / "mp_rank_00_model_states.pt"
    state = torch.load(states, weights_only=False)
    state["thing"] = lgds_gone_module.Thing()
    torch.save(state, states)
    (tmp_path / "lgds_gone_module.py").unlink()
    monkeypatch.delitem(sys.modules, "lgds_gone_module")
    with pytest.raises(ModuleNotFoundError, match="lgds_gone_module"):
        validate_checkpoint(path, weights_only=False)
