"""Sequence parallelism without processes: the groups' layout and DeepSpeed's ``mpu``, batches split and padded,
the loss's shift, the masks attention gets, the Hugging Face checks, and every refusal before training (the
arguments, the config, the world size, tensor-parallel serving, a DeepSpeed without Ulysses' attention)."""

from __future__ import annotations

import inspect
import re
from collections import UserDict
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gaudi_ds import ConfigError, HPUDeepSpeedStrategy, _compat
from lightning_gaudi_ds.sequence import SequenceParallel, batch, hf, loss
from lightning_gaudi_ds.sequence.groups import ParallelUnit, layout
from lightning_gaudi_ds.sequence.runtime import sharding_loader


# ----------------------------------------------------------------------------------------------- groups
def test_layout_blocks_of_consecutive_ranks_and_data_parallel_across_them() -> None:
    assert layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert layout(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert layout(2, 1) == ([[0], [1]], [[0, 1]])
    with pytest.raises(ValueError, match="does not divide"):
        layout(6, 4)


def test_parallel_unit_answers_every_mpu_call_of_deepspeed() -> None:
    """Every ``mpu.get_*`` DeepSpeed's engine, ZeRO, its config and checkpointing call (read from the installed
    DeepSpeed) is a method of ParallelUnit: a new one would otherwise fail as an AttributeError mid-set-up."""
    import deepspeed

    root = Path(deepspeed.__file__).parent
    called: set[str] = set()
    for sub in ("runtime/engine.py", "runtime/config.py", "runtime/utils.py", "runtime/bf16_optimizer.py",
                "runtime/zero", "runtime/fp16", "runtime/checkpoint_engine", "utils/groups.py", "checkpoint"):
        for path in [root / sub] if sub.endswith(".py") else sorted((root / sub).rglob("*.py")):
            called |= set(re.findall(r"\bmpu\.(get_\w+)\(", path.read_text(errors="replace")))
    optional = {  # behind hasattr checks or pipeline/slice parallelism only
        "get_pipe_parallel_group", "get_pipe_parallel_world_size", "get_slice_parallel_group",
        "get_slice_parallel_rank", "get_slice_parallel_world_size", "get_pipe_parallel_rank",
        "get_pipeline_model_parallel_rank", "get_stage_id",
    }
    missing = sorted(name for name in called - optional if not hasattr(ParallelUnit, name))
    assert not missing, f"DeepSpeed {deepspeed.__version__} calls mpu.{missing}, which ParallelUnit lacks"
    assert not hasattr(ParallelUnit, "initialize_sequence_parallel")  # DeepSpeed 0.19 would take it for ALST's


# ----------------------------------------------------------------------------------------------- batches
def test_shard_batch_cuts_every_sequence_tensor_and_keeps_the_rest() -> None:
    ids = torch.arange(24).view(2, 12)
    per_sample = torch.tensor([3, 4])
    full = {"input_ids": ids, "labels": ids + 100, "score": per_sample, "name": "x"}
    parts = [batch.shard_batch(full, 3, r) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], dim=1), ids)
    assert torch.equal(parts[1]["labels"], ids[:, 4:8] + 100)
    assert all(p["score"] is per_sample and p["name"] == "x" for p in parts)
    x, y = batch.shard_batch((ids, ids.float()), 2, 1)  # a tuple: the first 2-D tensor's length
    assert torch.equal(x, ids[:, 6:]) and torch.equal(y, ids[:, 6:].float())
    assert batch.shard_batch(full, 1, 0) is full


def test_shard_batch_pads_a_dict_batch_with_known_values() -> None:
    ids = torch.arange(1, 11).view(1, 10)
    full = UserDict({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
                     "position_ids": torch.arange(10).view(1, 10)})
    last = batch.shard_batch(full, 4, 3)  # 10 -> 12: 3 tokens each
    assert isinstance(last, UserDict)
    assert last["input_ids"].tolist() == [[10, 0, 0]]
    assert last["labels"].tolist() == [[10, -100, -100]]
    assert last["attention_mask"].tolist() == [[1, 0, 0]]
    assert last["position_ids"].tolist() == [[9, 10, 11]]


def test_shard_batch_refuses_what_it_cannot_pad_naming_the_length() -> None:
    ids = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"9 long.*Pad the sequences to a multiple of 2 \(e.g. 10\)"):
        batch.shard_batch((ids, ids), 2, 0)
    with pytest.raises(ConfigError, match=r"what to pad 'pixel_mask' with"):
        batch.shard_batch({"input_ids": ids, "pixel_mask": ids}, 2, 0)
    with pytest.raises(ConfigError, match=r"a tensor of shape \(4,\)\) has no tensor with a sequence dimension"):
        batch.shard_batch(torch.zeros(4), 2, 0)


