"""Lightning Fabric with ``lightning_gaudi_ds.fabric.HPUDeepSpeedStrategy``.

Unit tier: registration and accelerator strings, bad input refused with the Trainer strategy's errors, the Gaudi
wiring through the HPU test double. Process tier: one 2-rank CPU launch (tests/jobs/fabric_job.py, gloo, real
DeepSpeed engines) that trains ZeRO stages 0-3 against Fabric's DDP, in bf16-mixed, under
``fabric.init_module(empty_init=True)``, and saves, loads and resumes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy

from lightning_gaudi_ds import HPUAccelerator, _compat, cli, fabric_cli, hpu
from lightning_gaudi_ds import HPUDeepSpeedStrategy as TrainerStrategy
from lightning_gaudi_ds.checkpoint import MANIFEST
from lightning_gaudi_ds.config import ConfigError
from lightning_gaudi_ds.fabric import HPUDeepSpeedStrategy
from lightning_gaudi_ds.launch._proc import free_port
from lightning_gaudi_ds.core.base import REGISTERED as _REGISTERED
from lightning_gaudi_ds.engine.inference import INFERENCE_KEYS
from tests.procs import JOBS, REPO, run_job
from tests.test_hpu_wiring import clean_env, gaudi  # noqa: F401  (fixtures)

# ------------------------------------------------------------------------------------- registration


@pytest.mark.parametrize(("name", "kwargs"), [(name, kwargs) for name, _, kwargs in _REGISTERED])
def test_every_trainer_name_is_registered_with_fabric(name: str, kwargs: dict[str, Any]) -> None:
    entry = STRATEGY_REGISTRY[name]
    assert entry["strategy"] is HPUDeepSpeedStrategy and entry["init_params"] == kwargs
    if kwargs.get("remote_device") == "nvme" and not Path("/local_nvme").is_dir():  # Lightning's placeholder path
        with pytest.raises(ValueError, match="nvme_path='/local_nvme' does not exist"):
            Fabric(accelerator="cpu", devices=1, strategy=name)
        return
    fabric = Fabric(accelerator="cpu", devices=1, strategy=name)
    assert type(fabric.strategy) is HPUDeepSpeedStrategy
    assert fabric.strategy.config["zero_optimization"]["stage"] == kwargs.get("stage", 2)


def test_hpu_accelerator_is_registered_with_fabric() -> None:
    assert ACCELERATOR_REGISTRY["hpu"]["accelerator"] is HPUAccelerator


def test_cpu_and_bf16_are_accepted_where_lightnings_fabric_strategy_wants_cuda() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="hpu_deepspeed_stage_3", precision="bf16-mixed")
    strategy = fabric.strategy
    assert isinstance(strategy, HPUDeepSpeedStrategy) and strategy.zero_stage_3
    assert strategy.root_device.type == "cpu" and strategy._get_process_group_backend() == "gloo"


@pytest.mark.multiprocess  # a fresh interpreter: the import's first effects
def test_importing_the_fabric_strategy_leaves_the_environment_alone() -> None:
    code = (
        "import os; before = dict(os.environ); import lightning.fabric; import lightning_gaudi_ds.fabric;"
        " from lightning.fabric.strategies import STRATEGY_REGISTRY; assert 'hpu_deepspeed' in STRATEGY_REGISTRY;"
        " changed = {k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k)};"
        " assert not changed, changed"
    )
    env = {k: v for k, v in os.environ.items() if k != "PL_DEEPSPEED_CONFIG_PATH"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# -------------------------------------------------------------------------------------- bad input
BAD_ARGUMENTS = [
    {"stage": 4},
    {"stage": True},
    {"hpu_mode": "fast"},
    {"torch_compile": "yes"},
    {"offload_optimizer": "false"},
    {"number_checkpoints": 0},
    {"remote_device": "gpu"},
    {"stage": 2, "offload_parameters": True},
    {"stage": "auto", "device_memory": "lots"},
    {"config": "/nonexistent/ds_config.json"},
    {"config": {"zero_optimization": {"stage": 7}}},
    {"config": {"zero_optimization": {"stage": 1}}, "offload_parameters": True},
]


@pytest.mark.parametrize("kwargs", BAD_ARGUMENTS, ids=repr)
def test_bad_arguments_get_the_trainer_strategys_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(Exception) as trainer_error:
        TrainerStrategy(**kwargs)
    with pytest.raises(type(trainer_error.value)) as fabric_error:
        HPUDeepSpeedStrategy(**kwargs)
    assert type(fabric_error.value) is type(trainer_error.value)
    assert str(fabric_error.value) == str(trainer_error.value)


def test_one_signature_for_both_strategies_less_the_inference_engine() -> None:
    import inspect

    fabric, trainer = inspect.signature(HPUDeepSpeedStrategy).parameters, inspect.signature(TrainerStrategy).parameters
    trainer_only = {*INFERENCE_KEYS, "resume_data_position"}
    assert list(fabric) == [name for name in trainer if name not in trainer_only]  # the same arguments, less these
    assert all(fabric[name] == trainer[name] for name in fabric if name != "accelerator")  # typed alike
    strategy = HPUDeepSpeedStrategy(3, offload_optimizer=True, logging_batch_size_per_gpu=3, number_checkpoints=2)
    assert strategy.zero_stage_3 and strategy.config["train_micro_batch_size_per_gpu"] == 3  # Lightning's, by keyword
    assert strategy.config["activation_checkpointing"]["number_checkpoints"] == 2
    with pytest.raises(ConfigError, match=r"no inference engine: tensor_parallel, dtype configure the Trainer"):
        HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 2}, dtype="bf16")
    with pytest.raises(ConfigError, match=r"resume_data_position=False: Fabric has no fit loop"):
        HPUDeepSpeedStrategy(resume_data_position=False)


def test_precision_the_device_cannot_run_is_refused_when_fabric_is_built() -> None:
    with pytest.raises(Exception) as trainer_error:
        L.Trainer(accelerator="cpu", devices=1, strategy=TrainerStrategy(), precision="16-mixed", logger=False)
    with pytest.raises(type(trainer_error.value)) as fabric_error:
        Fabric(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(), precision="16-mixed")
    assert str(fabric_error.value) == str(trainer_error.value)


@pytest.mark.parametrize("cls", [HPUDeepSpeedStrategy, TrainerStrategy])
def test_setup_environment_without_devices_says_who_sets_them(cls: type) -> None:
    from lightning.fabric.accelerators import CPUAccelerator

    strategy = cls(accelerator=CPUAccelerator())  # as Lightning's own test builds it: no Fabric, no devices
    with pytest.raises(RuntimeError, match=r"found no devices \(parallel_devices=None\).*Fabric\(strategy=\.\.\.\)"):
        strategy.setup_environment()


def test_stage_auto_needs_device_memory_on_cpu_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="device_memory"):
        Fabric(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(stage="auto"))


def test_config_autos_only_the_model_can_fill_wait_for_setup() -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    strategy = Fabric(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(config=config)).strategy
    strategy._format_config()  # at setup_environment: no model yet, nothing refused
    assert strategy.config["zero_optimization"]["reduce_bucket_size"] == "auto"
    model = torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.Linear(48, 8))
    resolved = strategy._resolve_config(model, "32-true")  # what fabric.setup does
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 8 * 8  # hidden: the smaller side of the weights


def test_init_module_under_zero3_says_which_auto_it_cannot_fill_yet() -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    strategy = Fabric(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(config=config)).strategy
    strategy._format_config()
    with pytest.raises(ValueError, match="reduce_bucket_size.*hidden size"):  # zero.Init needs the whole config
        strategy.module_sharded_context()


def test_init_module_starts_zero_init_in_the_environments_op_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the Trainer's: zero.Init (ZeRO-Infinity's swapper loads async_io and pin_memory) starts in the op cache."""
    import contextlib
    from unittest import mock

    import deepspeed

    from lightning_gaudi_ds.jit_ops.locks import extensions_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    seen: list[str | None] = []

    def start(**kwargs: Any) -> contextlib.AbstractContextManager[None]:
        seen.append(os.environ.get("TORCH_EXTENSIONS_DIR"))
        return contextlib.nullcontext()

    strategy = Fabric(accelerator="cpu", devices=1, strategy=HPUDeepSpeedStrategy(stage=3)).strategy
    strategy._format_config()
    strategy._config_initialized = True  # as Fabric's setup_environment leaves it
    with mock.patch.object(deepspeed.zero, "Init", side_effect=start), strategy.module_sharded_context():
        assert "TORCH_EXTENSIONS_DIR" not in os.environ
    assert seen == [str(extensions_root())] and "TORCH_EXTENSIONS_DIR" not in os.environ


