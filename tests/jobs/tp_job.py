"""Tensor-parallel inference as one real 2-rank job (Lightning's own launcher starts the other rank), fp32 on gloo.

``--model llama``: a Hugging Face Llama built from a small config (random init, nothing downloaded), split by
DeepSpeed's AutoTP. ``--model gpt``: the example GPT (examples/train_lm.py) with an ``injection_policy``.
``--model mlp``: a LightningModule holding one two-layer MLP, split with an ``injection_policy`` keyed by the MLP class
that owns the layers (``--policy owner``, the README's form) or by the LightningModule (``--policy module``).
``--from-zero3``: first trains the GPT for a few steps with ZeRO-3 and saves its sharded checkpoint, then serves
that checkpoint with ``ckpt_path=``.

Every rank computes the reference itself, in one process without DeepSpeed (the same seeded weights, or the
checkpoint's fp32 export), then runs ``trainer.predict``, ``trainer.validate`` and ``trainer.test`` on ``--devices``
ranks with ``tensor_parallel={"tp_size": --tp}`` and ``use_distributed_sampler`` left on. It writes
``<out>/rank<N>.json``: the largest logit difference to the reference, the losses, the parameter elements this rank
holds and the model's total, and the samples each rank computed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[2]
import lightning_gaudi_ds  # noqa: E402,F401
from lightning_gaudi_ds import HPUDeepSpeedStrategy  # noqa: E402

spec = importlib.util.spec_from_file_location("train_lm", REPO / "examples" / "train_lm.py")
lm = importlib.util.module_from_spec(spec)
sys.modules["train_lm"] = lm
spec.loader.exec_module(lm)

VOCAB, SEQ, SAMPLES = 256, 16, 8


def parameter_numel(module: torch.nn.Module) -> int:
    """Parameter elements this process holds (a tensor shared by two parameters counts once)."""
    seen: dict[tuple[int, int], int] = {}
    for p in module.parameters():
        seen[(p.untyped_storage().data_ptr(), int(p.storage_offset()))] = p.numel()
    return sum(seen.values())


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(SAMPLES))


class Served(L.LightningModule):
    """predict/validate hooks shared by both models; ``logits`` is the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []  # indices of the samples this rank computed
        self.local_params = 0

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def on_predict_start(self) -> None:
        self.local_params = parameter_numel(self)

    def target(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch[2].tolist())
        return self.logits(batch[0])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        loss = F.cross_entropy(self.logits(x).flatten(0, 1), self.target(y).flatten())
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("test_loss", F.cross_entropy(self.logits(x).flatten(0, 1), self.target(y).flatten()), sync_dist=True)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=4)

    val_dataloader = test_dataloader = predict_dataloader


class ServedLlama(Served):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        self.llama = LlamaForCausalLM(cfg).eval()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=x).logits


class ServedGPT(Served, lm.LitGPT):
    def __init__(self) -> None:
        lm.LitGPT.__init__(self, n_layer=2, n_head=4, n_embd=128, block_size=SEQ)
        self.seen, self.local_params = [], 0
        torch.manual_seed(0)
        self.configure_model()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 512)
        self.fc2 = torch.nn.Linear(512, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ServedMLP(Served):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = MLP()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(F.one_hot(x % 64, 64).float())

    def target(self, y: torch.Tensor) -> torch.Tensor:
        return y % 64


MODELS = {"llama": ServedLlama, "gpt": ServedGPT, "mlp": ServedMLP}


def _reference(model: Served) -> tuple[torch.Tensor, float]:
    data = _data()
    with torch.no_grad():
        logits = torch.cat([model.logits(x) for x, _, _ in DataLoader(data, batch_size=4)])
        loss = F.cross_entropy(logits.flatten(0, 1), model.target(data.tensors[1]).flatten())
    return logits, float(loss)


def _train_zero3(root: Path) -> Path:
    """A few ZeRO-3 steps of the example GPT on the same 2 ranks; the sharded checkpoint it saves."""
    torch.manual_seed(0)
    model = lm.LitGPT(n_layer=2, n_head=4, n_embd=128, block_size=SEQ, lr=1e-2, warmup_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HPUDeepSpeedStrategy(stage=3), precision="32-true", max_steps=3,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )
    inputs, targets, _ = _data().tensors
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(inputs, targets), batch_size=4))
    ckpt = root / "zero3.ckpt"
    trainer.save_checkpoint(ckpt)
    return ckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=tuple(MODELS), required=True)
    parser.add_argument("--policy", choices=("owner", "module"), default="owner", help="--model mlp: the policy's key")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from-zero3", action="store_true")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    ckpt = None
    policy = None
    if args.model == "gpt":
        policy = {lm.Block: ("attn.proj", "mlp.2")}
    elif args.model == "mlp":
        policy = {MLP: ("fc2",)} if args.policy == "owner" else {ServedMLP: ("mlp.fc2",)}
    if args.from_zero3:
        ckpt = _train_zero3(args.out)
    model = MODELS[args.model]()
    random_logits, _ = _reference(model)
    stage = None
    if ckpt is not None:  # the reference: Lightning's fp32 export of the sharded checkpoint, loaded in one process
        export = args.out / f"export{os.environ.get('LOCAL_RANK', '0')}.pt"
        lightning_gaudi_ds.convert_zero_checkpoint_to_fp32_state_dict(ckpt, export)
        model.load_state_dict(torch.load(export, weights_only=False)["state_dict"])
        states = torch.load(next((ckpt / "checkpoint").glob("*model_states.pt")), weights_only=False)
        stage = states["ds_config"]["zero_optimization"]["stage"]
    ref_logits, ref_loss = _reference(model)
    total = parameter_numel(model)

    served = MODELS[args.model]()  # a fresh instance: weights from ckpt_path
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, precision="32-true", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out,
        strategy=HPUDeepSpeedStrategy(tensor_parallel={"tp_size": args.tp}, injection_policy=policy),
    )
    preds = torch.cat(trainer.predict(served, ckpt_path=ckpt))
    val = trainer.validate(served, verbose=False)[0]["val_loss"]  # the split module again, with its weights
    test = trainer.test(served, verbose=False)[0]["test_loss"]
    rank = trainer.global_rank
    result = {
        "rank": rank,
        "world": trainer.world_size,
        "max_abs_diff": float((preds - ref_logits[served.seen]).abs().max()),
        "diff_to_random_init": float((ref_logits - random_logits).abs().max()),
        "ref_val_loss": ref_loss,
        "val_loss": float(val),
        "test_loss": float(test),
        "local_params": served.local_params,
        "total_params": total,
        "seen": served.seen,
        "ckpt_stage": stage,
        "engine": type(trainer.strategy.model).__name__,
        # deepspeed.comm.inference_all_reduce goes through DeepSpeed's CPU shm kernel when it is loaded
        "shm_op": hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_"),
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
