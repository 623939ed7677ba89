"""A Hugging Face causal LM fine-tuned from pretrained weights, as one real 2-rank job (Lightning's own launcher
starts the other rank), on gloo.

The launching process first makes a tiny Llama (seeded random init) and saves it with ``save_pretrained`` into
``<out>/pretrained`` (sharded into several safetensors files with ``--max-shard-size``). Every rank then computes
the reference in plain PyTorch: that directory loaded with ``from_pretrained``, outside any strategy, and its loss
on the first batch. ``configure_model`` calls ``from_pretrained`` under ``HPUDeepSpeedStrategy(stage=--stage)``
while a sampler thread and a parameter-registration hook record the most parameter bytes this rank holds during
the load. After ``--steps`` steps the job saves a checkpoint, and (``--export``) rank 0 exports it with
``export_hf`` and loads the export with ``from_pretrained``, whose logits must equal the trained model's
(``--peft``: the adapters, with ``PeftModel.from_pretrained``, and the merged model).

``<out>/rank<N>.json``: the reference loss, the first training-step loss, ZeRO-3 as transformers saw it inside and
after ``configure_model``, the peak and total parameter bytes, the loaded dtype; on rank 0 also the export's
loading info and the largest logit difference.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_gaudi_ds  # noqa: F401
from lightning_gaudi_ds import HPUDeepSpeedStrategy
from common import mark_first_step  # noqa: E402  (the jobs' folder is sys.path[0])

VOCAB, SEQ, BATCH = 128, 16, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_pretrained(folder: Path, max_shard_size: str, tied: bool) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: F401

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=max_shard_size)


def batches() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, VOCAB, (BATCH * 4, SEQ), generator=g))


def _local_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` this rank holds: its data, plus its ZeRO-3 partition if it has one."""
    held = p.data.numel() * p.element_size()
    part = getattr(p, "ds_tensor", None)
    return held + (part.numel() * part.element_size() if part is not None else 0)


class ParameterMeter:
    """The most bytes the live parameters created inside it held at once (a 1 ms sampler + each registration)."""

    def __init__(self) -> None:
        self.params: dict[int, weakref.ref] = {}  # by id: tensors do not compare as set members
        self.peak = 0
        self._stop = threading.Event()

    def sample(self) -> None:
        live = [p for p in (ref() for ref in list(self.params.values())) if p is not None]
        self.peak = max(self.peak, sum(_local_bytes(p) for p in live))

    def _hook(self, module: Any, name: str, param: Any) -> None:
        if param is not None:
            self.sample()
            self.params[id(param)] = weakref.ref(param)
            self.sample()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.sample()

    def __enter__(self) -> "ParameterMeter":
        self._handle = torch.nn.modules.module.register_module_parameter_registration_hook(self._hook)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._handle.remove()
        self.sample()


def zero3_seen_by_transformers() -> bool:
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


