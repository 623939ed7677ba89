"""The GPT of ``train_lm.py`` (same data, tokenizer and model) trained with a plain Lightning Fabric loop.

    python examples/fabric_lm.py --strategy hpu_deepspeed_stage_3 --accelerator cpu --devices 2 --max_steps 50
    python examples/fabric_lm.py --strategy hpu_deepspeed_stage_3 --accelerator cpu --devices 2 --max_steps 60 \\
        --resume fabric_logs/checkpoint
    lightning-gaudi-ds spawn --world_size 8 examples/fabric_lm.py --accelerator hpu --devices 8

The model is built under ``fabric.init_module(empty_init=True)``, so under ZeRO-3 each rank only ever holds its
shard; ``fabric.save`` writes a crash-safe sharded checkpoint (``--resume`` loads it, on any number of ranks).
Rank 0 writes ``metrics.csv`` (and ``loss_curve.png`` with matplotlib) and prints the same summary as train_lm.py.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.nn import functional as F
from torch.utils.data import DataLoader
from train_lm import DEFAULT_TEXT, GPT, ByteTokenizer, GPTConfig, TokenBlocks, plot_losses

import lightning_gaudi_ds  # noqa: F401  (registers hpu_deepspeed* and "hpu" with Fabric)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="hpu_deepspeed_stage_2", help="a registered name, e.g. hpu_deepspeed_stage_3")
    p.add_argument("--accelerator", default="cpu", help="hpu, cuda or cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--max_steps", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument("--val_batches", type=int, default=8, help="validation batches per rank at the end")
    p.add_argument("--out", type=Path, default=Path("fabric_logs"))
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint folder written by this script")
    return p.parse_args(argv)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """train_lm.py's schedule: linear warm-up, then cosine decay to 10% of ``lr`` at the last step."""
    warmup = max(1, min(args.warmup_steps, args.max_steps // 2))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, args.max_steps - warmup))
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def loaders(args: argparse.Namespace) -> tuple[DataLoader, DataLoader]:
    tokens = ByteTokenizer().encode(DEFAULT_TEXT.read_text(encoding="utf-8"))
    split = int(len(tokens) * 0.95)  # train_lm.py's val_fraction
    train = DataLoader(TokenBlocks(tokens[:split], args.block_size), batch_size=args.batch_size, shuffle=True,
                       drop_last=True)
    val = DataLoader(TokenBlocks(tokens[split:], args.block_size), batch_size=args.batch_size)
    return train, val


def loss_of(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
                    precision=args.precision)
    fabric.launch()
    fabric.seed_everything(1234)
    train_loader, val_loader = fabric.setup_dataloaders(*loaders(args))

    with fabric.init_module(empty_init=True):  # ZeRO-3: built already partitioned
        model = GPT(GPTConfig(256, args.block_size, args.n_layer, args.n_head, args.n_embd))
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]  # ZeRO-3: data is a placeholder
    no_decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.99))
    model, optimizer = fabric.setup(model, optimizer)

    step = 0
    if args.resume is not None:
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(args.resume, state)
        step = int(state["step"])
        fabric.print(f"resumed from {args.resume} at step {step}")

    args.out.mkdir(parents=True, exist_ok=True)
    metrics = args.out / "metrics.csv"
    rows: list[dict[str, Any]] = []
    first = last = None
    t0, timed_steps, samples = None, 0, 0
    while step < args.max_steps:
        for batch in train_loader:
            if step >= args.max_steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args)
            loss = loss_of(model, batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            value = float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
            step += 1
            rows.append({"step": step, "train_loss": value, "val_loss": ""})
            if first is None:
                first, t0 = value, time.perf_counter()  # rates leave out the first step (set-up, warm-up)
            else:
                timed_steps += 1
                samples += batch[0].size(0) * fabric.world_size
            last = value
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0

    model.eval()
    with torch.no_grad():
        losses = [loss_of(model, batch) for _, batch in zip(range(args.val_batches), val_loader, strict=False)]
    val = float(fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean")) if losses else None
    model.train()
    rows.append({"step": step, "train_loss": "", "val_loss": "" if val is None else val})

    checkpoint = args.out / "checkpoint"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": step})

    if fabric.is_global_zero:
        with metrics.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", "train_loss", "val_loss"])
            writer.writeheader()
            writer.writerows(rows)
        curve = plot_losses(metrics)
        strategy = fabric.strategy
        stage = getattr(strategy, "zero_stage", None)
        lines = ["", "=" * 30 + " fabric_lm summary " + "=" * 30,
                 f"run:        {step} steps on {fabric.world_size} x {fabric.device.type}, {type(strategy).__name__}"
                 + (f" (ZeRO stage {stage})" if stage is not None else "") + f", precision {args.precision}"]
        if first is not None:
            lines.append(f"loss:       train {first:.3f} -> {last:.3f}"
                         + (f", val {val:.3f}" if val is not None else ""))
        if seconds > 0:
            lines.append(f"throughput: {samples / seconds:,.1f} samples/s, {samples * args.block_size / seconds:,.0f}"
                         f" tokens/s (all processes; {timed_steps} steps in {seconds:.1f} s, the first left out)")
        lines.append(f"logs:       {metrics}")
        lines.append(f"loss curve: {curve}" if curve is not None else
                     "loss curve: not drawn (needs matplotlib: pip install -e '.[examples]')")
        lines.append(f"checkpoint: {checkpoint} (sharded: one part per process)")
        lines.append(f"            resume: --resume {checkpoint} --max_steps {step + 50}")
        lines.append(f"            one fp32 file: lightning-gaudi-ds convert {checkpoint} model.pt")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
