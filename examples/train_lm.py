"""Train a small GPT-style causal language model on *Pride and Prejudice* with DeepSpeed ZeRO.

    python examples/train_lm.py fit --config examples/configs/zero2_bf16.yaml
    python examples/train_lm.py fit --config examples/configs/zero3_bf16.yaml --trainer.max_steps 50
    python examples/train_lm.py fit --config examples/configs/zero2_bf16.yaml \
        --trainer.strategy.init_args.config examples/configs/zero2_bf16.json

Byte-level tokens (vocabulary of 256), a compact GPT of our own (pre-norm blocks, tied input/output
embeddings) built in ``configure_model`` so that ZeRO-3 creates it already partitioned. Our own model rather
than a Hugging Face one: no extra dependency, and every line that matters to ZeRO (initialisation inside the
partitioning context, the shared embedding, decay groups from ``ds_shape``) is visible here. The text ships with
the repository (examples/data); nothing is downloaded. At the end every rank saves its shard of the
checkpoint, a sample is generated (all ranks run the forward: ZeRO-3 gathers parameters collectively), and
rank 0 prints where the logs and the checkpoint are.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning_utilities.core import rank_zero
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_gaudi_ds  # noqa: F401  (registers the hpu_deepspeed* strategy names and the "hpu" accelerator)
from lightning_gaudi_ds import LightningCLI  # Lightning's, with clear errors for --trainer.strategy/precision

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice.txt"


# ------------------------------------------------------------------------------------------------ data
class ByteTokenizer:
    """UTF-8 bytes as tokens: a vocabulary of 256, nothing to train or download."""

    vocab_size = 256

    def encode(self, text: str) -> Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, Tensor) else ids
        return bytes(values).decode("utf-8", errors="replace")


class TokenBlocks(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens: (inputs, targets shifted by one)."""

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one block of {block_size} (+1 target) tokens")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