class FineTune(L.LightningModule):
    def __init__(self, path: str, dtype: torch.dtype, lr: float = 0.05, peft: bool = False) -> None:
        super().__init__()
        self.path, self.dtype_, self.lr, self.peft = path, dtype, lr, peft
        self.model: Any = None
        self.losses: list[float] = []
        self.facts: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        self.facts["zero3_inside"] = zero3_seen_by_transformers()
        with ParameterMeter() as meter:
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype_)
        self.facts["peak_bytes"] = meter.peak
        if self.peft:
            from peft import LoraConfig, get_peft_model

            from lightning_gaudi_ds.hf import zero3_init_paused

            with zero3_init_paused():  # LoRA's B starts at zero: written after construction
                self.model = get_peft_model(self.model, LoraConfig(r=4, lora_alpha=8,
                                                                   target_modules=["q_proj", "v_proj"]))
            self.facts["trainable"] = sorted(n for n, p in self.model.named_parameters() if p.requires_grad)
        self.facts["dtypes"] = sorted({str(p.dtype) for p in self.model.parameters()})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(float(loss.detach().float()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(batches(), batch_size=BATCH)


def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-shard-size", default="40KB")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--export", action="store_true")
    parser.add_argument("--peft", action="store_true", help="LoRA adapters (get_peft_model) after from_pretrained")
    args = parser.parse_args()
    mark_first_step()  # timed suite only (benchmarks/suite.py)
    pretrained = args.out / "pretrained"
    if os.environ.get("LOCAL_RANK", "0") == "0":  # rank 0 (or the launching process, before Lightning's launcher)
        partial = args.out / "pretrained.partial"
        make_pretrained(partial, args.max_shard_size, args.tied)
        partial.rename(pretrained)  # whole or absent: a rank started beside it waits for the folder
    deadline = time.monotonic() + 300
    while not pretrained.is_dir():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {os.environ.get('LOCAL_RANK')}: {pretrained} not written by rank 0 in 300 s")
        time.sleep(0.2)
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[args.dtype]
    reference = AutoModelForCausalLM.from_pretrained(pretrained, dtype=dtype)
    first = next(iter(DataLoader(batches(), batch_size=BATCH)))[0]
    with torch.no_grad():
        reference_loss = float(reference(input_ids=first, labels=first).loss.float())
    total_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    del reference

    module = FineTune(str(pretrained), dtype, peft=args.peft)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HPUDeepSpeedStrategy(stage=args.stage),
        precision="bf16-true" if args.dtype == "bf16" else "32-true", max_steps=args.steps,
        use_distributed_sampler=False, enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(args.out),
    )
    trainer.fit(module)
    rank = trainer.global_rank
    result: dict[str, Any] = {
        "reference_loss": reference_loss, "losses": module.losses, "total_bytes": total_bytes,
        "zero3_after": zero3_seen_by_transformers(), "hf_ref_after": _hf_ref_alive(),
        "shards": sorted(p.name for p in pretrained.glob("*.safetensors")), **module.facts,
    }
    if args.export:
        ckpt = args.out / "trained.ckpt"
        trainer.save_checkpoint(ckpt)
        probe = batches().tensors[0][:2]
        trained_logits = logits_of(module.model, probe)  # every rank: ZeRO-3 gathers the partitions
        trainer.strategy.barrier()
        if rank == 0:
            from lightning_gaudi_ds import export_hf

            if args.peft:  # the adapters, for PeftModel.from_pretrained on the pretrained model
                from peft import PeftModel

                adapters = export_hf(ckpt, args.out / "adapters")
                base = AutoModelForCausalLM.from_pretrained(pretrained)
                untrained = float((logits_of(base, probe) - trained_logits).abs().max())  # the adapters matter
                with_adapters = PeftModel.from_pretrained(base, adapters).eval()
                result.update(adapter_files=sorted(p.name for p in adapters.iterdir()), pretrained_logit_diff=untrained,
                              adapter_logit_diff=float((logits_of(with_adapters, probe) - trained_logits).abs().max()))
            exported = export_hf(ckpt, args.out / "hf", merge_adapters=args.peft)
            loaded, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
            result.update(
                loading_info={k: sorted(map(str, v)) for k, v in info.items()},
                export_files=sorted(p.name for p in exported.iterdir()),
                logit_diff=float((logits_of(loaded.eval(), probe) - trained_logits).abs().max()),
                logit_scale=float(trained_logits.abs().max()),
                tied_after_export=loaded.lm_head.weight is loaded.model.embed_tokens.weight,
            )
            torch.save({"probe": probe, "logits": trained_logits}, args.out / "trained_logits.pt")
        trainer.strategy.barrier()
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


def _hf_ref_alive() -> bool:
    from lightning_gaudi_ds import _compat

    ref = _compat.hf_deepspeed_config_ref()
    return ref is not None and ref() is not None


if __name__ == "__main__":
    main()
