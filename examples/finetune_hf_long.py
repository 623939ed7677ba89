"""Fine-tune a small Llama on sequences longer than one rank can hold: DeepSpeed-Ulysses sequence parallelism.

    python examples/finetune_hf_long.py                                  # 2 ranks share each 6,144-token sequence
    python examples/finetune_hf_long.py --devices 4 --sequence-parallel-size 4 --seq-len 12288
    python examples/finetune_hf_long.py --pretrained path/to/llama       # a local from_pretrained directory
    lightning-gaudi-ds spawn --world_size 8 examples/finetune_hf_long.py --accelerator hpu --devices 8 \\
        --sequence-parallel-size 8 --seq-len 65536 --precision bf16-mixed

``HPUDeepSpeedStrategy(stage=3, sequence_parallel_size=K)``: the K ranks of a group read the same batch, and each
keeps ``1/K`` of every sequence; the all-to-all around attention (transformers' Llama attention, unchanged) gives
each rank the whole sequence for ``1/K`` of the heads; the loss is that of the whole sequences on every rank. The
activations each rank holds shrink K-fold: the default length is one that K = 1 cannot train under the memory cap of
``benchmarks/sequence.py`` (the same model; its results: ``benchmarks/results/sequence/sequence.md``), and that
K = 2 trains. The model is random-init (``--pretrained``: a local ``from_pretrained`` directory instead); the text is
*Pride and Prejudice* (examples/data), as bytes. Each rank prints the loss of every step: the same on all ranks.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_gaudi_ds import HPUDeepSpeedStrategy

TEXT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice.txt"


class Windows(Dataset):
    """Consecutive ``length``-byte windows of the text, as token ids (one byte, one token)."""

    def __init__(self, length: int) -> None:
        self.ids = torch.tensor(list(TEXT.read_bytes()), dtype=torch.long)
        self.length = length
        if len(self.ids) < length:
            raise SystemExit(f"--seq-len {length} is longer than the text ({len(self.ids)} bytes)")

    def __len__(self) -> int:
        return len(self.ids) // self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i * self.length:(i + 1) * self.length]
        return {"input_ids": window, "labels": window}


class LongContextLM(L.LightningModule):
    """A Llama built in ``configure_model`` (under ZeRO-3: already partitioned): random init with the benchmark's
    shape, or ``from_pretrained(pretrained)``."""

    def __init__(self, seq_len: int, pretrained: str | None = None, lr: float = 3e-4) -> None:
        super().__init__()
        self.seq_len, self.pretrained, self.lr = seq_len, pretrained, lr
        self.model: Any = None
        self.started = 0.0

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        if self.pretrained:
            self.model = AutoModelForCausalLM.from_pretrained(self.pretrained, attn_implementation="sdpa")
            return
        torch.manual_seed(0)  # every rank the same weights
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2**17,
                             use_cache=False)
        config._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # the batch is this rank's part of each sequence; the loss is the whole sequences' (the same on every rank)
        loss = self.model(**batch).loss
        part = batch["input_ids"].shape[1]
        print(f"rank {self.global_rank}: step {self.global_step}, {part:,} of the {self.seq_len:,} tokens"
              f" of each sequence here, loss {loss.item():.4f}, {time.monotonic() - self.started:.1f}s", flush=True)
        return loss

    def on_train_start(self) -> None:
        self.started = time.monotonic()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--sequence-parallel-size", type=int, default=2, help="ranks sharing each sequence (K)")
    parser.add_argument("--seq-len", type=int, default=6144, help="tokens per sequence (default 6,144)")
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--precision", default="32-true", help="32-true (default; fast on CPU) or bf16-mixed")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--pretrained", default=None, help="a local from_pretrained directory (default: random init)")
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args(argv)
    strategy = HPUDeepSpeedStrategy(stage=args.stage, sequence_parallel_size=args.sequence_parallel_size)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                        strategy=strategy, precision=args.precision, max_steps=args.max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(Windows(args.seq_len), batch_size=1, shuffle=True)
    trainer.fit(LongContextLM(args.seq_len, args.pretrained, args.lr), data)


if __name__ == "__main__":
    main()
