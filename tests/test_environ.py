"""Training with the package leaves the user's process environment as it was (issue 29).

One process runs setup, fit, validate and teardown with the real DeepSpeed engine (on gloo), and ``os.environ`` is
compared key by key before and after. The only keys that may change are the ones Lightning itself writes, with the
values Lightning gives them: its ``DeepSpeedStrategy._set_node_environment_variables`` and its subprocess launcher
(``_call_children_scripts``, ``_set_num_threads_if_needed``); Lightning's test conftest allows them. No process is
started: unit tier.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lightning_gaudi_ds import HPUAccelerator, HPUDeepSpeedStrategy, hpu
from lightning_gaudi_ds._environ import scoped_environ
from lightning_gaudi_ds.jit_ops import SHM_MODE_ENV
from lightning_gaudi_ds.jit_ops.locks import environment_cache_dir, extensions_root, op_cache
from tests import hpu_double

LIGHTNING_WRITES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "OMP_NUM_THREADS")
# What the package chose by writing os.environ before issue 29: none of them may be left behind now.
PACKAGE_CHOICES = ("TORCH_EXTENSIONS_DIR", "LOCAL_SIZE", SHM_MODE_ENV, "PT_HPU_LAZY_MODE", *hpu.ENV_DEFAULTS)


class Tiny(BoringModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 4), batch_size=2)


def changes(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Every key whose value differs: key -> (before, after), None for absent."""
    return {k: (before.get(k), after.get(k)) for k in sorted({*before, *after}) if before.get(k) != after.get(k)}


def check_unchanged(before: Mapping[str, str], strategy: HPUDeepSpeedStrategy, allowed: Mapping[str, str]) -> None:
    """No key but Lightning's (and ``allowed``) changed, and those only to the values Lightning gives them."""
    after = dict(os.environ)
    lightning: dict[str, str | None] = {
        "MASTER_ADDR": strategy.cluster_environment.main_address,
        "MASTER_PORT": str(strategy.cluster_environment.main_port), "RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "0",
        "WORLD_SIZE": None,  # LightningEnvironment.teardown deletes it
        "OMP_NUM_THREADS": str(torch.get_num_threads()), **allowed}
    ours = {k: v for k, v in changes(before, after).items() if k not in lightning}
    assert not ours, f"os.environ changed by the package: {ours}"
    theirs = {k: after.get(k) for k in lightning if before.get(k) != after.get(k)}
    assert theirs == {k: lightning[k] for k in theirs}, f"not the values Lightning writes: {theirs}"


@pytest.fixture
def user_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """A user's shell: none of the variables the package used to choose, nor Lightning's rank variables."""
    for key in (*PACKAGE_CHOICES, *LIGHTNING_WRITES, "ID"):
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)  # recorded, so pytest restores the variable's state afterwards
    yield monkeypatch
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the next test in this process starts its own


