"""Generate text with the example GPT, its weights split across 2 processes by DeepSpeed's tensor parallelism.

    bash scripts/train.sh                                    # writes lightning_logs/version_N/checkpoints/last.ckpt
    python examples/generate.py predict --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt \
        --data.prompt "Elizabeth" --data.max_new_tokens 200
    # the same on one process (the text is the same: greedy decoding, fp32)
    python examples/generate.py predict --ckpt_path ... --trainer.devices 1 \
        --trainer.strategy.init_args.tensor_parallel '{"tp_size": 1}'

The checkpoint is the sharded one ``scripts/train.sh`` saves (any ZeRO stage; it is merged in memory before the
split) or one file from ``lightning-gaudi-ds convert``; the model's size comes from its hyperparameters. The GPT is
our own module, so DeepSpeed needs an ``injection_policy``: in each ``Block`` the layers whose outputs are summed
across ranks (``attn.proj``, ``mlp.2``); the q/k/v and first MLP layers are split by output rows, so each rank
holds half of the heads. Every rank runs the same greedy loop on the same prompt; rank 0 prints the text and the
speed. On Gaudi add ``--trainer.accelerator hpu --trainer.precision bf16-mixed``.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from train_lm import ByteTokenizer, LitGPT

from lightning_gaudi_ds import LightningCLI  # Lightning's, with clear errors for --trainer.strategy/precision
from lightning_gaudi_ds.engine.inference import checkpoint_hparams


class PromptData(L.LightningDataModule):
    """One prompt to continue.

    Args:
        prompt: the text generation starts from.
        max_new_tokens: bytes to generate.
    """

    def __init__(self, prompt: str = "Elizabeth", max_new_tokens: int = 200) -> None:
        super().__init__()
        self.prompt, self.max_new_tokens = prompt, max_new_tokens

    def predict_dataloader(self) -> DataLoader:
        item = (ByteTokenizer().encode(self.prompt), self.max_new_tokens)
        return DataLoader([item], batch_size=None)


class GreedyGPT(LitGPT):
    """The example GPT; ``predict_step`` continues a prompt greedily (the most likely byte at every step)."""

    def predict_step(self, batch: tuple[torch.Tensor, int], batch_idx: int) -> dict[str, Any]:
        prompt, new_tokens = batch
        idx = prompt.view(1, -1).to(self.device)
        start = time.perf_counter()
        for _ in range(int(new_tokens)):
            logits = self(idx[:, -self.cfg.block_size :])[0, -1]
            idx = torch.cat([idx, logits.argmax().view(1, 1)], dim=1)
        seconds = time.perf_counter() - start
        self.generated = {"tokens": idx[0].cpu(), "new_tokens": int(new_tokens), "seconds": seconds}
        return self.generated


class GenerateCLI(LightningCLI):
    """``predict`` with the model's size read from the checkpoint; prints the text and tokens/s on rank 0."""

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else None
        ckpt = config.get("ckpt_path") if config is not None else None
        if ckpt:  # a sharded checkpoint is a directory, which LightningCLI does not read hyperparameters from
            known = set(config.model.keys()) if hasattr(config.model, "keys") else set()
            for key, value in checkpoint_hparams(ckpt).items():
                if key in known:
                    config.model[key] = value

    def after_predict(self) -> None:
        trainer = self.trainer
        out = getattr(self.model, "generated", None)
        if not trainer.is_global_zero or out is None:
            return
        text = ByteTokenizer().decode(out["tokens"])
        rate = out["new_tokens"] / out["seconds"]
        tp = getattr(trainer.strategy, "_inference", None)
        print(
            f"\n{'=' * 30} generate ({trainer.world_size} x {trainer.strategy.root_device.type},"
            f" tensor parallel {tp.tp_size if tp else 1}, {trainer.precision}) {'=' * 30}\n{text}\n{'-' * 78}\n"
            f"{out['new_tokens']} tokens in {out['seconds']:.2f} s: {rate:.1f} tokens/s,"
            f" {1e3 / rate:.1f} ms per token",
            flush=True,
        )


def main(args: list[str] | None = None) -> None:
    GenerateCLI(
        GreedyGPT,
        PromptData,
        seed_everything_default=0,
        save_config_callback=None,  # generation writes no logs
        args=args,
        trainer_defaults={
            "accelerator": "cpu",
            "devices": 2,
            "precision": "32-true",
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": {
                "class_path": "lightning_gaudi_ds.HPUDeepSpeedStrategy",
                "init_args": {
                    "tensor_parallel": {"tp_size": 2},
                    "injection_policy": {"train_lm.Block": ["attn.proj", "mlp.2"]},
                },
            },
        },
    )


if __name__ == "__main__":
    main()