def test_sharding_loader_is_the_loader_with_split_batches() -> None:
    loader = DataLoader(TensorDataset(torch.arange(16).view(4, 4)), batch_size=2)
    sharded = sharding_loader(loader, lambda b: batch.shard_batch(b, 2, 1))
    assert isinstance(sharded, DataLoader) and sharded.dataset is loader.dataset and sharded.batch_size == 2
    assert len(sharded) == 2
    assert [b[0].tolist() for b in sharded] == [[[2, 3], [6, 7]], [[10, 11], [14, 15]]]
    assert [b[0].shape[1] for b in loader] == [4, 4]  # the user's loader unchanged


# ----------------------------------------------------------------------------------------------- the loss
def test_causal_lm_loss_without_a_group_is_hugging_faces() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[0, 2:4] = -100
    ours = loss.causal_lm_loss(logits, labels)
    assert torch.allclose(ours, ForCausalLMLoss(logits, labels, vocab_size=11), atol=1e-6)
    assert loss.shifted_labels(labels).tolist()[0] == labels[0, 1:].tolist() + [-100]
    with pytest.raises(ValueError, match="needs `labels`"):
        loss.causal_lm_loss(logits)


def test_sum_over_group_without_a_group_is_the_tensor() -> None:
    t = torch.ones(2, requires_grad=True)
    assert loss.sum_over_group(t, None) is t


# ----------------------------------------------------------------------------------------------- masks
def test_full_mask_per_implementation() -> None:
    kw: dict[str, Any] = dict(dtype=torch.float32, device=torch.device("cpu"))
    assert hf.full_mask("sdpa", 4, padding=None, causal=True, window=None, **kw) is None  # sdpa's is_causal
    assert hf.full_mask("sdpa", 4, padding=None, causal=True, window=8, **kw) is None  # a window past the end
    eager = hf.full_mask("eager", 3, padding=None, causal=True, window=None, **kw)
    assert eager.shape == (1, 1, 3, 3) and eager[0, 0, 0, 1] == torch.finfo(torch.float32).min
    assert eager[0, 0, 2, 0] == 0
    window = hf.full_mask("sdpa", 4, padding=None, causal=True, window=2, **kw)
    assert window[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    padding = torch.tensor([[False, True, True]])
    padded = hf.full_mask("sdpa", 3, padding=padding, causal=True, window=None, **kw)
    assert padded[0, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]  # a pad attends to itself only
    assert hf.full_mask("flash_attention_2", 3, padding=padding, causal=True, window=2, **kw) is padding


# ----------------------------------------------------------------------------------------------- Hugging Face
def _llama(heads: int = 8, kv_heads: int = 4, attention: str = "sdpa", cls: str = "LlamaForCausalLM") -> Any:
    import transformers

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=4 * heads, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads)
    config._attn_implementation = attention
    return getattr(transformers, cls)(config)


def test_hugging_face_attention_found_and_checked() -> None:
    model = _llama()
    modules = hf.check_model(model, 4)
    assert [type(m).__name__ for m in modules] == ["LlamaAttention"]
    assert hf.transformers_models(torch.nn.ModuleDict({"lm": model})) == [model]
    with pytest.raises(ConfigError, match="has 4 key-value heads, which 8 ranks cannot share"):
        hf.check_model(model, 8)
    with pytest.raises(ConfigError, match="6 attention heads and 3 key-value heads, which 4 ranks"):
        hf.check_model(_llama(heads=6, kv_heads=3), 4)
    with pytest.raises(ConfigError, match="attn_implementation='flex_attention'.*attn_implementation='sdpa'"):
        hf.check_model(_llama(attention="flex_attention"), 2)
    with pytest.raises(ConfigError, match="computes a ForSequenceClassification loss"):
        hf.check_model(_llama(cls="LlamaForSequenceClassification"), 2)


def test_attention_implementation_set_on_a_copy_only() -> None:
    import copy

    model = _llama()
    config = model.config
    copied = _compat.with_attention_implementation(copy.copy(config), hf.ATTENTION)
    assert copied._attn_implementation == hf.ATTENTION and config._attn_implementation == "sdpa"


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("size", [0, -2, True, "2", 1.5])
def test_size_must_be_a_whole_number(size: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"sequence_parallel_size={size!r}") + ".*whole number >= 1"):
        HPUDeepSpeedStrategy(sequence_parallel_size=size)


