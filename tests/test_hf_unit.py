"""lightning_gaudi_ds.hf and the Hugging Face export without processes: transformers' ZeRO-3 flag set and put back,
the export from a stage-0 checkpoint laid out as DeepSpeed writes it, bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_gaudi_ds.config import ConfigError

transformers = pytest.importorskip("transformers")


def _zero3_enabled() -> bool:
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def test_zero3_loading_tells_transformers_only_inside_and_puts_back_the_previous_config() -> None:
    pytest.importorskip("accelerate")
    from transformers.integrations import HfDeepSpeedConfig, deepspeed_config

    from lightning_gaudi_ds import _compat, hf

    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    assert not _zero3_enabled()
    with hf.zero3_loading(config):
        assert _zero3_enabled() and deepspeed_config()["zero_optimization"]["stage"] == 3
    assert not _zero3_enabled() and _compat.hf_deepspeed_config_ref() is None  # nothing left behind
    with hf.zero3_loading(None):  # another stage: nothing changes
        assert not _zero3_enabled()
    users = HfDeepSpeedConfig({"zero_optimization": {"stage": 2}})  # the user's own, kept alive by them
    try:
        with hf.zero3_loading(config):
            assert _zero3_enabled()
        ref = _compat.hf_deepspeed_config_ref()
        assert ref is not None and ref() is users and not _zero3_enabled()
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    with pytest.raises(RuntimeError, match="boom"), hf.zero3_loading(config):
        raise RuntimeError("boom")
    assert not _zero3_enabled()


def test_leaf_module_classes_are_checked_before_any_process_starts() -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    strategy = HPUDeepSpeedStrategy(stage=3, zero3_leaf_modules=["torch.nn.Linear", torch.nn.LayerNorm])
    assert strategy._leaf_modules == (torch.nn.Linear, torch.nn.LayerNorm)
    with pytest.raises(ConfigError, match=r"cannot import .*full import path"):
        HPUDeepSpeedStrategy(stage=3, zero3_leaf_modules=["no_such_package.Block"])
    with pytest.raises(ConfigError, match=r"<class 'int'> is not a torch.nn.Module subclass"):
        HPUDeepSpeedStrategy(stage=3, zero3_leaf_modules=[int])


def test_mark_leaf_modules_names_a_class_the_model_lacks() -> None:
    from lightning_gaudi_ds import hf

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="the model has no LayerNorm module"):
        hf.mark_leaf_modules(model, (torch.nn.LayerNorm,))
    hf.mark_leaf_modules(model, (torch.nn.Linear,))
    assert model[0]._z3_leaf is True


# ------------------------------------------------------------------------------------------------ export
class _Wrapper(torch.nn.Module):
    def __init__(self, model: Any, tokenizer: Any = None) -> None:
        super().__init__()
        self.model = model
        if tokenizer is not None:
            self.tokenizer = tokenizer


def _tiny_llama(tied: bool) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config).eval()


def _stage_0_checkpoint(root: Path, wrapper: torch.nn.Module, record: bool = True) -> Path:
    from lightning_gaudi_ds import hf
    from tests.test_checkpoint import fake_checkpoint

    path = fake_checkpoint(root, stage=0, world_size=1)
    states = path / "checkpoint" / "mp_rank_00_model_states.pt"
    state = torch.load(states, weights_only=False)
    state["module"] = wrapper.state_dict()
    if record:
        state[hf.HF_MODELS] = hf.model_info(wrapper)
    torch.save(state, states)
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_export_hf_loads_with_from_pretrained_and_equal_logits(tmp_path: Path, tied: bool) -> None:
    from lightning_gaudi_ds import export_hf
    from lightning_gaudi_ds.cli import main

    model = _tiny_llama(tied)
    ckpt = _stage_0_checkpoint(tmp_path, _Wrapper(model))
    ids = torch.arange(10)[None]
    out = export_hf(ckpt, tmp_path / "hf", max_shard_size="20KB")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert not (tmp_path / "hf.partial").exists()
    assert main(["convert", str(ckpt), str(out), "--to", "hf"]) == 2  # exists: --overwrite
    assert main(["convert", str(ckpt), str(out), "--to", "hf", "--overwrite"]) == 0
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="holds no Hugging Face model; --overwrite replaces only an earlier export"):
        export_hf(ckpt, folder, overwrite=True)
    assert (folder / "notes.txt").read_text() == "mine"


def test_export_hf_writes_the_tokenizer_files(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lightning_gaudi_ds import export_hf

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    out = export_hf(_stage_0_checkpoint(tmp_path, _Wrapper(_tiny_llama(True), tokenizer)), tmp_path / "hf")
    again = transformers.AutoTokenizer.from_pretrained(out)
    assert again("a b")["input_ids"] == [1, 2]


def test_export_safetensors_writes_tied_weights_as_copies(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from lightning_gaudi_ds import export_safetensors
    from lightning_gaudi_ds.cli import main

    wrapper = _Wrapper(_tiny_llama(True))
    ckpt = _stage_0_checkpoint(tmp_path, wrapper)
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(ckpt), str(out), "--to", "safetensors"]) == 0
    loaded = load_file(out)
    expected = wrapper.state_dict()
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[k], v.float()) for k, v in expected.items())
    with pytest.raises(Exception, match="exists; pass --overwrite"):
        export_safetensors(ckpt, out)


def test_export_hf_of_a_checkpoint_without_a_hugging_face_model_says_what_to_use(tmp_path: Path) -> None:
    from lightning_gaudi_ds import CheckpointError, export_hf

    ckpt = _stage_0_checkpoint(tmp_path, _Wrapper(_tiny_llama(True)), record=False)
    with pytest.raises(CheckpointError, match=r"records no Hugging Face model.*--to safetensors"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_hf_never_writes_over_the_folder_that_holds_its_input(tmp_path: Path, capsys: Any) -> None:
    from lightning_gaudi_ds.cli import main

    project = tmp_path / "proj"
    project.mkdir()
    ckpt = _stage_0_checkpoint(project, _Wrapper(_tiny_llama(True)))
    (project / "config.json").write_text("{}")
    (project / "notes.txt").write_text("mine")
    assert main(["convert", str(ckpt), str(project), "--to", "hf", "--overwrite"]) == 2
    out = capsys.readouterr().out
    assert f"output {str(project)!r} holds the checkpoint {str(ckpt)!r}" in out, out
    assert str(project / "hf_model") in out
    assert sorted(p.name for p in project.iterdir()) == ["config.json", ckpt.name, "notes.txt"]
    assert ckpt.is_dir() and (project / "notes.txt").read_text() == "mine"


def test_export_hf_overwrite_replaces_only_what_an_export_writes(tmp_path: Path) -> None:
    from lightning_gaudi_ds import export_hf

    ckpt = _stage_0_checkpoint(tmp_path, _Wrapper(_tiny_llama(True)))
    out = export_hf(ckpt, tmp_path / "hf", max_shard_size="20KB")  # sharded: model-0000N-of-0000M + index
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00099.safetensors").write_bytes(b"an older export's shard")
    export_hf(ckpt, out, overwrite=True)  # one file now: the shards and their index would shadow or outlive it
    names = sorted(p.name for p in out.iterdir())
    assert "notes.txt" in names and (out / "notes.txt").read_text() == "mine"
    assert "model.safetensors" in names and not [n for n in names if n.startswith("model-") or "index" in n], names
    assert not (tmp_path / "hf.partial").exists()
    transformers.AutoModelForCausalLM.from_pretrained(out)


def test_export_hf_checks_max_shard_size_before_reading_anything(tmp_path: Path, capsys: Any) -> None:
    from lightning_gaudi_ds import export_hf
    from lightning_gaudi_ds.cli import main

    with pytest.raises(ConfigError, match=r"max_shard_size \(--max-shard-size\) 'lots' is not a size.*\"5GB\""):
        export_hf(tmp_path / "no_such.ckpt", tmp_path / "hf", max_shard_size="lots")
    ckpt = _stage_0_checkpoint(tmp_path, _Wrapper(_tiny_llama(True)))
    for bad in ("lots", "0GB", "-5MB", "5GiB"):
        assert main(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", f"--max-shard-size={bad}"]) == 2
        out = capsys.readouterr().out
        assert f"error: max_shard_size (--max-shard-size) {bad!r} is not a size" in out and '"500MB"' in out, out
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    assert main(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", "--max-shard-size", "1.5MB"]) == 0


# ------------------------------------------------------------------------------------- errors that name nothing
class SparseMoeBlock(torch.nn.Linear):
    pass


class SparseMoEBlock(torch.nn.Linear):  # the class named, one letter off the one the model uses
    pass


def test_a_leaf_module_class_the_model_lacks_names_close_ones_at_stage_3_and_is_ignored_aloud_below() -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy, hf

    model = torch.nn.Sequential(SparseMoeBlock(2, 2), torch.nn.ReLU())
    with pytest.raises(ConfigError, match=r"the model has no SparseMoEBlock module \(close names it has:"
                                          r" SparseMoeBlock\)"):
        hf.mark_leaf_modules(model, (SparseMoEBlock,))
    with pytest.raises(ConfigError, match=r"no LSTM module \(its module classes: ReLU, Sequential, SparseMoeBlock\)"):
        hf.mark_leaf_modules(model, (torch.nn.LSTM,))
    strategy = HPUDeepSpeedStrategy(stage=2, zero3_leaf_modules=[SparseMoEBlock])
    with pytest.warns(UserWarning, match=r"zero3_leaf_modules=\[SparseMoEBlock\]\) is ignored at ZeRO stage 2: leaf"
                                         r" modules matter only under ZeRO-3 \(stage=3\)") as record:
        strategy._mark_leaf_modules(model)
        strategy._mark_leaf_modules(model)  # once
    assert len([w for w in record if "is ignored at ZeRO stage" in str(w.message)]) == 1


class _Payload:
    pass


def test_load_full_weights_refuses_a_pickled_payload_naming_the_file_and_the_opt_in(tmp_path: Path) -> None:
    from lightning_gaudi_ds import HPUDeepSpeedStrategy, UnsafeCheckpointError

    file = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "payload": _Payload()}, file)
    strategy = HPUDeepSpeedStrategy(stage=3, load_full_weights=True)
    with pytest.raises(UnsafeCheckpointError, match=rf"{file} holds what torch's safe loader \(weights_only=True\)"
                                                    r" refuses to build .*_Payload.*If you trust where this"
                                                    r" checkpoint came from, pass `weights_only=False` to trainer"):
        strategy.load_checkpoint(file, weights_only=True)


def test_from_pretrained_offline_names_the_model_id_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    from lightning_gaudi_ds import hf

    # HF_HUB_OFFLINE=1 as read at import: transformers' adapter lookup ignores local_files_only, and without it asks
    # the hub five times with back-off (23 s) on a machine that cannot reach it
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    with pytest.raises(OSError, match=r"from_pretrained\('no-such-org/no-such-model'\): no folder of that name, and"
                                      r" it is not in the Hugging Face cache while the hub is offline"
                                      r" \(HF_HUB_OFFLINE=1 or local_files_only=True\)\. Pass the path"):
        with hf.loading_errors_named():  # inside configure_model's context, at every stage
            transformers.AutoModelForCausalLM.from_pretrained("no-such-org/no-such-model", local_files_only=True)


def test_a_cut_short_safetensors_file_is_named(tmp_path: Path) -> None:
    from safetensors import SafetensorError

    from lightning_gaudi_ds import hf

    _tiny_llama(True).save_pretrained(tmp_path / "model")
    file = tmp_path / "model" / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(SafetensorError, match=rf"^{file}: .*incomplete metadata.*cut short or damaged"):
        with hf.loading_errors_named():
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")


def test_fabric_load_full_weights_refuses_a_pickled_payload_naming_the_file(tmp_path: Path) -> None:
    from lightning_gaudi_ds import UnsafeCheckpointError
    from lightning_gaudi_ds.fabric import HPUDeepSpeedStrategy

    file = tmp_path / "model.ckpt"
    torch.save({"w": torch.zeros(2), "payload": _Payload()}, file)
    strategy = HPUDeepSpeedStrategy(stage=3, load_full_weights=True)
    with pytest.raises(UnsafeCheckpointError, match=rf"{file} holds .*pass `weights_only=False` to fabric.load"):
        strategy.load_checkpoint(file, {"model": torch.nn.Linear(2, 2)}, weights_only=True)
