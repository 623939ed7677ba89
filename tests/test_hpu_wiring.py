"""HPU path, checked with a test double for habana_frameworks (tests/hpu_double.py).

These tests check WIRING ONLY: which calls the strategy makes to the Gaudi stack, with which arguments
and in which order. Nothing here trains on an HPU; real training is covered on CPU in test_training.py.
"""

from __future__ import annotations

import logging
import os

import deepspeed  # noqa: F401  (imported before the double: DeepSpeed picks its accelerator at import)
import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_gaudi_ds import HPUAccelerator, HPUDeepSpeedStrategy
from tests import hpu_double
from tests.hpu_double import FusedAdamW

HPU_ENV = ("DEEPSPEED_USE_HPU", "PT_HPU_LAZY_ACC_PAR_MODE", "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES")


class Tiny(L.LightningModule):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.fused = fused

    def configure_optimizers(self):
        return FusedAdamW(self.parameters()) if self.fused else torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def gaudi(monkeypatch):
    for key in (*HPU_ENV, "PT_HPU_LAZY_MODE"):  # set then delete: pytest records it and restores the absence
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    return hpu_double.install(monkeypatch)


def hpu_trainer(**kwargs) -> L.Trainer:
    kwargs.setdefault("strategy", HPUDeepSpeedStrategy(stage=2))
    return L.Trainer(accelerator="hpu", devices=2, precision="bf16-mixed", logger=False, **kwargs)


def test_trainer_selects_hpu_devices_and_hccl(gaudi):
    trainer = hpu_trainer()
    strategy = trainer.strategy
    assert isinstance(trainer.accelerator, HPUAccelerator)
    assert strategy.parallel_devices == [torch.device("hpu")] * 2
    assert strategy.root_device.type == "hpu"
    assert strategy._get_process_group_backend() == "hccl"


def test_auto_accelerator_on_a_gaudi_machine_says_to_pass_hpu(gaudi):
    with pytest.warns(UserWarning, match="Pass `Trainer\\(accelerator='hpu'\\)`"):
        L.Trainer(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(), logger=False)


def test_explicit_backend_wins(gaudi):
    trainer = hpu_trainer(strategy=HPUDeepSpeedStrategy(process_group_backend="gloo"))
    assert trainer.strategy._get_process_group_backend() == "gloo"


def test_setup_environment_env_defaults_hccl_and_rank_args(gaudi, monkeypatch, caplog):
    monkeypatch.setenv("PT_HPU_LAZY_ACC_PAR_MODE", "1")  # set by the user: must be kept
    trainer = hpu_trainer()
    strategy = trainer.strategy
    seen = {}
    # env defaults must be in place before DeepSpeed's HPU accelerator is created (it reads them)
    monkeypatch.setattr(strategy, "_select_deepspeed_accelerator", lambda spec: gaudi.record("ds_accelerator", os.environ.get("DEEPSPEED_USE_HPU")))
    monkeypatch.setattr(strategy, "_init_deepspeed_distributed", lambda: seen.setdefault("backend", strategy._get_process_group_backend()))
    monkeypatch.setattr(HPUAccelerator, "setup_device", lambda self, device: gaudi.record("setup_device", device))
    with caplog.at_level(logging.INFO, logger="lightning_gaudi_ds"):
        strategy.setup_environment()
    assert os.environ["DEEPSPEED_USE_HPU"] == "true"
    assert os.environ["PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES"] == "0"
    assert os.environ["PT_HPU_LAZY_ACC_PAR_MODE"] == "1"
    assert "DEEPSPEED_USE_HPU" in caplog.text and "PT_HPU_LAZY_ACC_PAR_MODE" not in caplog.text
    assert seen["backend"] == "hccl"
    init = dict(gaudi.calls)["initialize_distributed_hpu"]
    assert init == {"world_size": 2, "rank": 0, "local_rank": 0}
    assert gaudi.names() == ["ds_accelerator", "initialize_distributed_hpu", "setup_device"]
    assert dict(gaudi.calls)["ds_accelerator"] == "true"
    assert strategy._deepspeed_args().device_rank == 0


