"""Unit tests of lightning_gaudi_ds.config (load, validate, resolve "auto", contradictions) and of the strategy's
config wiring that runs without processes (explicit arguments, optimizer sources, ZeRO-Offload's CPU Adam)."""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_gaudi_ds import config as dsc
from lightning_gaudi_ds._compat import deepspeed_reads_config_key, deepspeed_removed_config_keys
from lightning_gaudi_ds.config import AUTO, AutoContext, ConfigError, load_config, resolve_config, validate_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"
SEED = {  # the seed's ZeRO-2 example, verbatim
    "steps_per_print": 64,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_scatter": False, "contiguous_gradients": False},
}
HP = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-7, "weight_decay": 0.1, "warmup_steps": 5}
ALL_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")},
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "allgather_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "overlap_comm": "auto",
        "reduce_scatter": "auto",
        "contiguous_gradients": "auto",
        "use_multi_rank_bucket_allreduce": "auto",
        "zero_hpz_partition_size": "auto",
    },
}


def ctx(**kwargs: Any) -> AutoContext:
    base: dict[str, Any] = dict(world_size=2, micro_batch_size=8, precision="bf16-mixed", hidden_size=64,
                                devices_per_node=2)
    base.update(kwargs)
    return AutoContext(**base)


def problems(err: pytest.ExceptionInfo) -> list[str]:
    return [line[4:] for line in str(err.value).splitlines() if line.startswith("  - ")]


