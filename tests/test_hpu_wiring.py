"""HPU path, checked with a test double for habana_frameworks (tests/hpu_double.py).

These tests check WIRING ONLY: which calls the strategy makes to the Gaudi stack, with which arguments
and in which order. Nothing here trains on an HPU; real training is covered on CPU in test_training.py.
"""

from __future__ import annotations

import logging
import os
import warnings

import deepspeed  # noqa: F401  (the double lets DeepSpeed's accelerator detection run again, as on a Gaudi)
import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_gaudi_ds import HPUAccelerator, HPUDeepSpeedStrategy, _compat, hpu
from lightning_gaudi_ds.devices import (
    deterministic_change,
    deterministic_state,
    move_keeping_tied_parameters,
    validate_precision,
)
from lightning_gaudi_ds.launch import plan as launch_plan
from tests import hpu_double
from tests.hpu_double import FusedAdamW


class Tiny(L.LightningModule):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.fused = fused

    def configure_optimizers(self):
        return FusedAdamW(self.parameters()) if self.fused else torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def clean_env(monkeypatch):
    """No mode chosen and no launcher variables: what a user's shell in Habana's container looks like."""
    hpu_double.protect_env(monkeypatch)
    for key in (*hpu_double.TOUCHED_ENV, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield monkeypatch
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@pytest.fixture
def gaudi(clean_env):
    return hpu_double.install(clean_env)


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


def test_setup_environment_hccl_rank_args_and_gaudi_defaults_only_around_deepspeed(gaudi, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_ACC_PAR_MODE", "1")  # set by the user: must be kept
    trainer = hpu_trainer()
    strategy = trainer.strategy
    seen = {}
    monkeypatch.setattr(_compat, "set_deepspeed_accelerator", lambda name: gaudi.record("ds_accelerator"))
    monkeypatch.setattr(strategy, "_init_deepspeed_distributed", lambda: seen.update(
        backend=strategy._get_process_group_backend(), use_hpu=os.environ.get("DEEPSPEED_USE_HPU")))
    monkeypatch.setattr(HPUAccelerator, "setup_device", lambda self, device: gaudi.record("setup_device", device))
    strategy.setup_environment()
    # Habana's integrations set DEEPSPEED_USE_HPU for DeepSpeed's calls: set around them, never left behind
    assert seen == {"backend": "hccl", "use_hpu": "true"} and "DEEPSPEED_USE_HPU" not in os.environ
    assert os.environ["PT_HPU_LAZY_ACC_PAR_MODE"] == "1"
    init = dict(gaudi.calls)["initialize_distributed_hpu"]
    assert init == {"world_size": 2, "rank": 0, "local_rank": 0}
    assert gaudi.names() == ["ds_accelerator", "initialize_distributed_hpu", "setup_device"]
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


def test_fused_adamw_allowed_as_client_optimizer_on_the_card(gaudi):
    trainer = hpu_trainer()
    model = Tiny(fused=True)
    model.trainer = trainer
    trainer.strategy._lightning_module = model
    trainer.strategy.config = {"zero_optimization": {"stage": 2}}
    optimizer, _ = trainer.strategy._init_optimizers()
    assert isinstance(optimizer, FusedAdamW)


def test_fused_adamw_refused_with_offload_saying_why(gaudi):
    trainer = hpu_trainer(strategy=HPUDeepSpeedStrategy(stage=2, offload_optimizer=True))
    model = Tiny(fused=True)
    model.trainer = trainer
    trainer.strategy._lightning_module = model
    with pytest.raises(ValueError, match=r"FusedAdamW.*ZeRO-Offload.*torch.optim.AdamW"):
        trainer.strategy._init_optimizers()


def hccl_collective(gaudi, monkeypatch, world_size=2):
    """Lightning's all-reduce, through the double's hccl group (HPU tensors only) of ``world_size`` ranks."""
    ops = []

    def reduce(self, tensor, group=None, reduce_op="mean"):
        ops.append(reduce_op)
        return gaudi.all_reduce(tensor, reduce_op, world_size)

    monkeypatch.setattr(DDPStrategy, "reduce", reduce)
    return ops


def test_reduce_on_hccl_moves_the_tensor_to_the_card_first(gaudi, monkeypatch):
    trainer = hpu_trainer()
    ops = hccl_collective(gaudi, monkeypatch)
    out = trainer.strategy.reduce(torch.tensor(3.0), reduce_op="mean")  # what self.log(..., sync_dist=True) sends
    assert ops == ["sum"] and out.item() == pytest.approx(3.0)  # (3 + 3) / 2 ranks
    assert trainer.strategy.reduce(torch.tensor(3.0), reduce_op="max").item() == 3.0
    assert ops == ["sum", "max"]


def test_reduce_mean_of_integers_is_not_truncated(gaudi, monkeypatch):
    trainer = hpu_trainer()
    hccl_collective(gaudi, monkeypatch)
    out = trainer.strategy.reduce(torch.tensor(3), reduce_op="mean")
    assert out.is_floating_point() and out.item() == pytest.approx(3.0)
    assert trainer.strategy.reduce(torch.tensor(3), reduce_op="sum").dtype == torch.int64


def setup_environment_only(strategy, monkeypatch):
    monkeypatch.setattr(strategy, "_init_deepspeed_distributed", lambda: None)
    monkeypatch.setattr(HPUAccelerator, "setup_device", lambda self, device: None)
    strategy.setup_environment()


def test_deterministic_mode_forced_before_the_trainer_is_reported(gaudi, monkeypatch):
    if hpu_double.deepspeed_hpu_determinism() == "hpu":
        pytest.skip("this DeepSpeed (upstream 0.16) sets the bridge's mode (hpu.setDeterministic), not torch's")
    # The double let DeepSpeed pick its HPU accelerator at install, as importing DeepSpeed on a Gaudi does:
    # deterministic mode is already on, and the strategy has no accelerator to switch.
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)  # the fork leaves it on
    trainer = hpu_trainer()
    with pytest.warns(UserWarning, match=r"deterministic algorithms are on.*when deepspeed was imported"):
        setup_environment_only(trainer.strategy, monkeypatch)
    assert torch.utils.deterministic.fill_uninitialized_memory is False


def test_deterministic_mode_forced_at_selection_is_reported(clean_env, monkeypatch):
    if hpu_double.deepspeed_hpu_determinism() == "hpu":
        pytest.skip("this DeepSpeed (upstream 0.16) sets the bridge's mode (hpu.setDeterministic), not torch's")
    hpu_double.install(clean_env, deepspeed_detects=False)  # DeepSpeed imported before the stack: CPU accelerator
    torch.use_deterministic_algorithms(False)
    trainer = hpu_trainer()
    with pytest.warns(UserWarning, match=r"turned torch's deterministic algorithms on.*Trainer had them off"):
        setup_environment_only(trainer.strategy, monkeypatch)
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator()._name == "hpu"


def test_deterministic_mode_asked_for_is_not_reported(clean_env, monkeypatch, recwarn):
    hpu_double.install(clean_env, deepspeed_detects=False)
    trainer = hpu_trainer(deterministic=True)
    setup_environment_only(trainer.strategy, monkeypatch)
    assert not [w for w in recwarn if "deterministic" in str(w.message)]


# ---------------------------------------------------------------------------- the double behaves like the import
def test_double_picks_eager_by_default_and_fixes_the_mode_at_import(clean_env):
    double = hpu_double.install(clean_env, deepspeed_detects=False)
    assert hpu.imported_mode() == "eager"
    clean_env.setenv("PT_HPU_LAZY_MODE", "1")  # too late: the plugin is loaded
    assert hpu.imported_mode() == "eager" and double.is_lazy() is False


def test_double_picks_lazy_when_asked_before_import(clean_env):
    clean_env.setenv("PT_HPU_LAZY_MODE", "1")
    hpu_double.install(clean_env, deepspeed_detects=False)
    assert hpu.imported_mode() == "lazy"
    assert hpu.mark_step_fn() is not None


def test_double_copies_mpirun_ranks_at_import_like_hccl(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "16")
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "9")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    hpu_double.install(clean_env, deepspeed_detects=False)
    assert (os.environ["WORLD_SIZE"], os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("16", "9", "1")
    assert os.environ["MASTER_ADDR"] == "localhost" and os.environ["ID"] == "9"


def test_double_lets_deepspeed_detect_hpu_with_its_side_effects(clean_env):
    torch.use_deterministic_algorithms(False)
    double = hpu_double.install(clean_env)
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator()._name == "hpu" and get_accelerator().get_compile_backend() == "hpu_backend"
    if hpu_double.deepspeed_hpu_determinism() == "hpu":
        assert double.deterministic and not torch.are_deterministic_algorithms_enabled()
    else:
        assert torch.are_deterministic_algorithms_enabled() and not double.deterministic


@pytest.mark.parametrize("api", ["1", "0"])
def test_fork_determinism_variable(clean_env, api):
    """Habana's fork: DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API=1 makes its accelerator call the bridge's
    hpu.setDeterministic instead of turning torch's mode on; every other DeepSpeed ignores the variable."""
    torch.use_deterministic_algorithms(False)
    clean_env.setenv("DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API", api)
    expected = hpu_double.deepspeed_hpu_determinism()
    double = hpu_double.install(clean_env)
    assert double.deterministic is (expected == "hpu")
    assert torch.are_deterministic_algorithms_enabled() is (expected == "torch")
    assert "DEEPSPEED_USE_HABANA_FRAMEWORKS_DETERMINISTIC_API" in launch_plan.MPI_FORWARD_NAMES  # mpirun forwards it


def test_double_hccl_refuses_cpu_tensors(gaudi):
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        gaudi.all_reduce(torch.tensor(1.0))
    assert gaudi.all_reduce(torch.tensor(1.0).to("hpu"), "sum", 2).item() == 2.0


# ------------------------------------------------------------------------------------ execution mode (point 1)
def test_mode_from_env_defaults_to_eager():
    assert hpu.mode_from_env({}) == "eager"
    assert hpu.mode_from_env({"PT_HPU_LAZY_MODE": "0"}) == "eager"
    assert hpu.mode_from_env({"PT_HPU_LAZY_MODE": "1"}) == "lazy"
    assert hpu.mode_env("lazy") == {"PT_HPU_LAZY_MODE": "1"} and hpu.mode_env("eager") == {"PT_HPU_LAZY_MODE": "0"}


def test_check_mode_keeps_the_imported_mode_and_refuses_the_other(gaudi):
    assert hpu.check_mode(None) == "eager"
    assert "PT_HPU_LAZY_MODE" not in os.environ  # ranks get it from their launcher (tests/test_environ.py)
    assert hpu.check_mode("eager") == "eager"
    with pytest.raises(RuntimeError, match=r"'lazy' was requested.*imported in 'eager'.*PT_HPU_LAZY_MODE=1"):
        hpu.check_mode("lazy")
    with pytest.raises(ValueError, match="hpu_mode=.graph. is not a Gaudi execution mode"):
        hpu.check_mode("graph")


def test_check_mode_without_the_stack_leaves_the_variable(clean_env):
    assert hpu.check_mode("lazy") == "lazy" and "PT_HPU_LAZY_MODE" not in os.environ


def test_mark_step_only_in_lazy_mode(gaudi):
    assert hpu.mark_step_fn() is None  # eager: the default of current releases
    assert hpu.mark_step_fn("lazy") is not None
    assert "torch.compile(backend='hpu_backend')" in hpu.describe_mode("eager", "hpu_backend")
    assert "mark_step" in hpu.describe_mode("lazy", None)


# ------------------------------------------------------------------------------------- tied weights (point 2)
class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_double_unties_on_move_like_the_bridge(gaudi):
    model = TiedLM().to(torch.device("hpu"))
    assert model.head.weight is not model.embed.weight


def test_move_keeping_tied_parameters(gaudi):
    model = move_keeping_tied_parameters(TiedLM(), torch.device("hpu"))
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == 1


# -------------------------------------------------------------------------------------- determinism (point 3)
def test_deterministic_change_names_what_was_forced(clean_env):
    torch.use_deterministic_algorithms(False)
    off = deterministic_state()
    assert deterministic_change(off, forced_before_trainer=False) is None
    torch.use_deterministic_algorithms(True)
    assert "turned torch's deterministic algorithms on" in deterministic_change(off, forced_before_trainer=False)
    on = deterministic_state()
    assert deterministic_change(on, forced_before_trainer=False) is None  # Trainer(deterministic=True)
    assert "when deepspeed was imported, before the Trainer" in deterministic_change(on, forced_before_trainer=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert "(warn_only)" in deterministic_change(on, forced_before_trainer=False)


def test_uninitialized_memory_fill_is_turned_off(clean_env):
    clean_env.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    hpu.disable_uninitialized_memory_fill()
    assert torch.utils.deterministic.fill_uninitialized_memory is False


# ---------------------------------------------------------------------------------- fused optimizers (point 4)
def test_fused_optimizer_refused_only_with_offload():
    params = [torch.nn.Parameter(torch.zeros(2))]
    fused = FusedAdamW(params)
    assert hpu.is_habana_fused_optimizer(fused)
    assert hpu.fused_optimizer_problem(fused, offloads_optimizer=False) is None
    assert "ZeRO-Offload" in hpu.fused_optimizer_problem(fused, offloads_optimizer=True)
    assert hpu.fused_optimizer_problem(torch.optim.AdamW(params), offloads_optimizer=True) is None


# -------------------------------------------------------------------------------------- mpirun (point 5)
def test_mpirun_binding_gives_each_rank_its_cores():
    assert launch_plan.mpirun_binding(8, 96) == ["--bind-to", "core", "--map-by", "socket:PE=12", "--rank-by", "slot"]
    assert launch_plan.mpirun_binding(8, 4) == ["--bind-to", "none"]
    assert launch_plan.mpirun_binding(2, None) == ["--bind-to", "none"]


def test_mpirun_forwards_gaudi_variables_that_are_set():
    env = {"PT_HPU_LAZY_MODE": "0", "HABANA_VISIBLE_MODULES": "4,5", "HCCL_SOCKET_IFNAME": "eth0",
           "LD_LIBRARY_PATH": "/usr/lib/habanalabs", "HOME": "/root", "PT_HCCL_SLICE_SIZE_MB": "16"}
    assert launch_plan.mpirun_forward_names(env) == ["HABANA_VISIBLE_MODULES", "HCCL_SOCKET_IFNAME", "LD_LIBRARY_PATH",
                                             "PT_HCCL_SLICE_SIZE_MB", "PT_HPU_LAZY_MODE"]


# ----------------------------------------------------------------------------- devices and precision (8, 9)
def test_device_index_list_is_refused_with_visible_modules_hint(gaudi):
    with pytest.raises(MisconfigurationException, match=r"HABANA_VISIBLE_MODULES=4,5,6,7.*Trainer\(devices=4\)"):
        L.Trainer(accelerator="hpu", devices=[4, 5, 6, 7], strategy=HPUDeepSpeedStrategy(), logger=False)


def test_fp16_on_first_generation_gaudi_is_refused_at_trainer_construction(clean_env):
    hpu_double.install(clean_env, device_name="GAUDI")
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*GAUDI.*bf16-mixed"):
        L.Trainer(accelerator="hpu", devices=2, precision="16-mixed", strategy=HPUDeepSpeedStrategy(), logger=False)
    validate_precision("bf16-mixed", "hpu")


def test_fp16_on_gaudi2_is_accepted(gaudi):
    validate_precision("16-mixed", "hpu")
    assert HPUAccelerator.get_device_name() == "GAUDI2"


# ------------------------------------------------------------------------- the strategy's execution mode (point 1)
class FakeEngine:
    """What the strategy asks of DeepSpeed's engine after deepspeed.initialize."""

    lr_scheduler = None

    def __init__(self) -> None:
        self.compiled_with = None

    def compile(self, backend=None, compile_kwargs=None):  # DeepSpeedEngine.compile's leading parameters
        self.compiled_with = backend


def build_engine(strategy, monkeypatch) -> FakeEngine:
    import deepspeed

    engine = FakeEngine()
    monkeypatch.setattr(strategy, "_client_optimizer_and_scheduler", lambda: (None, None))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    monkeypatch.setattr(deepspeed, "initialize", lambda **kwargs: (engine, optimizer, None, None))
    monkeypatch.setattr(strategy, "_set_deepspeed_activation_checkpointing", lambda: None)
    strategy._initialize_deepspeed_train(Tiny())
    return engine


def test_eager_by_default_compiles_the_engine_with_the_accelerator_backend(gaudi, monkeypatch, logs):
    trainer = hpu_trainer()
    strategy = trainer.strategy
    assert strategy.hpu_mode == "eager" and strategy.torch_compile
    assert "PT_HPU_LAZY_MODE" not in os.environ  # given to the ranks Lightning's launcher starts only
    assert build_engine(strategy, monkeypatch).compiled_with == "hpu_backend"
    strategy._lightning_module = Tiny()
    strategy._lightning_module.trainer = trainer
    with logs(logging.INFO, "lightning.pytorch") as seen:  # rank_zero_info, Lightning's logger
        setup_environment_only(strategy, monkeypatch)
    assert any("HPU execution mode: eager" in m and "hpu_backend" in m for m in seen.output), seen.output


def test_compile_can_be_turned_off(gaudi, monkeypatch):
    trainer = hpu_trainer(strategy=HPUDeepSpeedStrategy(torch_compile=False))
    assert build_engine(trainer.strategy, monkeypatch).compiled_with is None


def test_cpu_does_not_compile_unless_asked(gaudi, monkeypatch):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(), logger=False)
    assert not trainer.strategy.torch_compile and trainer.strategy.hpu_mode is None


def test_lazy_mode_marks_steps_and_does_not_compile(clean_env, monkeypatch):
    clean_env.setenv("PT_HPU_LAZY_MODE", "1")
    gaudi = hpu_double.install(clean_env)
    trainer = hpu_trainer()
    assert trainer.strategy.hpu_mode == "lazy" and not trainer.strategy.torch_compile
    assert build_engine(trainer.strategy, monkeypatch).compiled_with is None
    trainer.strategy._lightning_module = Tiny()
    trainer.strategy._lightning_module.trainer = trainer
    monkeypatch.setattr(DeepSpeedStrategy, "setup", lambda self, trainer: None)
    trainer.strategy.setup(trainer)
    monkeypatch.setattr(DeepSpeedStrategy, "backward", lambda self, loss, opt, *a, **k: loss)
    trainer.strategy.backward(torch.tensor(1.0), None)
    assert "mark_step" in gaudi.names()


def test_lazy_mode_with_compile_is_refused(clean_env):
    clean_env.setenv("PT_HPU_LAZY_MODE", "1")
    hpu_double.install(clean_env)
    with pytest.raises(ValueError, match="torch.compile needs eager mode"):
        hpu_trainer(strategy=HPUDeepSpeedStrategy(torch_compile=True))


def test_mode_other_than_the_imported_one_is_refused_at_trainer_construction(gaudi):
    with pytest.raises(RuntimeError, match=r"'lazy' was requested.*imported in 'eager'"):
        hpu_trainer(strategy=HPUDeepSpeedStrategy(hpu_mode="lazy"))


def test_bad_mode_and_compile_values_are_refused():
    with pytest.raises(ValueError, match="hpu_mode='graph'"):
        HPUDeepSpeedStrategy(hpu_mode="graph")
    with pytest.raises(ValueError, match="torch_compile='yes'"):
        HPUDeepSpeedStrategy(torch_compile="yes")


# ---------------------------------------------------------------------------- the strategy keeps ties (point 2)
class TiedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM()


def test_strategy_setup_keeps_tied_weights_across_the_move(gaudi, monkeypatch):
    trainer = hpu_trainer()
    model = TiedModule()
    model.trainer = trainer
    trainer.strategy._lightning_module = model
    monkeypatch.setattr(DeepSpeedStrategy, "setup", lambda self, trainer: None)
    trainer.strategy.setup(trainer)
    assert ("module.to", torch.device("hpu")) in gaudi.calls
    assert model.lm.head.weight is model.lm.embed.weight


# ------------------------------------------------------------------ Habana's DeepSpeed fork (1.20.0, 1.21.0)
class FrozenEvalTeacher(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = torch.nn.Linear(4, 4).eval().requires_grad_(False)


@pytest.mark.parametrize("fork", [True, False], ids=["fork-asserts", "upstream"])
def test_zero3_eval_mode_submodule_is_named_where_the_fork_would_assert(gaudi, monkeypatch, fork):
    """The fork's ZeRO-3 backward asserts sub_module.training; the strategy names eval-mode submodules when training
    starts, on that DeepSpeed only (the real check reads DeepSpeed's source: tests/test_compat.py)."""
    from lightning_gaudi_ds import _compat

    monkeypatch.setattr(_compat, "zero3_backward_requires_training_mode", lambda: fork)
    strategy = hpu_trainer(strategy=HPUDeepSpeedStrategy(stage=3)).strategy
    strategy._lightning_module = FrozenEvalTeacher()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        strategy.on_train_start()
    named = [w for w in seen if "backward pass is invalid for module in evaluation mode" in str(w.message)]
    assert bool(named) is fork
    if fork:
        assert "1 submodule(s) are in eval mode: teacher" in str(named[0].message)
