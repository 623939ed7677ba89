"""A Fabric script as LitGPT's are written: it never imports lightning_gaudi_ds, and ``Fabric()`` takes accelerator,
devices, strategy and precision from ``lightning-gaudi-ds fabric run`` (its ``LT_*`` variables).

``python fabric_run_job.py OUT``: trains a linear model for a few steps; each rank writes ``OUT/rank<N>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

STEPS = 3


def main() -> None:
    out = Path(sys.argv[1])
    fabric = Fabric()  # no fabric.launch(): under `fabric run` the ranks exist already
    fabric.seed_everything(7)
    model = nn.Linear(8, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(fabric.global_rank)  # each rank its own batch
    x = torch.randn(16, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(fabric.to_device(x)), fabric.to_device(y))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    strategy = fabric.strategy
    result = {
        "strategy": f"{type(strategy).__module__}.{type(strategy).__name__}",
        "zero_stage": getattr(strategy, "zero_stage", None),
        "world_size": fabric.world_size,
        "global_rank": fabric.global_rank,
        "losses": losses,
        "weights": [float(p.detach().float().sum()) for p in model.parameters()],
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