def test_load_checks_the_path_before_it_reads_the_engine(tmp_path: Path) -> None:
    """As Lightning's: a folder that is not a checkpoint is named first, whatever engine the state holds (a stand-in
    here, without the `.module` a real engine has)."""
    from unittest import mock

    from deepspeed import DeepSpeedEngine

    engine = mock.Mock(spec=DeepSpeedEngine, optimizer=None)
    with pytest.raises(FileNotFoundError, match="The provided path is not a valid DeepSpeed checkpoint"):
        HPUDeepSpeedStrategy().load_checkpoint(path=tmp_path, state={"model": engine, "step": 0})
    engine.load_checkpoint.assert_not_called()


# --------------------------------------------------------------------------- Gaudi wiring (test double)
def hpu_fabric(**kwargs: Any) -> Fabric:
    kwargs.setdefault("strategy", HPUDeepSpeedStrategy(stage=2))
    return Fabric(accelerator="hpu", devices=2, precision="bf16-mixed", **kwargs)


def test_fabric_selects_hpu_devices_and_hccl(gaudi: Any) -> None:  # noqa: F811
    strategy = hpu_fabric().strategy
    assert isinstance(strategy.accelerator, HPUAccelerator)
    assert strategy.parallel_devices == [torch.device("hpu")] * 2
    assert strategy._get_process_group_backend() == "hccl"
    assert strategy.hpu_mode == hpu.mode_from_env() == "eager" and strategy.torch_compile