def test_model_moved_to_hpu_before_engine(gaudi, monkeypatch):
    trainer = hpu_trainer()
    strategy = trainer.strategy
    model = Tiny()
    strategy._lightning_module = model
    model.trainer = trainer
    monkeypatch.setattr(model, "to", lambda device: gaudi.record("model.to", device) or model)
    monkeypatch.setattr(DeepSpeedStrategy, "setup", lambda self, trainer: gaudi.record("engine"))
    strategy.setup(trainer)
    assert gaudi.calls == [("model.to", torch.device("hpu")), ("engine", None)]


@pytest.mark.parametrize("lazy", [True, False])
def test_mark_step_placement(gaudi, monkeypatch, lazy):
    gaudi.lazy = lazy
    trainer = hpu_trainer()
    strategy = trainer.strategy
    strategy._lightning_module = Tiny()
    strategy._lightning_module.trainer = trainer
    monkeypatch.setattr(DeepSpeedStrategy, "setup", lambda self, trainer: None)
    monkeypatch.setattr(Tiny, "to", lambda self, device: self)
    strategy.setup(trainer)
    monkeypatch.setattr(DeepSpeedStrategy, "backward", lambda self, loss, opt, *a, **k: gaudi.record("backward") or loss)
    monkeypatch.setattr(DeepSpeedStrategy, "optimizer_step", lambda self, *a, **k: gaudi.record("step"))
    for hook in ("validation_step", "test_step", "predict_step"):
        monkeypatch.setattr(DeepSpeedStrategy, hook, lambda self, *a, _h=hook, **k: gaudi.record(_h))

    strategy.backward(torch.tensor(1.0), None)
    strategy.optimizer_step(None, lambda: None)
    strategy.validation_step()
    strategy.test_step()
    strategy.predict_step()
    expected = ["backward", "mark_step", "step", "mark_step"]
    for hook in ("validation_step", "test_step", "predict_step"):
        expected += ["mark_step", hook, "mark_step"]
    if not lazy:
        expected = [name for name in expected if name != "mark_step"]
    assert gaudi.names() == expected


def test_fused_adamw_is_refused_with_a_fix(gaudi):
    trainer = hpu_trainer()
    model = Tiny(fused=True)
    model.trainer = trainer
    trainer.strategy._lightning_module = model
    with pytest.raises(ValueError, match=r"fused optimizer FusedAdamW.*torch.optim.AdamW"):
        trainer.strategy._init_optimizers()


def test_mean_reduce_is_sum_over_world_size_on_hccl(gaudi, monkeypatch):
    trainer = hpu_trainer()
    ops = []
    monkeypatch.setattr(DDPStrategy, "reduce", lambda self, t, group=None, reduce_op="mean": ops.append(reduce_op) or t * 2)
    out = trainer.strategy.reduce(torch.tensor(3.0), reduce_op="mean")
    assert ops == ["sum"] and out.item() == pytest.approx(3.0)  # (3 + 3) / 2 ranks
    trainer.strategy.reduce(torch.tensor(3.0), reduce_op="max")
    assert ops == ["sum", "max"]


def test_deepspeed_hpu_accelerator_side_effect_is_reported(gaudi, monkeypatch, caplog):
    trainer = hpu_trainer()
    was = torch.are_deterministic_algorithms_enabled()
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_gaudi_ds"):
            trainer.strategy._select_deepspeed_accelerator(trainer.strategy.device_spec)
        from deepspeed.accelerator import get_accelerator

        assert get_accelerator()._name == "hpu"
        assert "use_deterministic_algorithms(True)" in caplog.text
    finally:
        from deepspeed.accelerator import set_accelerator
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
        torch.use_deterministic_algorithms(was)