# ----------------------------------------------------------------------------------------------- load
class TestLoad:
    def test_path_and_dict(self, tmp_path: Path) -> None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(SEED))
        assert load_config(path, environ={}) == (SEED, str(path))
        assert load_config(str(path), environ={})[0] == SEED
        loaded, source = load_config(SEED, environ={})
        assert (loaded, source) == (SEED, "dict")
        loaded["zero_optimization"]["stage"] = 3
        assert SEED["zero_optimization"]["stage"] == 2  # a deep copy: the user's dict is never modified

    def test_env_var(self, tmp_path: Path) -> None:
        path = tmp_path / "env.json"
        path.write_text(json.dumps(SEED))
        env = {dsc.ENV_VAR: str(path)}
        assert load_config(None, environ=env) == (SEED, f"${dsc.ENV_VAR}={path}")
        assert load_config({"a": 1}, environ=env)[0] == {"a": 1}  # an explicit config wins over the variable
        assert load_config(None, environ={}) == (None, None)

    def test_missing_path(self, tmp_path: Path) -> None:
        # FileNotFoundError as before, and Lightning's MisconfigurationException with Lightning's wording
        with pytest.raises(FileNotFoundError, match=r"the path does not exist: '.*nope\.json'") as err:
            load_config(tmp_path / "nope.json", environ={})
        assert isinstance(err.value, MisconfigurationException) and isinstance(err.value, ConfigError)
        with pytest.raises(FileNotFoundError, match=rf"\(from \${dsc.ENV_VAR}=.*gone\.json\).*unset {dsc.ENV_VAR}"):
            load_config(None, environ={dsc.ENV_VAR: str(tmp_path / "gone.json")})

    def test_invalid_json_names_file_line_column(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.json"
        path.write_text('{\n  "train_batch_size": 16,\n  "bf16": {"enabled": true,}\n}\n')
        with pytest.raises(ConfigError, match=r"bad\.json' is not valid JSON: .* at line 3, column 28"):
            load_config(path, environ={})

    def test_duplicate_key_and_non_object(self, tmp_path: Path) -> None:
        path = tmp_path / "dup.json"
        path.write_text('{"train_batch_size": 16, "train_batch_size": 32}')
        with pytest.raises(ConfigError, match="sets key 'train_batch_size' twice"):
            load_config(path, environ={})
        path.write_text("[1, 2]")
        with pytest.raises(ConfigError, match="must hold a JSON object, not list"):
            load_config(path, environ={})
        with pytest.raises(ConfigError, match="expected a JSON file path or a dict, got int"):
            load_config(3, environ={})  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- validate
class TestValidate:
    @pytest.mark.parametrize("name", ["zero1_bf16", "zero2_bf16", "zero3_bf16", "zero2_offload_bf16", "zero3_offload_bf16"])
    def test_shipped_configs_are_valid(self, name: str) -> None:
        loaded, _ = load_config(EXAMPLES / f"{name}.json", environ={})
        validate_config(loaded)
        assert loaded["bf16"] == {"enabled": True}
        assert loaded["zero_optimization"]["stage"] == int(name[4])

    def test_seed_config_ships_verbatim(self) -> None:
        assert json.loads((EXAMPLES / "zero2_bf16.json").read_text()) == SEED
        validate_config(SEED)
        validate_config(ALL_AUTO)

    def test_misspelled_keys_name_the_closest(self) -> None:
        with pytest.raises(ConfigError) as err:
            validate_config({"zero_optimisation": {"stage": 2}, "zero_optimization": {"reduce_buket_size": 5}})
        assert problems(err) == [
            "zero_optimisation: not a DeepSpeed config key. Did you mean 'zero_optimization'?",
            "zero_optimization.reduce_buket_size: not a DeepSpeed config key. Did you mean"
            " 'zero_optimization.reduce_bucket_size'?",
        ]

    def test_unknown_key_without_close_match(self) -> None:
        with pytest.raises(ConfigError, match=r"qqq: not a DeepSpeed config key\. Check the name"):
            validate_config({"qqq": 1})

    @pytest.mark.skipif(not deepspeed_removed_config_keys()[0],
                        reason="DeepSpeed 0.16 (Habana's fork) still reads 'amp' (Apex AMP); later releases removed it")
    def test_removed_key_quotes_deepspeed(self) -> None:
        with pytest.raises(ConfigError, match=r"amp: removed from DeepSpeed\. NVIDIA Apex AMP"):
            validate_config({"amp": {"enabled": True}})

    @pytest.mark.parametrize("stage", [4, -1, True, "2", 2.5])
    def test_stage_outside_0_to_3(self, stage: Any) -> None:
        with pytest.raises(ConfigError, match=rf"zero_optimization\.stage: {re.escape(repr(stage))} is not a ZeRO stage\."
                                              r" Allowed: 0, 1, 2, 3"):
            validate_config({"zero_optimization": {"stage": stage}})

    def test_bf16_and_fp16_both_enabled(self) -> None:
        with pytest.raises(ConfigError, match=r"bf16\.enabled and fp16\.enabled: both are true.*Set both to \"auto\""):
            validate_config({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
        validate_config({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}})  # the Trainer picks one

    def test_auto_where_deepspeed_cannot_take_it(self) -> None:
        bad = {
            "steps_per_print": "auto",
            "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}},
            "optimizer": {"type": "AdamW", "params": {"betas": ["auto", 0.999]}},
        }
        with pytest.raises(ConfigError) as err:
            validate_config(bad, "x.json")
        msg = str(err.value)
        assert msg.startswith("DeepSpeed config (x.json) is invalid: 4 problems:")
        for key in ("steps_per_print", "zero_optimization.stage", "zero_optimization.offload_optimizer.device",
                    "optimizer.params.betas[0]"):
            assert f'  - {key}: "auto" is not accepted here' in msg
        assert msg.splitlines()[-1].startswith('Keys that may be "auto": train_micro_batch_size_per_gpu, ')

    def test_every_problem_in_one_error(self) -> None:
        bad = {"zero_optimisation": {}, "bf16": {"enabled": True}, "fp16": {"enabled": True},
               "zero_optimization": {"stage": 7}, "wall_clock_breakdown": "auto"}
        with pytest.raises(ConfigError) as err:
            validate_config(bad)
        assert len(problems(err)) == 4

    def test_known_keys_come_from_deepspeed(self) -> None:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        top, zero = dsc.known_keys()
        assert {"zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "train_batch_size", "gradient_clipping",
                "activation_checkpointing", "aio", "flops_profiler", "tensorboard", "steps_per_print"} <= top
        assert set(DeepSpeedZeroConfig.model_fields) <= zero
        assert {"stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "offload_optimizer"} <= zero
        import deepspeed

        source = "".join(
            p.read_text() for p in Path(deepspeed.__file__).parent.rglob("*.py") if "config" in p.name or "compile" in str(p)
        )
        for key in dsc.INLINE_KEYS - dsc.READ_BY_THE_PACKAGE:  # read by this DeepSpeed, or refused
            if deepspeed_reads_config_key(key):
                assert f"'{key}'" in source or f'"{key}"' in source, key
            else:
                with pytest.raises(ConfigError, match=rf"{key}: DeepSpeed .* does not read this key"):
                    validate_config({key: 1})

    def test_keys_this_deepspeed_ignores_are_refused(self) -> None:
        import deepspeed

        unread = [k for k in sorted(dsc.INLINE_KEYS) if not deepspeed_reads_config_key(k)]
        if deepspeed.__version__.startswith("0.16"):
            assert "sequence_parallel_size" in unread  # 0.16.1 parses no sequence parallelism from the config
        validate_config({"sequence_parallel_size": 2})  # the strategy reads it (lightning_gaudi_ds.sequence)
        for key in set(unread) - dsc.READ_BY_THE_PACKAGE:
            with pytest.raises(ConfigError, match=rf"{key}: DeepSpeed {re.escape(deepspeed.__version__)} does not"):
                validate_config({key: 2})

    def test_auto_keys_are_config_keys(self) -> None:
        top, zero = dsc.known_keys()
        for key in dsc.AUTO_KEYS:
            head, _, rest = key.partition(".")
            assert head in top
            if head == "zero_optimization":
                assert rest in zero


# -------------------------------------------------------------------------------------------- resolve
class TestResolve:
    def test_seed_config(self) -> None:
        out = resolve_config(SEED, ctx(micro_batch_size=16))
        assert out.config == {**SEED, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 16,
                              "gradient_accumulation_steps": 1}
        assert "train_batch_size = 32 (micro batch 16 x accumulation 1 x world size 2)" in out.filled
        assert SEED["train_batch_size"] == "auto"  # input untouched

    def test_every_auto_key(self) -> None:
        from lightning_gaudi_ds.devices import DEVICES

        out = resolve_config(ALL_AUTO, ctx(accumulate_grad_batches=4, gradient_clip_val=0.5, hparams=HP,
                                           total_steps=100, hidden_size=64, device_type="cpu",
                                           zero_defaults=DEVICES["cpu"].zero_defaults, devices_per_node=4))
        c = out.config
        assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (8, 4, 64)
        assert c["gradient_clipping"] == 0.5
        assert c["bf16"] == {"enabled": True} and c["fp16"] == {"enabled": False}
        assert c["optimizer"]["params"] == {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-7, "weight_decay": 0.1}
        assert c["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5,
                                            "total_num_steps": 100}
        z = c["zero_optimization"]
        assert (z["reduce_bucket_size"], z["allgather_bucket_size"]) == (4096, 4096)
        assert (z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (3686, 640)
        assert (z["overlap_comm"], z["contiguous_gradients"]) == (False, True)  # ZeRO-3 on CPU
        assert "reduce_scatter" not in z and "use_multi_rank_bucket_allreduce" not in z  # DeepSpeed's default
        assert z["zero_hpz_partition_size"] == 4  # hpZ: the devices of one node
        assert list(dsc.iter_auto(c)) == []
        assert len(out.filled) == len(dsc.AUTO_KEYS)
        assert "optimizer.params.betas = [0.9, 0.99] (hparam betas)" in out.filled
        assert "zero_optimization.reduce_bucket_size = 4096 (model hidden size 64)" in out.filled

    @pytest.mark.parametrize(
        ("precision", "bf16", "fp16"),
        [("bf16-mixed", True, False), ("bf16-true", True, False), ("16-mixed", False, True), ("32-true", False, False)],
    )
    def test_precision_blocks(self, precision: str, bf16: bool, fp16: bool) -> None:
        c = resolve_config({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, ctx(precision=precision)).config
        assert (c["bf16"]["enabled"], c["fp16"]["enabled"]) == (bf16, fp16)
        absent = resolve_config({}, ctx(precision=precision)).config
        assert absent.get("bf16", {}).get("enabled", False) is bf16  # added only where the Trainer needs it
        assert absent.get("fp16", {}).get("enabled", False) is fp16

    @pytest.mark.parametrize("block", ["bf16", "fp16"])
    def test_a_config_block_enabled_under_a_32_bit_trainer_wins_as_in_lightning(self, block: str) -> None:
        with pytest.warns(UserWarning, match=rf"^{block}.enabled: the config has true and wins over Trainer\(precision="
                          rf"'32-true'\), as in Lightning's DeepSpeedStrategy: DeepSpeed trains in {block} and"):
            c = resolve_config({block: {"enabled": True}}, ctx(precision="32-true"), "ds.json").config
        assert c[block]["enabled"] is True
        with pytest.raises(ConfigError, match="bf16.enabled: the config has true"):  # 16-mixed: still refused
            resolve_config({"bf16": {"enabled": True}}, ctx(precision="16-mixed"))

    def test_bfloat16_alias_block(self) -> None:
        c = resolve_config({"bfloat16": {"enabled": "auto"}}, ctx()).config
        assert c["bfloat16"] == {"enabled": True} and "bf16" not in c

    def test_keys_the_config_leaves_out_come_from_the_trainer(self) -> None:
        c = resolve_config({"zero_optimization": {"stage": 1}}, ctx(accumulate_grad_batches=3)).config
        assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["gradient_clipping"]) == (8, 3, 0.0)
        assert "train_batch_size" not in c  # DeepSpeed derives it

    def test_micro_batch_from_train_batch_size_without_loader(self) -> None:
        c = resolve_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"},
                           ctx(micro_batch_size=None, accumulate_grad_batches=2)).config
        assert c["train_micro_batch_size_per_gpu"] == 8

    def test_micro_batch_without_source(self) -> None:
        with pytest.raises(ConfigError) as err:
            resolve_config({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}, ctx(micro_batch_size=None))
        assert problems(err) == [
            'train_micro_batch_size_per_gpu: "auto" has no source: the train DataLoader has no single batch_size'
            " (a batch_sampler without one, several loaders, or no loader). Set it in the config.",
            'train_batch_size: "auto" needs train_micro_batch_size_per_gpu; set one of them.',
        ]
        # validate/test/predict: no train loader; DeepSpeed only needs a number for its bookkeeping (as Lightning)
        c = resolve_config({"train_micro_batch_size_per_gpu": "auto"}, ctx(micro_batch_size=None, fitting=False)).config
        assert c["train_micro_batch_size_per_gpu"] == 1
        # left out of the config, with no loader batch size: 1, as Lightning
        assert resolve_config({}, ctx(micro_batch_size=None)).config["train_micro_batch_size_per_gpu"] == 1

    def test_hparam_aliases(self) -> None:
        hp = {"learning_rate": 3e-4, "adam_beta1": 0.8, "adam_beta2": 0.9, "adam_epsilon": 1e-6, "weight_decay": 0.0,
              "warmup_ratio": 0.1, "warmup_min_lr": 1e-5}
        c = resolve_config(ALL_AUTO, ctx(hparams=hp, total_steps=95)).config
        assert c["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.0}
        assert c["scheduler"]["params"] == {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
                                            "total_num_steps": 95}

    def test_optimizer_and_scheduler_autos_without_source(self) -> None:
        with pytest.raises(ConfigError) as err:
            resolve_config(ALL_AUTO, ctx(hparams={}, total_steps=None))
        assert problems(err) == [
            'optimizer.params.lr: "auto" has no source; save `lr` with self.save_hyperparameters(), or set a number'
            " in the config.",
            'optimizer.params.betas: "auto" has no source; save `betas` (or `adam_beta1` and `adam_beta2`) with'
            " self.save_hyperparameters(), or set a number in the config.",
            'optimizer.params.eps: "auto" has no source; save `eps` (or `adam_epsilon`) with'
            " self.save_hyperparameters(), or set a number in the config.",
            'optimizer.params.weight_decay: "auto" has no source; save `weight_decay` with'
            " self.save_hyperparameters(), or set a number in the config.",
            'scheduler.params.warmup_max_lr: "auto" has no source; save `lr` with self.save_hyperparameters(), or'
            " set a number in the config.",
            'scheduler.params.warmup_num_steps: "auto" has no source; save `warmup_steps` (or `warmup_ratio`) with'
            " self.save_hyperparameters(), or set a number in the config.",
            'scheduler.params.total_num_steps: "auto" has no source; set Trainer(max_steps=...) or use a sized train'
            " DataLoader, or set a number in the config.",
        ]

    def test_bucket_autos_without_hidden_size(self) -> None:
        with pytest.raises(ConfigError) as err:
            resolve_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, ctx(hidden_size=None))
        assert problems(err) == [
            "zero_optimization.reduce_bucket_size: \"auto\" needs the model's hidden size, and the model has no 2-D"
            " parameter yet (built in configure_model?). Add `hidden_size` to the module's hyperparameters or set a"
            " number."
        ]

    def test_explicit_values_are_never_overwritten(self) -> None:
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "train_batch_size": 16,
                  "gradient_clipping": 0.25, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 123}}
        out = resolve_config(config, ctx())
        assert out.config == config and out.filled == ()

    def test_all_contradictions_in_one_error(self) -> None:
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "train_batch_size": 100,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": False},
            "fp16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        }
        with pytest.raises(ConfigError) as err:
            resolve_config(config, ctx(gradient_clip_val=0.5, hparams={"lr": 0.01},
                                       strategy_args={"stage": 3, "offload_optimizer": False}), "ds.json")
        assert str(err.value).startswith("DeepSpeed config (ds.json) does not fit this Trainer: 9 problems:")
        assert problems(err) == [
            'bf16.enabled: the config has false, Trainer(precision=\'bf16-mixed\') gives true; set it to "auto" (the'
            " Trainer decides) or pass Trainer(precision='32-true'). Lightning's DeepSpeedStrategy would silently"
            " train in the config's precision; HPUDeepSpeedStrategy refuses instead.",
            'fp16.enabled: the config has true, Trainer(precision=\'bf16-mixed\') gives false; set it to "auto" (the'
            " Trainer decides) or pass Trainer(precision='16-mixed'). Lightning's DeepSpeedStrategy would silently"
            " train in the config's precision; HPUDeepSpeedStrategy refuses instead.",
            "zero_optimization.stage: the config has 2, HPUDeepSpeedStrategy(stage=3) gives 3; remove the key or the"
            " argument",
            'zero_optimization.offload_optimizer.device: the config has "cpu", HPUDeepSpeedStrategy(offload_optimizer='
            'False) gives "none"; remove the key or the argument',
            'gradient_accumulation_steps: the config has 2, Trainer(accumulate_grad_batches=1) gives 1; set it to "auto"',
            "train_micro_batch_size_per_gpu: the config has 4, the train DataLoader's batch_size gives 8; set it to"
            ' "auto"',
            "train_batch_size: the config has 100, micro batch 4 x accumulation 1 x world size 2 gives 8; set it to"
            ' "auto"',
            'gradient_clipping: the config has 1.0, Trainer(gradient_clip_val=0.5) gives 0.5; set it to "auto"',
            'optimizer.params.lr: the config has 0.5, hparam lr gives 0.01; set it to "auto"',
        ]

    def test_unset_trainer_clip_does_not_contradict(self) -> None:
        assert resolve_config(SEED, ctx(gradient_clip_val=None)).config["gradient_clipping"] == 1.0

    def test_strategy_arguments_fill_what_the_config_leaves_out(self) -> None:
        args = {"stage": 3, "offload_optimizer": True, "offload_parameters": True, "offload_params_device": "nvme",
                "reduce_bucket_size": 500, "overlap_comm": False, "loss_scale": 128.0}
        config = {"zero_optimization": {"reduce_bucket_size": "auto"}}
        out = resolve_config(config, ctx(strategy_args=args))
        assert out.config["zero_optimization"] == {
            "stage": 3, "reduce_bucket_size": 500, "overlap_comm": False,
            "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"},
        }
        assert "fp16" not in out.config  # bf16 training: the fp16 loss-scale argument does not apply
        assert "zero_optimization.reduce_bucket_size = 500 (HPUDeepSpeedStrategy(reduce_bucket_size=500))" in out.filled
        args_off = {"offload_optimizer": False}
        assert "offload_optimizer" not in resolve_config({}, ctx(strategy_args=args_off)).config.get("zero_optimization", {})
        with pytest.raises(ConfigError, match=r"reduce_bucket_size: the config has 7, HPUDeepSpeedStrategy\("
                                              r"reduce_bucket_size=500\) gives 500; set it to \"auto\""):
            resolve_config({"zero_optimization": {"reduce_bucket_size": 7}}, ctx(strategy_args=args))

    def test_fp16_loss_scale_arguments(self) -> None:
        out = resolve_config({"fp16": {"enabled": "auto"}}, ctx(precision="16-mixed", strategy_args={"loss_scale": 64}))
        assert out.config["fp16"] == {"enabled": True, "loss_scale": 64}


