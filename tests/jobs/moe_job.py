"""A Mixtral-style mixture-of-experts model under ZeRO-3 on 2 real ranks (gloo) that route to different experts.

The MoE block runs only the experts its tokens were routed to (as Mixtral's and Qwen-MoE's blocks do), so each
rank calls a different set of experts. ``--strategy zero3`` trains it with ``HPUDeepSpeedStrategy(stage=3,
zero3_leaf_modules=[MoEBlock])`` (``--no-leaf``: without them), every parameter partitioned
(``stage3_param_persistence_threshold: 0``); ``--strategy ddp``: Lightning's own DDP on the same ranks and data, the
reference. Each rank reads its own data (seeded by rank). ``<out>/rank<N>.json``: the step losses and the experts
each step ran on this rank.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gaudi_ds  # noqa: F401
from lightning_gaudi_ds import HPUDeepSpeedStrategy
from common import mark_first_step  # noqa: E402  (the jobs' folder is sys.path[0])

VOCAB, DIM, EXPERTS, TOKENS = 64, 32, 8, 6


class MoEBlock(nn.Module):
    """Top-1 routing; only the experts some token chose are called."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.SiLU(), nn.Linear(4 * DIM, DIM)) for _ in range(EXPERTS)
        )
        self.ran: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, DIM)
        weights = torch.softmax(self.router(flat), dim=-1)
        top, choice = weights.max(dim=-1)
        out = torch.zeros_like(flat)
        hit = sorted(set(choice.tolist()))
        self.ran.append(hit)
        for e in hit:
            rows = choice == e
            out[rows] = self.experts[e](flat[rows]) * top[rows, None]
        return (flat + out).reshape(x.shape)


class TinyMoE(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = MoEBlock()
        self.head = nn.Linear(DIM, VOCAB)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.moe(self.embed(x)))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(100 + self.global_rank)  # each rank its own tokens: its own experts
        tokens = torch.randint(0, VOCAB, (3, TOKENS + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=("zero3", "ddp"), required=True)
    parser.add_argument("--no-leaf", action="store_true")
    args = parser.parse_args()
    mark_first_step()  # timed suite only (benchmarks/suite.py)
    if args.strategy == "ddp":
        strategy: Any = "ddp_find_unused_parameters_true"
    else:
        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True}
        strategy = HPUDeepSpeedStrategy(config=config, zero3_leaf_modules=None if args.no_leaf else [MoEBlock])
    model = TinyMoE()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=3,
                        use_distributed_sampler=False, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(args.out))
    trainer.fit(model)
    leaf = bool(getattr(model.moe, "_z3_leaf", False))
    (args.out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps({"losses": model.losses, "ran": model.moe.ran, "leaf": leaf})
    )


if __name__ == "__main__":
    main()