class TextDataModule(L.LightningDataModule):
    """A plain-text file as byte tokens; the last ``val_fraction`` of it is the validation set.

    Args:
        path: text file (default: the bundled *Pride and Prejudice*).
        block_size: tokens per training sample (the model's context length).
        batch_size: samples per process and step.
        val_fraction: share of the text, taken from its end, held out for validation.
    """

    def __init__(
        self, path: Optional[str] = None, block_size: int = 128, batch_size: int = 16, val_fraction: float = 0.05
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must lie strictly between 0 and 1")
        self.path = Path(path) if path else DEFAULT_TEXT
        self.block_size, self.batch_size, self.val_fraction = block_size, batch_size, val_fraction
        self.tokenizer = ByteTokenizer()
        self.train_set: Optional[TokenBlocks] = None
        self.val_set: Optional[TokenBlocks] = None

    def setup(self, stage: str) -> None:
        tokens = self.tokenizer.encode(self.path.read_text(encoding="utf-8"))
        split = int(len(tokens) * (1.0 - self.val_fraction))
        self.train_set = TokenBlocks(tokens[:split], self.block_size)
        self.val_set = TokenBlocks(tokens[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size)


# ----------------------------------------------------------------------------------------------- model
@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class _Embedding(nn.Embedding):
    """GPT-2's N(0, 0.02) initialisation, done inside ``__init__`` so it also holds under ZeRO-3's
    ``zero.Init`` (which partitions each module's parameters as soon as its constructor returns)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not a multiple of n_head={cfg.n_head}")
        self.head_dim, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout
        # Separate q, k, v projections, and head counts read from their outputs: DeepSpeed's tensor-parallel
        # inference splits each of them by output rows (whole heads per rank) and ``proj`` by input columns,
        # and this forward then runs unchanged on the rank's share of the heads (examples/generate.py).
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; the output projection shares its weight with the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte, self.wpe = _Embedding(cfg.vocab_size, cfg.n_embd), _Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (as in GPT-2); ZeRO-3 handles the shared parameter

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class LitGPT(L.LightningModule):
    """A GPT-style causal LM for LightningCLI (``--model.*``).

    Args:
        n_layer, n_head, n_embd, dropout: transformer size.
        block_size: context length; must match ``data.block_size`` (linked by the CLI).
        vocab_size: 256 for the byte tokenizer.
        lr, weight_decay, betas: AdamW (weight decay on matrices only).
        warmup_steps: linear warm-up, then cosine decay to 10% of ``lr`` at the last step.
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        block_size: int = 128,
        vocab_size: int = 256,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        warmup_steps: int = 30,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        # Under ZeRO-3 Lightning calls this inside deepspeed.zero.Init: each rank only ever holds its shard.
        if self.model is None:
            self.model = GPT(self.cfg)

    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None, "configure_model() has not run"
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    @property
    def flops_per_batch(self) -> int:
        """Training FLOPs of one step on one process (6·N per token plus attention), for ThroughputMonitor."""
        c = self.cfg
        params = 12 * c.n_layer * c.n_embd**2 + (c.vocab_size + c.block_size) * c.n_embd
        per_token = 6 * params + 6 * c.n_layer * c.block_size * c.n_embd
        dm = self.trainer.datamodule
        batch = getattr(dm, "batch_size", 1)
        return per_token * c.block_size * batch

    def configure_optimizers(self) -> Any:
        # Weight decay on matrices only. Under ZeRO-3 a parameter's data is an empty placeholder: use ds_shape.
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
        no_decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=self.hparams.betas,
        )
        total = max(1, self.trainer.estimated_stepping_batches)
        warmup = max(1, min(self.hparams.warmup_steps, total // 2))

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def generate(
        self, prompt: Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: Optional[int] = 20, seed: int = 0
    ) -> Tensor:
        """Sample ``max_new_tokens`` after ``prompt`` (1-D token ids).

        Under ZeRO-3 every rank must call this (each forward gathers the parameters collectively); the shared
        ``seed`` keeps the ranks' samples, hence their sequence lengths, identical.
        """
        generator = torch.Generator().manual_seed(seed)
        idx = prompt.view(1, -1).to(self.device)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.cfg.block_size :])[0, -1].float().cpu() / max(temperature, 1e-5)
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits[logits < kth] = -float("inf")
                token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
                idx = torch.cat([idx, token.view(1, 1).to(idx.device)], dim=1)
        finally:
            self.train(was_training)
        return idx[0].cpu()


def _batch_samples(batch: tuple[Tensor, Tensor]) -> int:
    return batch[0].size(0)


def _batch_tokens(batch: tuple[Tensor, Tensor]) -> int:
    return batch[0].numel()


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor for (inputs, targets) token batches: logs ``train/samples_per_sec`` and
    ``train/items_per_sec`` (items = tokens) for all processes together, ``train/device/*`` per process, and FLOP/s
    from ``LitGPT.flops_per_batch``; each rate is taken over the last ``window_size`` steps.
    """

    def __init__(self, window_size: int = 10) -> None:
        super().__init__(batch_size_fn=_batch_samples, length_fn=_batch_tokens, window_size=window_size)


# -------------------------------------------------------------------------------------------- run report
class RunReport(L.Callback):
    """Keeps first/last training loss and whole-run throughput; generates a text sample when training ends.

    Args:
        prompt: text the sample starts from.
        sample_tokens: bytes to generate (0: no sample).
    """

    def __init__(self, prompt: str = "Elizabeth", sample_tokens: int = 300) -> None:
        self.prompt, self.sample_tokens = prompt, sample_tokens
        self.first_loss: Optional[float] = None
        self.last_loss: Optional[float] = None
        self.samples = self.tokens = self.steps = 0
        self._t0: Optional[float] = None
        self.seconds = 0.0
        self.sample: Optional[str] = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *_: Any) -> None:
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        if self.first_loss is None:
            self.first_loss = loss
            self._t0 = time.perf_counter()  # rates exclude the first step (set-up, warm-up)
        else:
            self.steps += 1
            self.samples += _batch_samples(batch) * trainer.world_size
            self.tokens += _batch_tokens(batch) * trainer.world_size
            self.seconds = time.perf_counter() - self._t0
        self.last_loss = loss

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._t0 is not None:  # validation time does not count as training time
            self._t0 += time.perf_counter() - self._val_t0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.sample_tokens > 0 and isinstance(pl_module, LitGPT):
            tokenizer = ByteTokenizer()
            ids = pl_module.generate(tokenizer.encode(self.prompt), self.sample_tokens)
            self.sample = tokenizer.decode(ids)

    def summary(self, trainer: L.Trainer, checkpoint: Optional[Path]) -> str:
        lines = ["", "=" * 30 + " train_lm summary " + "=" * 30]
        strategy = trainer.strategy
        config = getattr(strategy, "config", None) or {}  # None of it under a strategy without DeepSpeed
        stage = getattr(strategy, "zero_stage", None) or config.get("zero_optimization", {}).get("stage")
        zero = f" (ZeRO stage {stage})" if stage is not None else ""
        lines.append(
            f"run:        {trainer.global_step} steps on {trainer.world_size} x {strategy.root_device.type},"
            f" {type(strategy).__name__}{zero}, precision {trainer.precision}"
        )
        if self.first_loss is not None:
            val = trainer.callback_metrics.get("val_loss")
            lines.append(
                f"loss:       train {self.first_loss:.3f} -> {self.last_loss:.3f}"
                + (f", val {float(val):.3f}" if val is not None else "")
            )
        if self.seconds > 0:
            lines.append(
                f"throughput: {self.samples / self.seconds:,.1f} samples/s, {self.tokens / self.seconds:,.0f} tokens/s"
                f" (all processes; {self.steps} steps in {self.seconds:.1f} s, the run's first step left out)"
            )
        held = _partitioned_share(trainer.lightning_module)
        if held is not None:
            lines.append(f"partition:  rank 0 holds {100 * held:.1f}% of the parameters (ZeRO-3)")
        logger = trainer.logger
        if logger is not None and logger.log_dir:
            metrics = Path(logger.log_dir) / "metrics.csv"
            where = str(metrics) if metrics.exists() else f"{logger.log_dir} ({type(logger).__name__})"
            lines.append(f"logs:       {where}")
            if metrics.exists():
                curve = plot_losses(metrics)
                lines.append(f"loss curve: {curve}" if curve is not None else
                             "loss curve: not drawn (needs matplotlib: pip install -e '.[examples]')")
            ds_config = Path(logger.log_dir) / "deepspeed_config.json"
            if ds_config.exists():
                lines.append(f"ds config:  {ds_config} (as resolved for this run)")
        if checkpoint is not None:
            lines.append(f"checkpoint: {checkpoint} (sharded: one part per process)")
            lines.append(f"            resume: --ckpt_path {checkpoint}")
            lines.append(f"            one fp32 file: lightning-gaudi-ds convert {checkpoint} model.pt")
        if self.sample is not None:
            lines += [f"sample:     {self.sample_tokens} bytes after {self.prompt!r}", "-" * 78, self.sample, "-" * 78]
        return "\n".join(lines)


def plot_losses(metrics: Path) -> Optional[Path]:
    """Draw train and validation loss against the step from Lightning's CSV log into ``loss_curve.png`` next to it;
    None without matplotlib (optional: the ``examples`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import csv

    series: dict[str, list[tuple[int, float]]] = {"train_loss": [], "val_loss": []}
    with metrics.open() as f:
        for row in csv.DictReader(f):
            for key, points in series.items():
                if row.get(key) and row.get("step"):
                    points.append((int(row["step"]), float(row[key])))
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, points in series.items():
        if points:
            ax.plot(*zip(*points, strict=True), marker="o" if key == "val_loss" else None, label=key.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = metrics.with_name("loss_curve.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _partitioned_share(module: Optional[L.LightningModule]) -> Optional[float]:
    """Share of the model's parameter elements held by this process under ZeRO-3 (None without ZeRO-3)."""
    params = [p for p in module.parameters() if hasattr(p, "ds_tensor")] if module is not None else []
    if not params:
        return None
    return sum(p.ds_tensor.numel() for p in params) / max(1, sum(p.ds_numel for p in params))


# ---------------------------------------------------------------------------------------------------- CLI
class LMCLI(LightningCLI):
    """LightningCLI that links the context length, saves a checkpoint after ``fit`` and prints a summary."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("data.block_size", "model.block_size")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput")
        parser.add_lightning_class_args(RunReport, "report")
        parser.add_argument("--save_checkpoint", type=bool, default=True, help="save a (sharded) checkpoint after fit")

    def after_fit(self) -> None:
        trainer = self.trainer
        checkpoint = None
        if self.config.fit.save_checkpoint:
            root = Path(trainer.log_dir or trainer.default_root_dir)  # broadcast from rank 0
            checkpoint = root / "checkpoints" / "last.ckpt"
            trainer.save_checkpoint(checkpoint, weights_only=False)  # every rank writes its shard, optimizer too
        report = next((c for c in trainer.callbacks if isinstance(c, RunReport)), None)
        if trainer.is_global_zero and report is not None:
            print(report.summary(trainer, checkpoint), flush=True)


class _NoTips(logging.Filter):
    """Lightning's "💡 Tip: ... try installing litlogger" advertisement, printed on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


class _NoCpuNotice(logging.Filter):
    """DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    on import: on a machine without one, what this run does anyway (the run's summary names the accelerator)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU")


def main(args: Optional[list[str]] = None) -> None:
    warnings.filterwarnings("ignore", message=".*`tensorboardX` has been removed as a dependency.*")
    rank_zero.log.addFilter(_NoTips())  # the logger of Lightning's rank_zero_info
    logging.getLogger("DeepSpeed").addFilter(_NoCpuNotice())  # DeepSpeed's logger, which its import configures
    with warnings.catch_warnings():  # for this run only
        # Lightning 2.6's CombinedLoader builds torch's deprecated LeafSpec at every fit/validate: nothing to act on
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        # Lightning's model summary sizes bf16 weights as fp32 and says so: the parameter counts are right
        warnings.filterwarnings("ignore", message=r"Precision bf16-mixed is not supported by the model summary")
        # DeepSpeed's ZeRO-3 collectives call torch's deprecated names; the strategy silences them in its own calls,
        # and this covers the sample generated after fit (a forward through the partitioned model)
        warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                                category=FutureWarning)
        if "SLURM_JOB_ID" not in os.environ:
            # SLURM's client installed (scripts/setup.sh installs it for the SLURM tests) but no allocation: Lightning's
            # hint to run this under `srun` has nothing to act on; inside an allocation it stays
            warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
        LMCLI(LitGPT, TextDataModule, seed_everything_default=42, args=args)


if __name__ == "__main__":
    main()