# ------------------------------------------------------------------------------------- model buckets
class TestModelSizes:
    def test_bucket_rule(self) -> None:
        assert dsc.bucket_sizes(1024) == {
            "zero_optimization.reduce_bucket_size": 1024**2,
            "zero_optimization.allgather_bucket_size": 1024**2,
            "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 1024**2),
            "zero_optimization.stage3_param_persistence_threshold": 10240,
        }

    def test_buckets_of_an_odd_hidden_size_are_even(self) -> None:
        # DeepSpeed's ZeRO 1-2 optimizer asserts allgather_bucket_size % 2 == 0 (nn.Linear(8, 1): hidden size 1).
        sizes = dsc.bucket_sizes(1)
        assert sizes["zero_optimization.allgather_bucket_size"] == sizes["zero_optimization.reduce_bucket_size"] == 2
        assert dsc.bucket_sizes(3)["zero_optimization.allgather_bucket_size"] == 10

    def test_hidden_from_largest_2d_parameter(self) -> None:
        lm = nn.Sequential(nn.Embedding(1000, 48), nn.Linear(48, 192), nn.Linear(192, 48))
        assert dsc.hidden_size(lm) == 48  # the embedding (1000 x 48) is largest: its smaller side is d_model
        assert dsc.hidden_size(nn.Sequential(nn.Linear(32, 512), nn.Linear(512, 512))) == 512
        assert dsc.hidden_size(nn.Sequential(nn.LayerNorm(8))) is None

    def test_hidden_from_config_and_hparams(self) -> None:
        class HFLike(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.config = type("Cfg", (), {"hidden_size": 768})()
                self.proj = nn.Linear(10, 10)

        wrapper = nn.Sequential(HFLike())
        assert dsc.hidden_size(wrapper) == 768
        module = nn.Linear(4, 4)
        module.hparams = {"hidden_size": 256}  # type: ignore[assignment]
        assert dsc.hidden_size(module) == 256

    def test_hidden_of_zero3_partitioned_parameters(self) -> None:
        module = nn.Linear(64, 32)
        module.weight.ds_shape = torch.Size([32, 64])  # type: ignore[attr-defined]
        module.weight.data = torch.empty(0)
        assert dsc.hidden_size(module) == 32

    def test_bucket_hints_for_configs_that_leave_buckets_out(self) -> None:
        hints = dsc.bucket_hints(SEED, 64)  # the seed sets no bucket size: DeepSpeed's 5e8 applies
        assert hints == [
            "zero_optimization.reduce_bucket_size is left to DeepSpeed's default of 500,000,000 elements; \"auto\""
            " would size it from the model (hidden size 64): 4,096",
            "zero_optimization.allgather_bucket_size is left to DeepSpeed's default of 500,000,000 elements; \"auto\""
            " would size it from the model (hidden size 64): 4,096",
        ]
        assert dsc.bucket_hints({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5}}, 64) == [
            "zero_optimization.stage3_prefetch_bucket_size is left to DeepSpeed's default of 50,000,000 elements;"
            ' "auto" would size it from the model (hidden size 64): 3,686'
        ]
        assert dsc.bucket_hints(SEED, 32768) == []  # a model that large wants buckets of that order anyway
        assert dsc.bucket_hints(SEED, None) == [] and dsc.bucket_hints({"zero_optimization": {"stage": 0}}, 64) == []

    def test_mark_model_buckets(self) -> None:
        default = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8, "allgather_bucket_size": 2e8}}
        assert dsc.mark_model_buckets(default, {})["zero_optimization"] == {
            "stage": 2, "reduce_bucket_size": AUTO, "allgather_bucket_size": AUTO}
        kept = dsc.mark_model_buckets(default, {"reduce_bucket_size": 2e8})["zero_optimization"]
        assert kept["reduce_bucket_size"] == 2e8 and kept["allgather_bucket_size"] == AUTO
        stage3 = dsc.mark_model_buckets({"zero_optimization": {"stage": 3}}, {})["zero_optimization"]
        assert stage3 == {"stage": 3, "reduce_bucket_size": AUTO, "stage3_prefetch_bucket_size": AUTO,
                          "stage3_param_persistence_threshold": AUTO}
        assert default["zero_optimization"]["reduce_bucket_size"] == 2e8


