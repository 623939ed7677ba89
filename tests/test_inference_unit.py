"""Tensor-parallel inference (lightning_gaudi_ds.engine.inference): settings, every bad input, the checks DeepSpeed
would otherwise fail late or silently on. No processes; the 2-rank runs are in tests/test_inference.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gaudi_ds.engine import inference as inf
from tests.procs import REPO


def _example():
    if "train_lm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_lm", REPO / "examples" / "train_lm.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_lm"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_lm"]


def _gpt():
    lm = _example()
    return lm, lm.GPT(lm.GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))


# ------------------------------------------------------------------------------------------- settings
def test_no_inference_setting_means_no_inference_engine():
    assert inf.settings_from({}, {}) is None
    assert inf.settings_from({"tensor_parallel": None, "dtype": None}, {}) is None


def test_arguments_and_config_keys_merge():
    s = inf.settings_from({"tensor_parallel": {"tp_size": 2}}, {"dtype": "bf16", "replace_method": "auto"})
    assert (s.tp_size, s.dtype, s.replace_method, s.tensor_parallel) == (2, torch.bfloat16, "auto", True)
    same = inf.settings_from({"dtype": torch.bfloat16}, {"dtype": "torch.bfloat16"})
    assert same.dtype == torch.bfloat16 and same.tp_size == 1 and not same.tensor_parallel


def test_split_config_keeps_the_training_config_apart():
    rest, part = inf.split_config({"tensor_parallel": {"tp_size": 2}, "dtype": "bf16", "zero_optimization": {}})
    assert rest == {"zero_optimization": {}} and part == {"tensor_parallel": {"tp_size": 2}, "dtype": "bf16"}
    assert inf.split_config(None) == (None, {})


def test_contradictions_between_argument_and_config_are_one_error():
    with pytest.raises(MisconfigurationException) as err:
        inf.settings_from(
            {"tensor_parallel": {"tp_size": 2}, "dtype": torch.float32},
            {"tensor_parallel": {"tp_size": 4}, "dtype": "bf16"},
        )
    text = str(err.value)
    assert "tensor_parallel: argument {'tp_size': 2}, config {'tp_size': 4}" in text
    assert "dtype: argument torch.float32, config 'bf16'" in text


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"tensor_parallel": {"tp_size": 0}}, "tp_size must be a positive integer"),
        ({"tensor_parallel": {"tp_size": "2"}}, "tp_size must be a positive integer"),
        ({"tensor_parallel": {"tp_size": True}}, "tp_size must be a positive integer"),
        ({"tensor_parallel": 2}, r"expected a dict such as \{'tp_size': 2\}"),
        ({"tensor_parallel": {"tp_size": 2, "tp_group": object()}}, r"unknown key\(s\) \['tp_group'\]"),
        ({"dtype": "int8"}, "not a dtype tensor-parallel inference runs in"),
        ({"dtype": torch.float64}, "not a dtype tensor-parallel inference runs in"),
        ({"replace_method": "layer"}, "DeepSpeed only knows 'auto'"),
        ({"enable_cuda_graph": "yes"}, "expected True or False"),
        ({"injection_policy": {}}, "expected a non-empty dict"),
        ({"injection_policy": {int: ("a",)}}, "not a torch.nn.Module subclass"),
        ({"injection_policy": {torch.nn.Linear: ()}}, "expected the names of linear layers"),
        ({"injection_policy": {"no_such_pkg.Block": "proj"}}, "cannot import 'no_such_pkg.Block'"),
        (
            {"injection_policy": {torch.nn.Linear: "x"}, "replace_with_kernel_inject": True},
            "`injection_policy` and `replace_with_kernel_inject=True` exclude each other",
        ),
    ],
)
def test_bad_settings(args, match):
    with pytest.raises(MisconfigurationException, match=match):
        inf.settings_from(args, {})


def test_injection_policy_from_an_import_path_for_yaml_and_json():
    policy = inf.parse_injection_policy({"torch.nn.TransformerEncoderLayer": "linear2"})
    assert policy == {torch.nn.TransformerEncoderLayer: ("linear2",)}


def test_tensor_parallel_disabled_is_tp_size_one():
    assert inf.settings_from({"tensor_parallel": {"tp_size": 4, "enabled": False}}, {}).tp_size == 1


# ------------------------------------------------------------------------------- against the Trainer
@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16),
     ("16-mixed", torch.float16), ("16-true", torch.float16)],
)
def test_dtype_comes_from_the_trainer_precision(precision, dtype):
    assert inf.resolve_dtype(inf.InferenceSettings(tp_size=2), precision) == dtype
    assert inf.resolve_dtype(inf.InferenceSettings(tp_size=2, dtype=dtype), precision) == dtype


def test_dtype_that_contradicts_the_precision():
    with pytest.raises(MisconfigurationException, match=r"dtype=torch.float32\) contradicts Trainer\(precision="
                       r"'bf16-mixed'\).*Trainer\(precision='32-true'\)"):
        inf.resolve_dtype(inf.InferenceSettings(tp_size=2, dtype=torch.float32), "bf16-mixed")
    with pytest.raises(MisconfigurationException, match="64-true"):
        inf.resolve_dtype(inf.InferenceSettings(tp_size=2), "64-true")


@pytest.mark.parametrize(
    ("tp", "world", "match"),
    [
        (4, 2, r"needs 4 processes; the Trainer starts 2"),
        (3, 4, r"does not divide the 4 processes"),
    ],
)
def test_tp_size_against_the_world_size(tp, world, match):
    with pytest.raises(MisconfigurationException, match=match):
        inf.check_world(inf.InferenceSettings(tp_size=tp), world, "cpu")


def test_tp_size_dividing_the_world_is_accepted():
    inf.check_world(inf.InferenceSettings(tp_size=2), 2, "cpu")
    inf.check_world(inf.InferenceSettings(tp_size=2), 4, "cpu")  # two groups of two: data-parallel replicas
    inf.check_world(inf.InferenceSettings(tp_size=1), 4, "cpu")


@pytest.mark.parametrize(
    ("settings", "device", "match"),
    [
        (inf.InferenceSettings(tp_size=2, enable_cuda_graph=True), "cpu", "not on CPU"),
        (inf.InferenceSettings(tp_size=2, enable_cuda_graph=True), "cuda", "does not capture CUDA graphs"),
        (inf.InferenceSettings(tp_size=2, replace_with_kernel_inject=True), "cpu", "are CUDA kernels"),
    ],
)
def test_device_specific_options(settings, device, match):
    with pytest.raises(MisconfigurationException, match=match):
        inf.check_world(settings, 2, device)


def test_graphs_on_hpu_and_cuda_without_tp_are_accepted():
    inf.check_world(inf.InferenceSettings(tp_size=2, enable_cuda_graph=True), 2, "hpu")
    inf.check_world(inf.InferenceSettings(tp_size=1, enable_cuda_graph=True), 1, "cuda")


@pytest.mark.parametrize(
    ("explicit", "config", "match"),
    [
        ({"stage": 3}, None, "stage=3"),
        ({"offload_optimizer": True}, None, "offload_optimizer=True"),
        ({"offload_parameters": True, "stage": 3}, None, "offload_parameters=True, stage=3"),
        ({"config": {}}, {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
         r'"zero_optimization.stage": 3, config "zero_optimization.offload_param"'),
    ],
)
def test_zero_options_that_cannot_apply(explicit, config, match):
    with pytest.raises(MisconfigurationException, match=match):
        inf.check_zero_options(inf.InferenceSettings(tp_size=2), explicit, config)


def test_default_zero_settings_do_not_count_against_tp():
    # Lightning's built-in config (stage 2) is not the user's choice; stage 1 or 2 set explicitly is harmless.
    inf.check_zero_options(inf.InferenceSettings(tp_size=2), {"stage": 2}, {"zero_optimization": {"stage": 2}})
    inf.check_zero_options(inf.InferenceSettings(tp_size=1), {"stage": 3}, None)


# ----------------------------------------------------------------------------------- model checks
def test_own_model_without_policy_names_the_argument_and_candidates():
    _, gpt = _gpt()
    with pytest.raises(MisconfigurationException) as err:
        inf.check_splittable(gpt, inf.InferenceSettings(tp_size=2))
    text = str(err.value)
    assert "AutoTP cannot split GPT" in text and "injection_policy=" in text
    assert "Block: linear layers ['attn.q', 'attn.k', 'attn.v', 'attn.proj', 'mlp.0', 'mlp.2']" in text


def test_policy_that_does_not_match_the_model():
    lm, gpt = _gpt()
    with pytest.raises(MisconfigurationException, match=r"Block: no linear layer named 'attn.out'"):
        inf.check_splittable(gpt, inf.InferenceSettings(tp_size=2, injection_policy={lm.Block: ("attn.out",)}))
    with pytest.raises(MisconfigurationException, match="TransformerEncoderLayer: the model has no module"):
        inf.check_splittable(
            gpt, inf.InferenceSettings(tp_size=2, injection_policy={torch.nn.TransformerEncoderLayer: ("x",)})
        )
    inf.check_splittable(gpt, inf.InferenceSettings(tp_size=2, injection_policy={lm.Block: ("attn.proj", "mlp.2")}))


def test_hugging_face_llama_passes_autotp_checks():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    inf.check_splittable(transformers.LlamaForCausalLM(cfg), inf.InferenceSettings(tp_size=2))


def test_sampler_gives_every_rank_of_a_group_the_same_samples():
    assert [inf.sampler_kwargs(2, r, 2) for r in range(2)] == [{"num_replicas": 1, "rank": 0}] * 2
    assert [inf.sampler_kwargs(2, r, 1)["rank"] for r in range(2)] == [0, 1]
    assert [inf.sampler_kwargs(4, r, 2) for r in range(4)] == [{"num_replicas": 2, "rank": r // 2} for r in range(4)]


def test_checkpoint_file_and_missing_path(tmp_path):
    _, gpt = _gpt()
    torch.save(gpt.state_dict(), tmp_path / "bare.pt")
    loaded = inf.load_full_state_dict(tmp_path / "bare.pt")
    assert set(loaded["state_dict"]) == set(gpt.state_dict())
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        inf.load_full_state_dict(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MisconfigurationException, match="is not a DeepSpeed ZeRO checkpoint"):
        inf.load_full_state_dict(tmp_path / "empty")


# ------------------------------------------------------------------------- through the strategy and Trainer
import lightning as L  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from lightning_gaudi_ds import HPUDeepSpeedStrategy, TensorParallelStrategy  # noqa: E402


def _trainer(strategy: HPUDeepSpeedStrategy, devices: int = 2, precision: str = "32-true") -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, precision=precision, strategy=strategy, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def test_strategy_takes_lightning_habanas_arguments_and_config_keys():
    strategy = HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16, replace_method="auto",
                                    replace_with_kernel_inject=False, enable_cuda_graph=False)
    assert strategy._inference == inf.InferenceSettings(tp_size=2, dtype=torch.bfloat16, replace_method="auto")
    from_config = HPUDeepSpeedStrategy(config={"tensor_parallel": {"tp_size": 2}, "dtype": "bf16",
                                               "replace_with_kernel_inject": False, "enable_cuda_graph": False})
    assert from_config._inference == inf.InferenceSettings(tp_size=2, dtype=torch.bfloat16)
    # the inference keys never reach DeepSpeed's training-config validation or the training config
    assert "tensor_parallel" not in from_config.config and "dtype" not in from_config.config
    assert not hasattr(HPUDeepSpeedStrategy(), "_inference")  # a training strategy: no engine settings at all
    assert type(strategy) is type(from_config) is TensorParallelStrategy and isinstance(strategy, HPUDeepSpeedStrategy)


def test_strategy_reports_argument_and_config_contradictions():
    with pytest.raises(MisconfigurationException, match="tensor_parallel: argument"):
        HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 2}, config={"tensor_parallel": {"tp_size": 4}})


def test_strategy_refuses_zero3_and_offload_with_tp():
    with pytest.raises(MisconfigurationException, match="stage=3"):
        HPUDeepSpeedStrategy(stage=3, tensor_parallel={"tp_size": 2})
    with pytest.raises(MisconfigurationException, match="offload_optimizer=True"):
        HPUDeepSpeedStrategy(offload_optimizer=True, tensor_parallel={"tp_size": 2})
    with pytest.raises(MisconfigurationException, match="stage='auto'"):
        HPUDeepSpeedStrategy(stage="auto", tensor_parallel={"tp_size": 2})


def test_tp_size_and_precision_checked_when_the_trainer_is_built():
    with pytest.raises(MisconfigurationException, match="needs 4 processes; the Trainer starts 2"):
        _trainer(HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 4}))
    with pytest.raises(MisconfigurationException, match=r"contradicts Trainer\(precision='bf16-mixed'\)"):
        _trainer(HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 2}, dtype="fp32"), precision="bf16-mixed")
    trainer = _trainer(HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 2}), precision="bf16-mixed")
    assert trainer.strategy._inference_dtype == torch.bfloat16


def test_fit_is_refused_before_any_process_group():
    trainer = _trainer(HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 1}), devices=1)
    with pytest.raises(MisconfigurationException, match="trainer.predict, trainer.validate and trainer.test"):
        trainer.fit(BoringModel())
    assert not torch.distributed.is_initialized()


def test_distributed_sampler_gives_the_group_the_same_batches():
    strategy = _trainer(HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 2})).strategy
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert strategy.restore_checkpoint_after_setup is False  # whole weights load before the split
    plain = _trainer(HPUDeepSpeedStrategy()).strategy
    assert plain.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert plain.restore_checkpoint_after_setup is True


# ------------------------------------------------------------------- HPU graphs, wired with the Gaudi double
from tests.test_hpu_wiring import clean_env, gaudi  # noqa: E402,F401  (fixtures)


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_enable_cuda_graph_means_hpu_graphs_on_gaudi_in_lazy_mode(clean_env, monkeypatch, mode):  # noqa: F811
    """Gaudi's enable_cuda_graph is an HPU graph around the split module, in lazy mode only (as Habana's fork's
    HPU_Accelerator.wrap_in_hpu_graph); eager mode warns and runs the module as it is."""
    import deepspeed

    from tests import hpu_double

    clean_env.setenv("PT_HPU_LAZY_MODE", "1" if mode == "lazy" else "0")
    gaudi = hpu_double.install(clean_env)
    trainer = L.Trainer(accelerator="hpu", devices=2, precision="bf16-mixed", logger=False,
                        strategy=HPUDeepSpeedStrategy(tensor_parallel={"tp_size": 2}, enable_cuda_graph=True,
                                                      hpu_mode=mode))
    strategy = trainer.strategy
    assert strategy._inference_dtype == torch.bfloat16

    class Engine:
        def __init__(self, model, config):
            gaudi.record("init_inference", config)
            self.module, self.mp_group = model, None

    monkeypatch.setattr(deepspeed, "init_inference", lambda model, config: Engine(model, config))
    lm, gpt = _gpt()
    strategy._inference = dataclasses.replace(strategy._inference, injection_policy={lm.Block: ("attn.proj", "mlp.2")})
    monkeypatch.setattr(type(strategy), "world_size", property(lambda self: 2))
    if mode == "lazy":
        strategy._initialize_deepspeed_inference(gpt)
        (name, config), (wrapped, module) = gaudi.calls[-2:]
        assert (name, wrapped) == ("init_inference", "wrap_in_hpu_graph") and module is gpt
    else:
        with pytest.warns(UserWarning, match="HPU graphs, which need lazy mode"):
            strategy._initialize_deepspeed_inference(gpt)
        name, config = gaudi.calls[-1]
        assert name == "init_inference" and "wrap_in_hpu_graph" not in gaudi.names()
    # DeepSpeed's own CUDA-graph path stays off (it refuses tp_size > 1)
    assert config["enable_cuda_graph"] is False and config["dtype"] == torch.bfloat16
    assert config["tensor_parallel"] == {"tp_size": 2}
    assert strategy.model.module is gpt


def test_benchmark_summary_ratios_against_tp1():
    sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks import their siblings by name, as run
    import tp_inference as bench

    def run(arm, procs, bytes_, ms, tps, tokens):
        rank = {"param_bytes": bytes_, "decode_ms_per_token": ms, "tokens_per_s": tps, "prefill_s": 0.1,
                "shm_op": arm == "tp2_shm", "tokens": tokens}
        return {"arm": arm, "processes": procs, "ranks": [rank] * procs}

    runs = [run("tp1", 1, 1000, 10.0, 50.0, [1, 2]), run("tp2_shm", 2, 520, 8.0, 60.0, [1, 2]),
            run("tp2_gloo", 2, 520, 20.0, 25.0, [1, 3])]
    rows = {r["arm"]: r for r in bench.summarize(runs)}
    assert rows["tp2_shm"]["bytes_ratio"] == pytest.approx(0.52)
    assert rows["tp2_shm"]["latency_ratio"] == pytest.approx(0.8)
    assert rows["tp2_gloo"]["tokens_per_s_ratio"] == pytest.approx(0.5)
    assert rows["tp2_shm"]["same_tokens_as_tp1"] and not rows["tp2_gloo"]["same_tokens_as_tp1"]
    assert "| tp2_gloo | 2 |" in bench.markdown(list(rows.values()), {
        "model": {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
                  "vocab_size": 32}, "parameters": 1e6, "new_tokens": 2, "prompt_tokens": 2, "reps": 1, "rounds": 1,
        "machine": "x", "torch": "t", "deepspeed": "d", "transformers": "h", "loadavg": "0"})


def test_shm_op_is_loaded_for_one_tensor_parallel_group_only():
    two = inf.InferenceSettings(tp_size=2)
    assert inf.shm_comm_mode(two, 2, None) == "on"
    assert inf.shm_comm_mode(two, 2, "off") is None  # the user's choice stands
    assert inf.shm_comm_mode(None, 2, None) is None and inf.shm_comm_mode(inf.InferenceSettings(), 2, None) is None
    assert inf.shm_comm_mode(two, 4, None) == "off"  # its kernel would sum over all four ranks
    with pytest.warns(UserWarning, match="ignores the tensor-parallel group"):
        assert inf.shm_comm_mode(two, 4, "on") == "off"


# ------------------------------------------------------------------- damaged checkpoints (issue 22, bug 1)
def test_serving_refuses_an_unfinished_save_as_training_does(tmp_path):
    from lightning_gaudi_ds.checkpoint import IncompleteCheckpointError
    from tests.test_checkpoint import fake_checkpoint

    partial = fake_checkpoint(tmp_path, stage=0, world_size=1, name="last.ckpt.partial")  # no manifest
    for load in (inf.load_full_state_dict, inf.checkpoint_hparams):
        with pytest.raises(IncompleteCheckpointError, match=r"missing: .*lightning_gaudi_ds_manifest.json.*unfinished"
                           r" save of last\.ckpt"):
            load(partial)


def test_serving_names_a_truncated_shard(tmp_path):
    from lightning_gaudi_ds.checkpoint import IncompleteCheckpointError
    from tests.test_checkpoint import fake_checkpoint

    path = fake_checkpoint(tmp_path, stage=2, world_size=1)
    shard = path / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(IncompleteCheckpointError, match=r"checkpoint/zero_pp_rank_0_mp_rank_00_optim_states\.pt"
                       r" \(truncated\)"):
        inf.load_full_state_dict(path)


def test_tensor_parallel_groups_are_made_in_each_process_group(tmp_path):
    """No group outlives destroy_process_group: a second process group gets groups of its own (issue 22)."""
    import torch.distributed as dist

    for attempt in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{attempt}'}", rank=0, world_size=1)
        try:
            mpu = inf._TensorParallelGroup.new(1)
            assert mpu.get_model_parallel_rank() == 0 and mpu.get_model_parallel_world_size() == 1
            assert dist.get_world_size(mpu.get_model_parallel_group()) == 1
        finally:
            dist.destroy_process_group()