def test_setup_environment_hccl_rank_args_and_deepspeed_on_hpu_only_around_its_calls(
    gaudi: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    strategy = hpu_fabric().strategy
    seen = {}
    monkeypatch.setattr(_compat, "set_deepspeed_accelerator", lambda name: gaudi.record("ds_accelerator"))
    monkeypatch.setattr(strategy, "_init_deepspeed_distributed", lambda: seen.update(
        backend=strategy._get_process_group_backend(), use_hpu=os.environ.get("DEEPSPEED_USE_HPU")))
    monkeypatch.setattr(HPUAccelerator, "setup_device", lambda self, device: gaudi.record("setup_device", device))
    strategy.setup_environment()
    assert seen == {"backend": "hccl", "use_hpu": "true"} and "DEEPSPEED_USE_HPU" not in os.environ
    assert dict(gaudi.calls)["initialize_distributed_hpu"] == {"world_size": 2, "rank": 0, "local_rank": 0}
    assert gaudi.names() == ["ds_accelerator", "initialize_distributed_hpu", "setup_device"]
    assert strategy._deepspeed_args().device_rank == 0


def test_all_reduce_mean_on_hccl_is_a_sum_over_the_ranks_on_the_card(
    gaudi: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    strategy = hpu_fabric().strategy
    ops = []

    def all_reduce(self: Any, tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
        ops.append(reduce_op)
        return gaudi.all_reduce(tensor, reduce_op, 2)

    monkeypatch.setattr(DDPStrategy, "all_reduce", all_reduce)
    out = strategy.all_reduce(torch.tensor(3), reduce_op="mean")
    assert ops == ["sum"] and out.is_floating_point() and out.item() == pytest.approx(3.0)


# ------------------------------------------------------------------------------ 2 ranks, real engines
def fabric_job(out: Path, *args: str, ranks: int) -> list[dict[str, Any]]:
    run_job([sys.executable, str(JOBS / "fabric_job.py"), "--out", str(out), *args], timeout=900, ranks=ranks).check()
    files = sorted(out.glob("rank*.json"))
    assert len(files) == ranks, f"expected a result per rank under {out}"
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fabric")


@pytest.fixture(scope="module")
def fabric_runs(job_dir: Path) -> list[dict[str, Any]]:
    return fabric_job(job_dir / "2ranks", ranks=2)


@pytest.fixture(scope="module")
def reloaded_on_one_rank(job_dir: Path, fabric_runs: list[dict[str, Any]]) -> dict[str, Any]:
    return fabric_job(job_dir / "1rank", "--reload", str(job_dir / "2ranks" / "ckpt"), "--devices", "1", ranks=1)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_like_fabric_ddp_in_fp32(fabric_runs: list[dict[str, Any]], stage: int) -> None:
    for rank in fabric_runs:
        run, ddp = rank[f"fp32_stage{stage}"], rank["ddp"]
        assert run["strategy"] == "lightning_gaudi_ds.fabric.HPUDeepSpeedStrategy" and run["zero_stage"] == stage
        assert ddp["strategy"].endswith("DDPStrategy")
        assert len(run["losses"]) == len(ddp["losses"]) == 4
        assert run["losses"] == pytest.approx(ddp["losses"], abs=1e-6, rel=0)
        assert run["all_reduce_mean"] == 0.5 and run["broadcast"] == "rank1"  # Fabric's collectives through it
    assert fabric_runs[0]["ddp"]["losses"] != fabric_runs[1]["ddp"]["losses"]  # each rank had its own batches


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_in_bf16_mixed(fabric_runs: list[dict[str, Any]], stage: int) -> None:
    for rank in fabric_runs:
        run, ddp = rank[f"bf16_stage{stage}"], rank["ddp"]
        assert run["bf16"] and run["param_dtype"] == "torch.bfloat16" and run["zero_stage"] == stage
        assert all(torch.isfinite(torch.tensor(run["losses"])))
        assert run["losses"][-1] < run["losses"][0]
        assert run["losses"] == pytest.approx(ddp["losses"], rel=0.1)  # bf16 rounding (stage 0: no fp32 master weights)


@pytest.mark.multiprocess
def test_init_module_builds_zero3_partitions_that_train_like_ddp(fabric_runs: list[dict[str, Any]]) -> None:
    for rank in fabric_runs:
        run = rank["init_module_stage3"]
        assert run["partitioned"] and all(run["partitioned"])  # every weight: an empty placeholder + its partition
        assert not any(rank["fp32_stage3"]["partitioned"])  # built outside init_module: whole until setup
        assert run["losses"] == pytest.approx(rank["ddp"]["losses"], abs=1e-6, rel=0)


@pytest.mark.multiprocess
def test_zero_offload_trains_the_torch_adam_as_cpu_adam(fabric_runs: list[dict[str, Any]]) -> None:
    for rank in fabric_runs:
        run = rank["offload_stage2"]
        assert run["zero_stage"] == 2
        assert run["losses"] == pytest.approx(rank["ddp"]["losses"], abs=1e-5, rel=0)  # the same Adam, on the CPU


@pytest.mark.multiprocess
def test_setup_refuses_what_deepspeed_fails_on_later_and_names_the_fix(fabric_runs: list[dict[str, Any]]) -> None:
    for rank in fabric_runs:
        run = rank["refusals"]
        # ZeRO-2 without an optimizer: DeepSpeed's "zero stage 2 requires an optimizer" AssertionError, 31 lines deep
        assert run["no_optimizer"].startswith("ConfigError: fabric.setup_module(Sequential) at ZeRO stage 2"), run
        assert "fabric.setup(model, optimizer)" in run["no_optimizer"]
        assert "HPUDeepSpeedStrategy(stage=0)" in run["no_optimizer"] and run["stage0_forward"] > 0  # the fix works
        # the same raw module set up twice at ZeRO-3: refused at set-up, not in stage3's backward
        assert run["set_up_twice"].startswith("ConfigError: fabric.setup got a Sequential that a ZeRO-3 engine"), run
        assert "Use the model that the first fabric.setup returned" in run["set_up_twice"]
        assert run["first_after_refusal"][1] < run["first_after_refusal"][0]  # the first model still trains


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_save_and_load_resume_exactly(fabric_runs: list[dict[str, Any]], stage: int) -> None:
    for rank in fabric_runs:
        run = rank[f"resume_stage{stage}"]
        assert run["step"] == 2  # the state's plain values come back too
        # ZeRO against DDP: the same sums in another order (6e-8 apart at step 2 on CI); within 1e-6 as beside it
        assert run["first"] == pytest.approx(rank["ddp"]["losses"][:2], abs=1e-6, rel=0)
        assert run["resumed"] == run["continued"]  # the same engine both ways: bit for bit, and only the checkpoint
        # makes them agree (the resumed run starts from other initial weights)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_save_is_crash_safe(fabric_runs: list[dict[str, Any]], stage: int) -> None:
    for rank in fabric_runs:
        run = rank[f"resume_stage{stage}"]
        assert run["manifest"] and not run["partial"]  # committed: the manifest written, `<name>.partial` renamed


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_load_reshards_to_another_world_size(
    fabric_runs: list[dict[str, Any]], reloaded_on_one_rank: dict[str, Any], stage: int
) -> None:
    saved, loaded = fabric_runs[0][f"resume_stage{stage}"], reloaded_on_one_rank[f"reload_stage{stage}"]
    assert loaded["step"] == 2
    assert loaded["eval"] == pytest.approx(saved["eval_at_save"], abs=1e-6, rel=0)  # the 2-rank weights on 1 rank
    assert loaded["eval"] != pytest.approx(fabric_runs[0]["ddp"]["losses"][0], abs=1e-3)  # not the initial weights
    assert all(torch.isfinite(torch.tensor(loaded["after_step"])))  # the resharded optimizer state steps


@pytest.mark.multiprocess
def test_from_pretrained_in_init_module_loads_zero3_partitions_with_tied_weights(
    fabric_runs: list[dict[str, Any]],
) -> None:
    for rank in fabric_runs:
        run = rank["hf_stage3"]
        assert run["embedding_partitioned"], run  # built already partitioned, not materialized then split
        assert run["tied_when_built"] and run["tied_after_setup"], run  # one embedding/head parameter
        # the pretrained weights were loaded into the partitions: the first loss is plain PyTorch's on that folder
        assert run["losses"][0] == pytest.approx(run["reference"], abs=1e-5, rel=0)
        assert run["losses"][1] < run["losses"][0]


@pytest.mark.multiprocess
def test_fabric_lm_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    example = REPO / "examples" / "fabric_lm.py"
    tiny = ["--strategy", "hpu_deepspeed_stage_3", "--accelerator", "cpu", "--devices", "2", "--n_layer", "1",
            "--n_embd", "64", "--n_head", "2", "--warmup_steps", "2", "--val_batches", "2", "--out", str(tmp_path)]
    first = run_job([sys.executable, str(example), *tiny, "--max_steps", "4"], timeout=600).check().output
    assert "fabric_lm summary" in first and "4 steps on 2 x cpu, HPUDeepSpeedStrategy (ZeRO stage 3)" in first, first
    checkpoint = tmp_path / "checkpoint"
    assert (checkpoint / MANIFEST).is_file()
    resumed = run_job([sys.executable, str(example), *tiny, "--max_steps", "6", "--resume", str(checkpoint)],
                      timeout=600, ranks=2).check().output  # warm: the first run above is the cold one, as a user's
    assert f"resumed from {checkpoint} at step 4" in resumed and "6 steps on 2 x cpu" in resumed, resumed[-3000:]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,train_loss,val_loss" and rows[1].startswith("5,")  # the resumed run counts on from 4


# --------------------------------------------------- `lightning-gaudi-ds fabric run` (Lightning's `fabric run`)
def _no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run as torchrun

    monkeypatch.setattr(torchrun, "main", lambda *args: pytest.fail("a process was started"))


def test_fabric_run_takes_lightnings_options_plus_hpu_and_every_registered_name(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    run = fabric_cli.fabric_group().commands["run"]
    for name, _, _ in _REGISTERED:  # offload names included: each is complete as registered
        ctx = run.make_context("run", ["--accelerator", "hpu", "--strategy", name, "--devices", "8",
                                       "--num_nodes", "2", "--precision", "bf16-mixed", str(script), "--lr", "1"])
        assert ctx.params["strategy"] == name and ctx.params["accelerator"] == "hpu"
        assert ctx.params["num_nodes"] == 2 and ctx.params["script_args"] == ("--lr", "1")
    lightning_run = _compat.fabric_run_command()
    assert {p.name for p in run.params} == {p.name for p in lightning_run.params}  # exactly Lightning's options
    ddp = run.make_context("run", ["--strategy", "ddp", "--accelerator", "cpu", str(script)]).params
    assert ddp["strategy"] == "ddp"  # Lightning's own names still there
    accelerator = next(p for p in lightning_run.params if p.name == "accelerator")
    assert "hpu" not in accelerator.type.choices  # Lightning's command is left as it was


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "hpu_deepspeed_stage_4"], "Invalid value for '--strategy': 'hpu_deepspeed_stage_4' is not one"),
        (["--accelerator", "gaudi"], "Invalid value for '--accelerator': 'gaudi' is not one of"),
        (["--accelerator", "hpu", "--devices", "0,1"], "HABANA_VISIBLE_MODULES=0,1 and pass --devices 2"),
        (["--accelerator", "hpu", "--devices", "auto"], "'auto' counts the Gaudi devices of this machine, and none"),
    ],
)
def test_fabric_run_refuses_bad_input_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
    message: str,
) -> None:
    _no_torchrun(monkeypatch)
    monkeypatch.setattr(hpu, "hpu_available", lambda: False)
    script = tmp_path / "train.py"
    script.write_text("")
    environ = dict(os.environ)
    assert cli.main(["fabric", "run", *argv, str(script)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "--strategy" in argv:
        assert "hpu_deepspeed_stage_3_offload_nvme" in err  # the allowed names are listed
    assert dict(os.environ) == environ


def test_fabric_run_counts_hpus_for_auto_devices(gaudi: Any) -> None:  # noqa: F811
    assert fabric_cli.hpu_processes("auto") == gaudi.devices == 8
    assert fabric_cli.hpu_processes("2") == 2


@pytest.mark.multiprocess
def test_fabric_run_trains_a_script_that_never_imports_the_package(tmp_path: Path) -> None:
    # The LitGPT case: the script builds `Fabric()` from fabric run's LT_* variables and imports only Lightning.
    script = JOBS / "fabric_run_job.py"
    imports = [line for line in script.read_text().splitlines() if line.startswith(("import ", "from "))]
    assert imports and not any("lightning_gaudi_ds" in line for line in imports)
    run_job([sys.executable, "-m", "lightning_gaudi_ds", "fabric", "run", "--accelerator", "cpu", "--devices", "2",
             "--strategy", "hpu_deepspeed_stage_2", "--main-port", str(free_port()), str(script), str(tmp_path)],
            timeout=600).check()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(ranks):
        assert result["strategy"] == "lightning_gaudi_ds.fabric.HPUDeepSpeedStrategy" and result["zero_stage"] == 2
        assert result["world_size"] == 2 and result["global_rank"] == rank
        assert result["losses"][-1] < result["losses"][0]  # it trained
        # run as `python SCRIPT ARGS` would: __main__, its argv, its folder first on sys.path
        assert result["name"] == "__main__" and result["argv"] == [str(script), str(tmp_path)]
        assert result["path0"] == str(JOBS)
    assert ranks[0]["weights"] == ranks[1]["weights"]  # one model: the ranks' gradients were averaged
    assert ranks[0]["losses"] != ranks[1]["losses"]  # on batches of their own
