"""lightning_gaudi_ds.LightningCLI: strategy names and precisions refused before anything is built (issue 17)."""

from __future__ import annotations

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_gaudi_ds
from lightning_gaudi_ds import HPUDeepSpeedStrategy, LightningCLI
from lightning_gaudi_ds.lightning_cli import OWN_NAMES, check_trainer_arguments


@pytest.fixture(autouse=True)
def _no_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["train.py"])  # LightningCLI warns when pytest's own arguments are there too


class _CountingModel(BoringModel):
    built = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).built += 1


def _cli(*args: str, subcommand: bool = False) -> LightningCLI:
    """Parse and build (``run=False``: nothing trains); with ``subcommand`` as ``... fit ...`` would."""
    common = ["--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
    return LightningCLI(_CountingModel, args=(["fit"] if subcommand else []) + common + list(args),
                        run=subcommand, save_config_callback=None)


def _refused(*args: str, subcommand: bool = False) -> str:
    _CountingModel.built = 0
    with pytest.raises(ValueError) as info:
        _cli(*args, subcommand=subcommand)
    assert _CountingModel.built == 0, "the model was built before the error"
    return str(info.value)


def test_exported_from_the_package() -> None:
    assert lightning_gaudi_ds.LightningCLI is LightningCLI
    assert "hpu_deepspeed_stage_3_offload" in OWN_NAMES


@pytest.mark.parametrize(("name", "suggestion"), [
    ("hpu_deepspeed_stage_4", "'hpu_deepspeed_stage_1'"),
    ("hpu_deepspeed_stage_3_ofload", "'hpu_deepspeed_stage_3_offload'"),
    ("deepsped", "'deepspeed'"),
])
def test_unknown_strategy_name_lists_this_packages_names(name: str, suggestion: str) -> None:
    message = _refused("--trainer.strategy", name, subcommand=name == "deepsped")
    assert f"strategy={name!r}" in message
    assert "Did you mean" in message and suggestion in message
    assert all(own in message for own in OWN_NAMES)
    assert "lightning_gaudi_ds.HPUDeepSpeedStrategy --trainer.strategy.stage" in message


@pytest.mark.parametrize("strategy", [
    ["--trainer.strategy", "hpu_deepspeed_stage_2"],
    ["--trainer.strategy", "lightning_gaudi_ds.HPUDeepSpeedStrategy", "--trainer.strategy.stage", "3"],
])
def test_64_true_refused_for_this_strategy_with_what_it_supports(strategy: list[str]) -> None:
    message = _refused(*strategy, "--trainer.precision", "64-true")
    assert "precision='64-true'" in message and "HPUDeepSpeedStrategy" in message
    for supported in ("'32-true'", "'bf16-mixed'", "'bf16-true'", "'16-mixed'"):
        assert supported in message
    assert "strategy='deepspeed'" not in message  # Lightning's wording names its own strategy


def test_precision_checked_against_the_named_accelerator() -> None:
    message = _refused("--trainer.strategy", "hpu_deepspeed", "--trainer.accelerator", "cpu",
                       "--trainer.precision", "16-mixed")
    assert "accelerator='cpu'" in message and "'16-mixed'" in message
    assert "'bf16-mixed'" in message and "'16-true'" not in message.split(": DeepSpeed trains in")[1]


def test_accepted_arguments_reach_the_trainer() -> None:
    cli = _cli("--trainer.strategy", "hpu_deepspeed_stage_2", "--trainer.accelerator", "cpu",
               "--trainer.precision", "bf16")
    assert isinstance(cli.trainer.strategy, HPUDeepSpeedStrategy) and cli.trainer.strategy.zero_stage == 2
    assert cli.trainer.precision == "bf16-mixed"


@pytest.mark.parametrize(("strategy", "precision"), [
    ("ddp", "64-true"),  # another strategy: left to Lightning, which supports it there
    ("auto", "64-true"),
    ("hpu_deepspeed_stage_1", "bf16"),  # Lightning's shorthand for bf16-mixed
    ("hpu_deepspeed_stage_3", 32),
    ({"class_path": "lightning.pytorch.strategies.DDPStrategy"}, "64-true"),
    ({"class_path": "no.such.Module"}, "64-true"),  # jsonargparse reports a class path that does not resolve
    (None, "64-true"),
])
def test_what_is_left_alone(strategy: object, precision: object) -> None:
    check_trainer_arguments(strategy, precision, "cpu")


def test_strategy_instance_and_class_path_are_recognised() -> None:
    with pytest.raises(ValueError, match="precision='64-true'"):
        check_trainer_arguments(HPUDeepSpeedStrategy(stage=1), "64-true")
    with pytest.raises(ValueError, match="precision=64"):
        check_trainer_arguments({"class_path": "lightning_gaudi_ds.strategy.HPUDeepSpeedStrategy"}, 64, "gpu")