def test_fit_validate_and_teardown_on_cpu_leave_os_environ_as_it_was(
    user_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from deepspeed.accelerator import get_accelerator

    before = dict(os.environ)
    seen = {}

    class Watching(Tiny):
        def on_train_start(self) -> None:  # the user's code during fit sees their own environment
            seen.update({k: os.environ.get(k) for k in PACKAGE_CHOICES})

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(stage=2), max_steps=2,
                        limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    model = Watching()
    trainer.fit(model)
    trainer.validate(model, verbose=False)
    assert trainer.global_step == 2 and "device_count" not in vars(get_accelerator())  # unpinned at teardown
    assert seen == dict.fromkeys(PACKAGE_CHOICES)
    check_unchanged(before, trainer.strategy, {})


def test_hpu_double_setup_engine_and_teardown_leave_os_environ_as_it_was(
    user_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The double cannot train (its tensors stay on the CPU), so DeepSpeed's engine call is captured: every other
    # step is the strategy's own, with a real gloo process group (the launcher's children: the next test).
    gaudi = hpu_double.install(user_env)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    before = dict(os.environ)  # after the import: what DeepSpeed and the bridge did to the process is theirs
    try:
        trainer = L.Trainer(accelerator="hpu", devices=1, strategy=HPUDeepSpeedStrategy(
            stage=2, process_group_backend="gloo"), logger=False, default_root_dir=tmp_path)
        strategy = trainer.strategy
        model = Tiny()
        model.trainer = trainer
        strategy.connect(model)
        user_env.setattr(HPUAccelerator, "setup_device", lambda self, device: None)
        inside: dict[str, str | None] = {}

        def initialize(**kwargs: object) -> None:
            inside.update({k: os.environ.get(k) for k in PACKAGE_CHOICES})
            raise RuntimeError("engine captured")

        import deepspeed

        user_env.setattr(deepspeed, "initialize", initialize)
        strategy.setup_environment()  # the accelerator, hccl, the JIT-op start-up, the process group
        with pytest.raises(RuntimeError, match="engine captured"):
            strategy._setup_model_and_optimizer(model, None)
        strategy.teardown()
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    assert inside["DEEPSPEED_USE_HPU"] == "true" and inside["TORCH_EXTENSIONS_DIR"] == str(extensions_root(before))
    assert [name for name in gaudi.names() if name == "initialize_distributed_hpu"] == [
        "initialize_distributed_hpu"]
    # hccl's own initialize_distributed_hpu writes the rank variables and ID, as Habana's library does.
    check_unchanged(before, strategy, {"ID": "0"})


def test_lightnings_launcher_starts_hpu_ranks_with_the_mode_and_the_gaudi_defaults(
    user_env: pytest.MonkeyPatch,
) -> None:
    hpu_double.install(user_env)
    user_env.setenv("PT_HPU_LAZY_ACC_PAR_MODE", "1")  # the user's own setting: kept
    before = dict(os.environ)
    trainer = L.Trainer(accelerator="hpu", devices=2, strategy=HPUDeepSpeedStrategy(), logger=False)
    started: list[dict[str, str]] = []

    class Popen:
        def __init__(self, command: list[str], env: dict[str, str], cwd: str | None = None) -> None:
            started.append(env)

    import lightning.pytorch.strategies.launchers.subprocess_script as script

    user_env.setattr(script.subprocess, "Popen", Popen)
    trainer.strategy.launcher._call_children_scripts()
    assert len(started) == 1 and started[0]["LOCAL_RANK"] == "1"
    assert {k: started[0].get(k) for k in PACKAGE_CHOICES if k.startswith(("PT_HPU", "DEEPSPEED"))} == {
        "PT_HPU_LAZY_MODE": "0", "DEEPSPEED_USE_HPU": "true", "PT_HPU_LAZY_ACC_PAR_MODE": "1",
        "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES": "0"}
    ours = {k: v for k, v in changes(before, dict(os.environ)).items() if k not in LIGHTNING_WRITES}
    assert not ours, f"os.environ changed by the package: {ours}"  # Lightning's launcher writes its rank variables


# ------------------------------------------------------------------------------------------------ the pieces
def test_scoped_environ_sets_only_for_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LGDS_T_MINE", "user")
    monkeypatch.delenv("LGDS_T_NEW", raising=False)
    with scoped_environ({"LGDS_T_MINE": "pkg", "LGDS_T_NEW": "pkg"}) as applied:
        assert applied == {"LGDS_T_NEW": "pkg"} and os.environ["LGDS_T_MINE"] == "user"
        os.environ["LGDS_T_NEW"] = "changed inside"
    assert os.environ["LGDS_T_MINE"] == "user" and "LGDS_T_NEW" not in os.environ
    with pytest.raises(KeyError), scoped_environ({"LGDS_T_MINE": "pkg"}, override=True):
        assert os.environ["LGDS_T_MINE"] == "pkg"
        raise KeyError
    assert os.environ["LGDS_T_MINE"] == "user"


def test_op_cache_is_chosen_without_writing_os_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    own = environment_cache_dir()
    assert extensions_root() == (own if own is not None else extensions_root({}))
    with op_cache() as root:
        # torch's load() (what DeepSpeed's OpBuilder.load calls) builds here during the block
        from torch.utils.cpp_extension import _get_build_directory

        assert root == extensions_root() and Path(_get_build_directory("x", verbose=False)) == root / "x"
    assert "TORCH_EXTENSIONS_DIR" not in os.environ
    (tmp_path / "x").mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the user's own choice wins, untouched
    with op_cache() as root:
        assert root == tmp_path and os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


def test_op_cache_runs_this_environments_ninja(monkeypatch: pytest.MonkeyPatch) -> None:
    """A venv's python run without activating it (PATH finds Debian's ninja first) must not rebuild the ops the
    set-up built: another ninja version reads the build log as "command line changed" and compiles it all again."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))  # as with `.venv/bin/python`, not activated
    with op_cache():
        assert shutil.which("ninja") == str(Path(ninja.BIN_DIR, "ninja"))  # what torch's load() runs
    assert os.environ["PATH"] == os.pathsep.join(["/usr/bin", "/bin"])
    monkeypatch.setenv("PATH", os.pathsep.join([ninja.BIN_DIR, "/usr/bin"]))  # activated: PATH left as it is
    with op_cache():
        assert os.environ["PATH"] == os.pathsep.join([ninja.BIN_DIR, "/usr/bin"])


def test_check_mode_imports_the_stack_in_the_mode_without_leaving_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # An installed, not yet imported stack that records the mode it sees at import (as the bridge picks its plugin).
    package = tmp_path / "habana_frameworks" / "torch"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("import os\nSEEN = os.environ.get('PT_HPU_LAZY_MODE')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    try:
        assert hpu.check_mode("lazy") == "lazy"
        assert sys.modules["habana_frameworks.torch"].SEEN == "1" and os.environ["PT_HPU_LAZY_MODE"] == "0"
    finally:
        for name in [m for m in sys.modules if m.startswith("habana_frameworks")]:
            del sys.modules[name]