def test_size_from_the_config_and_disagreement() -> None:
    assert HPUDeepSpeedStrategy(config={"sequence_parallel_size": 2}).sequence_parallel.size == 2
    assert HPUDeepSpeedStrategy(sequence_parallel_size=2, config={"sequence_parallel_size": 2}
                                ).sequence_parallel.size == 2
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=4\) and the DeepSpeed config's.*2 disagree"):
        HPUDeepSpeedStrategy(sequence_parallel_size=4, config={"sequence_parallel_size": 2})
    with pytest.raises(ConfigError, match="config's \"sequence_parallel_size\": 0: pass the number of ranks"):
        HPUDeepSpeedStrategy(config={"sequence_parallel_size": 0})
    assert HPUDeepSpeedStrategy().sequence_parallel.size == 1


def test_refused_with_tensor_parallel_serving() -> None:
    with pytest.raises(ConfigError, match="tensor-parallel serving.*cannot be combined"):
        HPUDeepSpeedStrategy(sequence_parallel_size=2, tensor_parallel={"tp_size": 2})
    with pytest.raises(ConfigError, match="tensor-parallel serving"):
        HPUDeepSpeedStrategy(config={"sequence_parallel_size": 2, "tensor_parallel": {"tp_size": 2}})


def test_refused_when_it_does_not_divide_the_world_before_any_process() -> None:
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=2\) does not divide the 3 processes.*\(3\)"):
        L.Trainer(accelerator="cpu", devices=3, strategy=HPUDeepSpeedStrategy(sequence_parallel_size=2), logger=False)
    from lightning.fabric import Fabric

    from lightning_gaudi_ds.fabric import HPUDeepSpeedStrategy as FabricStrategy

    with pytest.raises(ConfigError, match=r"sequence_parallel_size=4\) does not divide the 2 processes"):
        Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy(sequence_parallel_size=4))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HPUDeepSpeedStrategy(sequence_parallel_size=2),
                        logger=False)
    assert trainer.strategy.sequence_parallel.data_parallel_size(trainer.world_size) == 1


def test_refused_without_ulysses_in_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "ulysses_missing", lambda: "no /x/deepspeed/sequence/layer.py")
    with pytest.raises(ConfigError, match=r"lacks \(no /x/deepspeed/sequence/layer.py\).*DeepSpeed 0.16 or later"):
        L.Trainer(accelerator="cpu", devices=2, strategy=HPUDeepSpeedStrategy(sequence_parallel_size=2), logger=False)
    L.Trainer(accelerator="cpu", devices=2, strategy=HPUDeepSpeedStrategy(), logger=False)  # K = 1 needs none


def test_sequence_parallel_modules() -> None:
    from lightning_gaudi_ds.sequence import attention

    class Attention(torch.nn.Module):
        num_heads = 6

    class Layout(torch.nn.Module):
        sequence_parallel_layout = "sbhd"

    assert attention.module_classes(None) == ()
    assert attention.module_classes("torch.nn.MultiheadAttention") == (torch.nn.MultiheadAttention,)
    with pytest.raises(ConfigError, match="'torch.nn.Linearr'"):
        attention.module_classes(["torch.nn.Linearr"])
    with pytest.raises(ConfigError, match="not a torch.nn.Module subclass"):
        attention.module_classes([int])
    with pytest.raises(ConfigError, match="'sbhd'"):
        attention.module_classes([Layout])
    model = torch.nn.Sequential(Attention())
    with pytest.raises(ConfigError, match="has no Layout module"):
        attention.find_modules(model, (Layout,))
    with pytest.raises(ConfigError, match="num_heads=6, which 4 ranks cannot share"):
        attention.check_declared_heads(attention.find_modules(model, (Attention,)), 4)


def test_sampler_replicas_are_the_groups() -> None:
    sp = SequenceParallel(2)
    assert sp.sampler_kwargs({"num_replicas": 4, "rank": 3}) == {"num_replicas": 2, "rank": 1}
    assert SequenceParallel(1).sampler_kwargs({"num_replicas": 4, "rank": 3}) == {"num_replicas": 4, "rank": 3}


def test_arguments_in_both_strategies_signatures() -> None:
    from lightning_gaudi_ds.fabric import HPUDeepSpeedStrategy as FabricStrategy

    for cls in (HPUDeepSpeedStrategy, FabricStrategy):
        parameters = inspect.signature(cls).parameters
        assert {"sequence_parallel_size", "sequence_parallel_modules"} <= parameters.keys()