# ----------------------------------------------------------------------- strategy wiring, no processes
def _strategy(**kwargs: Any) -> Any:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    return HPUDeepSpeedStrategy(**kwargs)


class TestStrategyWiring:
    def test_bad_config_fails_at_construction(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.json"
        path.write_text('{"zero_optimisation": {"stage": 2}}')
        with pytest.raises(ConfigError, match="Did you mean 'zero_optimization'"):
            _strategy(config=str(path))

    def test_env_var_and_loaded_copy(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = tmp_path / "env.json"
        path.write_text(json.dumps(SEED))
        monkeypatch.setenv(dsc.ENV_VAR, str(path))
        strategy = _strategy()
        assert strategy.config == SEED and strategy._resolver.source == f"${dsc.ENV_VAR}={path}"
        user = copy.deepcopy(SEED)
        assert _strategy(config=user).config is not user

    def test_explicit_arguments_are_recorded(self) -> None:
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_gaudi_ds  # noqa: F401  (registers the names)

        assert _strategy(config=SEED)._resolver.explicit_args == {"config": SEED}
        assert _strategy(stage=3, offload_optimizer=True, reduce_bucket_size=5)._resolver.explicit_args == {
            "stage": 3, "offload_optimizer": True, "reduce_bucket_size": 5}
        from lightning_gaudi_ds import HPUDeepSpeedStrategy

        assert HPUDeepSpeedStrategy(1)._resolver.explicit_args == {"stage": 1}
        named = StrategyRegistry.get("hpu_deepspeed_stage_2_offload")
        assert named._resolver.explicit_args == {"offload_optimizer": True}  # stage=2 is the default
        # LightningCLI passes every argument, defaults included: only values that differ from a default count
        import inspect

        from lightning.pytorch.strategies import DeepSpeedStrategy

        everything = {name: p.default for cls in (DeepSpeedStrategy, HPUDeepSpeedStrategy)
                      for name, p in inspect.signature(cls.__init__).parameters.items()
                      if p.default is not inspect.Parameter.empty}
        everything["stage"] = 3
        assert HPUDeepSpeedStrategy(**everything)._resolver.explicit_args == {"stage": 3}
        assert copy.deepcopy(named)._resolver.explicit_args == named._resolver.explicit_args

    def test_offload_turned_off_with_false_is_accepted_as_lightning_does(self) -> None:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from lightning.fabric import Fabric

        from lightning_gaudi_ds.fabric import HPUDeepSpeedStrategy as FabricStrategy

        config = {"train_micro_batch_size_per_gpu": 1,
                  "zero_optimization": {"stage": 2, "offload_optimizer": False}}
        fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricStrategy(config=copy.deepcopy(config)))
        for strategy in (_strategy(config=copy.deepcopy(config)), fabric.strategy):
            assert strategy.config["zero_optimization"]["offload_optimizer"] is False  # kept, as Lightning keeps it
        resolved = fabric.strategy._resolve_config(None, "32-true")  # what DeepSpeed gets
        assert "offload_optimizer" not in resolved["zero_optimization"] and not dsc.offloads_optimizer(resolved)
        assert DeepSpeedZeroConfig(**resolved["zero_optimization"]).offload_optimizer is None  # DeepSpeed takes it
        with pytest.raises(ConfigError, match="offload_optimizer: true is not valid"):  # `true` names no device
            _strategy(config={"zero_optimization": {"stage": 2, "offload_optimizer": True}})

    def test_default_config_is_lightning_s(self) -> None:
        strategy = _strategy(stage=3)
        assert strategy._resolver.source is None
        assert strategy.config["zero_optimization"]["stage"] == 3
        assert strategy.config["zero_optimization"]["reduce_bucket_size"] == 200_000_000  # sized from the model at setup


def _wired(config: dict[str, Any], returned: str) -> Any:
    import lightning as L

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def configure_optimizers(self) -> Any:
            if returned == "none":
                return None
            if returned == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1)
            opt = torch.optim.AdamW(self.parameters(), lr=0.1)
            if returned == "adamw+sched":
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}
            return opt

    strategy = _strategy(config=config)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    model = Model()
    model.trainer = trainer
    strategy.connect(model)
    return strategy


