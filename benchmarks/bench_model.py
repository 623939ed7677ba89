"""The benchmark's model, data and DeepSpeed settings: one place, so every arm trains the same thing.

The model is a stack of ``layers`` square ``Linear(hidden, hidden)`` layers (Ψ = layers·(hidden² + hidden)),
built in ``configure_model`` so that ZeRO-3 creates it already partitioned (``deepspeed.zero.Init``), as a
user with a large model would. Every weight (hidden² elements) is above the ZeRO-3 persistence threshold
set below (10·hidden), so ZeRO-3 partitions all of them; only the biases stay whole on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED = 1234
LR = 1e-4
WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int

    @property
    def params(self) -> int:
        return self.layers * (self.hidden * self.hidden + self.hidden)

    @property
    def name(self) -> str:
        return f"h{self.hidden}xl{self.layers}"


def build_net(size: ModelSize) -> nn.Sequential:
    """Linear/Tanh stack; Tanh keeps activations bounded in bf16."""
    mods: list[nn.Module] = []
    for i in range(size.layers):
        mods.append(nn.Linear(size.hidden, size.hidden))
        if i < size.layers - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y.float())


class BenchModule(L.LightningModule):
    """The LightningModule every Trainer arm trains."""

    def __init__(self, size: ModelSize, fused: bool = False) -> None:
        super().__init__()
        self.size = size
        self.fused = fused
        self.net: Optional[nn.Sequential] = None

    def configure_model(self) -> None:
        if self.net is None:  # idempotent: Lightning may call it more than once
            torch.manual_seed(SEED)
            self.net = build_net(self.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss_fn(self(x), y)

    def configure_optimizers(self) -> Any:
        # with ZeRO-Offload the strategy swaps this for DeepSpeed's CPU Adam (same update rule); under ZeRO on CPU
        # it turns on fused=True where this leaves it to torch (None)
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                 fused=True if self.fused else None)


def make_dataset(size: ModelSize, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(samples, size.hidden, generator=g)
    y = torch.tanh(torch.randn(samples, size.hidden, generator=g))
    return TensorDataset(x, y)


def make_loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True)


@dataclass(frozen=True)
class ZeroSettings:
    """The DeepSpeed settings of every ZeRO arm, recorded with the results.

    Bucket sizes follow the Hugging Face rule (reduce/allgather bucket = hidden², ZeRO-3 prefetch =
    0.9·hidden², persistence threshold = 10·hidden) instead of Lightning's 2e8-element defaults, which
    allocate ~400 MB per bucket whatever the model's size (see DESIGN.md section 5). The communication
    settings are left to the strategy's device defaults: the configuration a user gets.
    """

    reduce_bucket_size: int
    allgather_bucket_size: int
    stage3_prefetch_bucket_size: int
    stage3_param_persistence_threshold: int

    @classmethod
    def for_hidden(cls, hidden: int) -> "ZeroSettings":
        return cls(
            reduce_bucket_size=hidden * hidden,
            allgather_bucket_size=hidden * hidden,
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
            stage3_param_persistence_threshold=10 * hidden,
        )


def deepspeed_config(
    stage: int,
    settings: ZeroSettings,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    overrides: tuple[tuple[str, Any], ...] = (),
) -> dict[str, Any]:
    """A DeepSpeed config dict; the strategy adds precision, accumulation, clipping and the device's communication
    defaults (overlap_comm, reduce_scatter, contiguous_gradients, use_multi_rank_bucket_allreduce) unless
    ``overrides`` sets them."""
    s = asdict(settings)
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": s["reduce_bucket_size"],
        "allgather_bucket_size": s["allgather_bucket_size"],
    }
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = s["stage3_prefetch_bucket_size"]
        zero["stage3_param_persistence_threshold"] = s["stage3_param_persistence_threshold"]
    zero.update(overrides)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {"zero_optimization": zero, "zero_allow_untested_optimizer": True}


# ------------------------------------------------------------------------ issue 43's models (boundary.py)
class IssueMLP(L.LightningModule):
    """Issue 43's 3-layer MLP, 64 -> ``width`` -> ``width`` -> 64 (4.5M parameters at width 2048), trained with torch's
    AdamW on MSE; ``example_input_array`` is one micro batch (``plan --measure-activations`` runs it)."""

    def __init__(self, width: int = 2048, batch_size: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 64))
        self.example_input_array = torch.randn(batch_size, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss_fn(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def issue_mlp_loader(batch_size: int, batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(SEED)
    n = batch_size * batches
    return make_loader(TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)), batch_size)


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM built from ``config`` (random weights), trained on its own loss with torch's AdamW."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def token_loader(vocab_size: int, seq_len: int, batch_size: int, batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab_size, (batch_size * batches, seq_len), generator=g)
    return make_loader(TensorDataset(ids), batch_size)