class TestOptimizerSources:
    def test_config_optimizer_when_module_returns_none(self) -> None:
        strategy = _wired({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, "none")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Lightning's "returned None ... no optimizer" warning is not shown
            assert strategy._client_optimizer_and_scheduler() == (None, None)

    def test_both_optimizers_the_configs_wins_as_in_lightning_and_says_so(self) -> None:
        strategy = _wired({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}, "adamw+sched")
        with pytest.warns(UserWarning) as record:
            assert strategy._client_optimizer_and_scheduler() == (None, None)  # DeepSpeed builds both from the config
        assert [str(w.message) for w in record] == [
            "The DeepSpeed config's `optimizer` section (AdamW) wins over the AdamW, StepLR that configure_optimizers"
            " returned, which is ignored (as by Lightning's DeepSpeedStrategy); the scheduler is the config's"
            " (WarmupLR). Remove the section to train with configure_optimizers'."
        ]
        scheduler_only = _wired({"scheduler": {"type": "WarmupLR"}}, "adamw+sched")
        with pytest.warns(UserWarning, match=r"^configure_optimizers' StepLR wins over the DeepSpeed config's"
                                             r" `scheduler` section \(WarmupLR\), which is ignored"):
            optimizer, scheduler_config = scheduler_only._client_optimizer_and_scheduler()
        assert isinstance(optimizer, torch.optim.AdamW)  # DeepSpeed prefers the scheduler it is given, as here
        assert isinstance(scheduler_config.scheduler, torch.optim.lr_scheduler.StepLR)

    def test_under_fabric_the_optimizer_given_to_setup_wins_as_in_lightnings_fabric(self) -> None:
        from lightning_gaudi_ds.engine.train import optimizer_sources

        given = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        with pytest.warns(UserWarning, match=r"^The SGD given to fabric.setup wins over the DeepSpeed config's"
                                             r" `optimizer` section \(AdamW\), which is ignored"):
            assert optimizer_sources({"optimizer": {"type": "AdamW"}}, given, None, fabric=True) == (given, None)

    def test_no_optimizer_anywhere(self) -> None:
        strategy = _wired({}, "none")
        with pytest.raises(ValueError, match="configure_optimizers returned None and the DeepSpeed config has no"
                                             " `optimizer` section"):
            strategy._client_optimizer_and_scheduler()

    def test_offload_refuses_other_optimizers(self) -> None:
        strategy = _wired({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "sgd")
        with pytest.raises(ValueError, match=r"returned SGD, which DeepSpeed refuses with offload\. Return"
                                             r" torch\.optim\.AdamW or torch\.optim\.Adam \(converted for you\)"):
            strategy._client_optimizer_and_scheduler()

    def test_offload_converts_adamw(self) -> None:
        strategy = _wired({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "adamw+sched")
        optimizer, scheduler_config = strategy._client_optimizer_and_scheduler()
        assert type(optimizer).__name__ == "DeepSpeedCPUAdam" and optimizer.adam_w_mode
        assert scheduler_config.scheduler.optimizer is optimizer

    def test_cpu_fuses_adamw_left_to_torch_and_says_so(self) -> None:
        strategy = _wired({"zero_optimization": {"stage": 2}}, "adamw+sched")
        filled: list[str] = []
        strategy._resolver.add_filled = filled.append
        optimizer, scheduler_config = strategy._client_optimizer_and_scheduler()
        assert isinstance(optimizer, torch.optim.AdamW)
        assert [g["fused"] for g in optimizer.param_groups] == [True] and optimizer.defaults["fused"] is True
        assert scheduler_config.scheduler.optimizer is optimizer
        assert len(filled) == 1 and filled[0].startswith("optimizer: AdamW(fused=True) from configure_optimizers"
                                                         " (cpu default: torch's fused CPU kernel")

    def test_offload_is_not_fused(self) -> None:
        strategy = _wired({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "adamw")
        filled: list[str] = []
        strategy._resolver.add_filled = filled.append
        optimizer, _ = strategy._client_optimizer_and_scheduler()
        assert type(optimizer).__name__ == "DeepSpeedCPUAdam" and filled == []

    def test_offload_keeps_torch_optimizer_when_asked(self) -> None:
        config = {"zero_force_ds_cpu_optimizer": False,
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        optimizer, _ = _wired(config, "sgd")._client_optimizer_and_scheduler()
        assert isinstance(optimizer, torch.optim.SGD)


# --------------------------------------------------------------------------------- torch's fused kernel on CPU
class TestFuseOnCpu:
    def _adamw(self, **kwargs: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": nn.Linear(4, 4).parameters()},
                                  {"params": nn.Linear(4, 2).parameters(), "lr": 0.5}], lr=0.1, **kwargs)

    @pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
    def test_left_to_torch_is_fused_and_steps_as_torch_would(self, cls: type) -> None:
        from lightning_gaudi_ds.engine.train import fuse_on_cpu

        torch.manual_seed(0)
        model = nn.Linear(8, 8)
        reference = copy.deepcopy(model)
        fused, plain = cls(model.parameters(), lr=0.1, weight_decay=0.1), cls(reference.parameters(), lr=0.1,
                                                                              weight_decay=0.1)
        line = fuse_on_cpu(fused, "cpu")
        assert line is not None and line.startswith(f"optimizer: {cls.__name__}(fused=True) from configure_optimizers")
        assert fused.param_groups[0]["fused"] is True and plain.param_groups[0]["fused"] is None
        for _ in range(3):
            for m in (model, reference):
                m.zero_grad()
                m(torch.ones(2, 8)).square().sum().backward()
            fused.step()
            plain.step()
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the same update rule

    @pytest.mark.parametrize("kwargs", [{"fused": False}, {"foreach": True}, {"foreach": False},
                                        {"differentiable": True}, {"capturable": True}])
    def test_a_choice_made_is_kept(self, kwargs: dict[str, Any]) -> None:
        from lightning_gaudi_ds.engine.train import fuse_on_cpu

        optimizer = self._adamw(**kwargs)
        before = [dict((k, v) for k, v in g.items() if k != "params") for g in optimizer.param_groups]
        assert fuse_on_cpu(optimizer, "cpu") is None
        assert [dict((k, v) for k, v in g.items() if k != "params") for g in optimizer.param_groups] == before

    @pytest.mark.parametrize("device_type", ["hpu", "cuda", None])
    def test_only_on_the_cpu_device(self, device_type: str | None) -> None:
        from lightning_gaudi_ds.engine.train import fuse_on_cpu

        optimizer = self._adamw()
        assert fuse_on_cpu(optimizer, device_type) is None
        assert [g["fused"] for g in optimizer.param_groups] == [None, None]

    def test_other_optimizers_and_subclasses_are_left_alone(self) -> None:
        from lightning_gaudi_ds.engine.train import fuse_on_cpu

        class MyAdamW(torch.optim.AdamW):
            pass

        params = list(nn.Linear(4, 4).parameters())
        assert fuse_on_cpu(torch.optim.SGD(params, lr=0.1), "cpu") is None
        assert fuse_on_cpu(MyAdamW(params, lr=0.1), "cpu") is None
        assert fuse_on_cpu(None, "cpu") is None


# --------------------------------------------------------------------------------- CPU Adam conversion
class TestCpuAdam:
    def _groups(self) -> list[dict[str, Any]]:
        a, b = nn.Linear(4, 4), nn.Linear(4, 2)
        return [{"params": a.parameters()}, {"params": b.parameters(), "lr": 0.5, "weight_decay": 0.0}]

    @pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
    def test_same_groups_and_hyperparameters(self, cls: type) -> None:
        from lightning_gaudi_ds.engine.train import to_cpu_adam

        torch_opt = cls(self._groups(), lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
        cpu = to_cpu_adam(torch_opt)
        assert type(cpu).__name__ == "DeepSpeedCPUAdam"
        assert cpu.adam_w_mode is (cls is torch.optim.AdamW)  # AdamW: decoupled decay; Adam: L2 penalty
        for old, new in zip(torch_opt.param_groups, cpu.param_groups):
            assert new is old  # the same dicts: a scheduler built on the torch optimizer keeps working
        assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in cpu.param_groups] == [
            (0.01, (0.8, 0.9), 1e-6, 0.05), (0.5, (0.8, 0.9), 1e-6, 0.0)]

    def test_cpu_vendor_asked_once_per_process(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """DeepSpeedCPUAdam asks py-cpuinfo for the vendor on every construction, a subprocess each time (1.4 s):
        asked once, and py-cpuinfo is left as it was."""
        import cpuinfo

        from lightning_gaudi_ds.engine import train

        calls: list[int] = []

        def probe() -> dict[str, str]:
            calls.append(1)
            return {"vendor_id_raw": "AuthenticAMD"}

        from deepspeed.ops.adam import cpu_adam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        # the op loaded first (the set-up's build), as the real py-cpuinfo sees this machine (a first load asks for arch
        # and flags): the probe then counts the optimizer's own question, whichever test of this process came before
        with train.op_cache():
            CPUAdamBuilder().load()
        monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
        if hasattr(cpu_adam, "get_cpu_info"):  # DeepSpeed 0.16 imports it at the top of its module
            monkeypatch.setattr(cpu_adam, "get_cpu_info", probe)
        monkeypatch.setattr(train, "_CPU_INFO", [])
        first = train.to_cpu_adam(torch.optim.AdamW(self._groups(), lr=0.1))
        second = train.to_cpu_adam(torch.optim.AdamW(self._groups(), lr=0.1))
        assert calls == [1] and first.cpu_vendor == second.cpu_vendor == "authenticamd"
        assert cpuinfo.get_cpu_info is probe and getattr(cpu_adam, "get_cpu_info", probe) is probe

    def test_op_loaded_from_this_environments_cache(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """DeepSpeedCPUAdam loads cpu_adam where the set-up built it (the environment's own op cache), not from
        torch's shared default, where another environment's DeepSpeed would make it rebuild (80 s on 2 cores)."""
        from deepspeed.ops.op_builder import CPUAdamBuilder

        from lightning_gaudi_ds.engine.train import to_cpu_adam
        from lightning_gaudi_ds.jit_ops.locks import extensions_root

        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        seen: list[str | None] = []
        load = CPUAdamBuilder.load

        def spy(builder: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(os.environ.get("TORCH_EXTENSIONS_DIR"))
            return load(builder, *args, **kwargs)

        monkeypatch.setattr(CPUAdamBuilder, "load", spy)
        to_cpu_adam(torch.optim.AdamW(self._groups(), lr=0.1))
        assert seen == [str(extensions_root())]
        assert "TORCH_EXTENSIONS_DIR" not in os.environ  # set for the load only

    def test_scheduler_follows_without_warning(self) -> None:
        from lightning_gaudi_ds.engine.train import to_cpu_adam

        torch_opt = torch.optim.AdamW(self._groups(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
        cpu = to_cpu_adam(torch_opt, sched)
        params = [p for g in cpu.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.ones_like(p)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cpu.step()
            sched.step()
        assert [g["lr"] for g in cpu.param_groups] == [0.05, 0.25]

    def test_unsupported_options(self) -> None:
        from lightning_gaudi_ds.engine.train import to_cpu_adam

        with pytest.raises(ValueError, match=r"DeepSpeedCPUAdam, which has no amsgrad; configure_optimizers returned"
                                             r" AdamW\(amsgrad=True\)"):
            to_cpu_adam(torch.optim.AdamW(nn.Linear(2, 2).parameters(), amsgrad=True))
        with pytest.raises(TypeError, match="SGD cannot be converted"):
            to_cpu_adam(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


# ------------------------------------------------------------------ re-resolution for a new Trainer
def test_config_is_resolved_again_for_a_new_trainer_even_when_ids_are_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An id is reused once its object is collected: resolution must be keyed on the Trainer itself. With every id
    made equal in the strategy's module (as a reused one would be), the second Trainer still gets its own values."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lightning_gaudi_ds.strategy as strategy_module

    monkeypatch.setattr(strategy_module, "id", lambda obj: 0, raising=False)
    strategy = _strategy(stage=1)
    model = BoringModel()
    for accumulate in (1, 3):
        strategy.accelerator = None  # set by the first Trainer; Lightning refuses it set twice
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, accumulate_grad_batches=accumulate,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)
        model.trainer = trainer
        strategy.connect(model)
        strategy._init_config_if_needed()
        assert strategy.config["gradient_accumulation_steps"] == accumulate
        strategy._init_config_if_needed()  # the same Trainer: nothing to do again
        assert strategy.config["gradient_accumulation_steps"] == accumulate
