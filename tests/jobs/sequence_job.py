"""Sequence parallelism (``HPUDeepSpeedStrategy(sequence_parallel_size=K)``) against the same step without it, as
one real job of ``--devices`` ranks on gloo: several fits in the same processes, each a new model, strategy and
Trainer (the Trainer's ranks are started outside Lightning, as its launcher would).

Every comparison is one optimizer step of a K-way run and of a ``K = 1`` run on the same batches: the ``K`` ranks of
a sequence-parallel group read one batch (the strategy's distributed sampler), and in the reference every rank reads
the batch of the group it would be in (a ``DistributedSampler`` of ``world / K`` replicas), so that both average the
same gradients. The models: a random-init Llama (grouped-query attention) and GPT-2 from transformers, and a model
of this file whose attention module is named in ``sequence_parallel_modules``; the batches have left and right
padding, ``-100`` labels and a length of 30 (padded to 32 for ``K = 4``).

``--plan``: ``grads`` (fp32 loss and gradients: ZeRO-2 and ZeRO-3, both models and the user's own attention at
``K = devices``, and a few more), ``train`` (bf16 and activation checkpointing: a few steps), ``fabric`` (the
Fabric strategy), ``checkpoint`` (a ``K = 2`` run and a ``K = 1`` run of 2 steps save checkpoints; then resumes from
the ``K = 2`` one at ``K = 1``; and from ``--load`` on this world size), ``errors`` (what is refused before training).

Each rank writes ``rank<N>.json``: per case the losses, the largest gradient difference to the reference and the
largest gradient, and what it saw.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import job_parser, start_process, write_result
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_gaudi_ds  # noqa: F401
from lightning_gaudi_ds import HPUDeepSpeedStrategy
from lightning_gaudi_ds.sequence import causal_lm_loss

VOCAB, LENGTH, SAMPLES, BATCH = 128, 30, 8, 2


# ------------------------------------------------------------------------------------------------ the data
class TokenData(Dataset):
    """``SAMPLES`` dict samples of ``LENGTH`` tokens: odd samples padded on the left (3), samples 2 mod 4 on the
    right (4), every 7th label -100 besides."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, LENGTH), generator=g)
        self.mask = torch.ones(SAMPLES, LENGTH, dtype=torch.long)
        self.labels = self.ids.clone()
        for i in range(SAMPLES):
            if i % 2:
                self.mask[i, :3] = 0
                self.labels[i, :4] = -100  # the pads, and the first real token (predicted by a pad)
            if i % 4 == 2:
                self.mask[i, -4:] = 0
                self.labels[i, -4:] = -100
        self.labels[:, ::7] = -100

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def reference_loader(world: int, rank: int, size: int, shuffle: bool = True) -> DataLoader:
    """What the ranks of a ``size``-way run read, for a run without sequence parallelism: its group's batches
    (``shuffle``: as the Trainer's sampler for training, Fabric's does not)."""
    sampler = DistributedSampler(TokenData(), num_replicas=world // size, rank=rank // size, shuffle=shuffle,
                                 seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
    return DataLoader(TokenData(), batch_size=BATCH, sampler=sampler)


# ------------------------------------------------------------------------------------------------ the models
def hf_model(kind: str, attention: str = "sdpa") -> nn.Module:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=64)
    families = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
                "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),  # < 30: a window
                "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
                "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 2, "sliding_window": None})}
    if kind in families:
        config_name, model_name, extra = families[kind]
        config = getattr(transformers, config_name)(**shape, **extra)
        config._attn_implementation = attention
        return getattr(transformers, model_name)(config)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                        embd_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = attention
    return GPT2LMHeadModel(config)


class CoreAttention(nn.Module):
    """The user's own attention: causal scaled dot-product attention over (batch, heads, sequence, head size)."""

    num_heads = 4

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attention = CoreAttention()
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(self.attention(q, k, v).transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(x)


class OwnLM(nn.Module):
    """A causal language model of the user's own: learned positions (given the global ones), two blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.position = nn.Embedding(VOCAB, 64), nn.Embedding(64, 64)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LM(L.LightningModule):
    """A Hugging Face causal LM (its own loss) or ``OwnLM`` (``causal_lm_loss``), built in ``configure_model``."""

    def __init__(self, kind: str, attention: str = "sdpa", checkpointing: bool = False, lr: float = 0.05,
                 adam: bool = False) -> None:
        super().__init__()
        self.kind, self.attention, self.checkpointing, self.lr, self.adam = kind, attention, checkpointing, lr, adam
        self.model: nn.Module | None = None
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.start_weights: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = OwnLM() if self.kind == "own" else hf_model(self.kind, self.attention)
        if self.checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        assert self.model is not None
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        if self.kind == "own":
            part = batch["input_ids"].shape[1]
            start = self.trainer.strategy.sequence_parallel.groups.rank * part if isinstance(
                self.trainer.strategy, HPUDeepSpeedStrategy) and self.trainer.strategy.sequence_parallel.enabled else 0
            positions = torch.arange(start, start + part).unsqueeze(0)
            loss = causal_lm_loss(self.model(batch["input_ids"], positions), batch["labels"])
        else:
            loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.adam:  # states to reshard (DeepSpeed's universal checkpoint expects Adam's); a large eps keeps
            # Adam from blowing up float rounding in gradients near zero into differences of a learning rate
            return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-2)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Probe(L.Callback):
    """The full gradients before the first step, and the full weights when training starts (after a resume)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: LM) -> None:
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {}
        for name, param in pl_module.named_parameters():
            full = safe_get_full_fp32_param(param)  # None at stage 0: the parameter itself
            weights[name] = (full if full is not None else param).detach().float().clone()
        pl_module.start_weights = weights

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: LM, optimizer: Any) -> None:
        if pl_module.grads:
            return
        from deepspeed.utils import safe_get_full_grad

        pl_module.grads = {n: safe_get_full_grad(p).detach().float().clone() for n, p in pl_module.named_parameters()}


def fit(module: LM, *, devices: int, stage: int, size: int, reference_for: int = 0, steps: int = 1,
        precision: str = "32-true", ckpt_path: str | None = None, **strategy: Any) -> L.Trainer:
    """One fit; ``reference_for=K``: without sequence parallelism, on the batches of a ``K``-way run."""
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=HPUDeepSpeedStrategy(stage=stage, sequence_parallel_size=size,
                                                                          **strategy),
        precision=precision, max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Probe()],
        use_distributed_sampler=not reference_for,
    )
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    loader = reference_loader(devices, rank, reference_for) if reference_for else DataLoader(TokenData(),
                                                                                            batch_size=BATCH)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def same_in_groups(value: float, size: int) -> bool:
    """Whether every rank of each group of ``size`` consecutive ranks has the same ``value``."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(values[r] == values[r - r % size] for r in range(len(values)))


def grad_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return (max(float((a[n] - b[n]).abs().max()) for n in a), max(float(b[n].abs().max()) for n in b))


# ------------------------------------------------------------------------------------------------ the plans
def plan_grads(devices: int, out: dict[str, Any]) -> None:
    # every model and stage with K = devices; on 4 ranks also K = 2 (two groups, data parallel across them) for
    # two of them; on 2 ranks also ZeRO-0 and ZeRO-1 once
    cases = [(kind, stage, devices) for kind in ("llama", "gpt2") for stage in (2, 3)] + [("own", 2, devices)]
    cases += ([("llama", 0, 2), ("llama", 1, 2), ("mistral", 2, 2), ("qwen2", 2, 2), ("mixtral", 2, 2)]
              if devices == 2 else [("llama", 2, 2), ("gpt2", 3, 2)])
    for kind, stage, size in cases:
        reference = LM(kind)
        fit(reference, devices=devices, stage=stage, size=1, reference_for=size)
        module = LM(kind)
        trainer = fit(module, devices=devices, stage=stage, size=size,
                      sequence_parallel_modules=[CoreAttention] if kind == "own" else None)
        diff, scale = grad_difference(module.grads, reference.grads)
        out[f"grads/{kind}/z{stage}/k{size}"] = {
            "loss": module.losses[0], "reference_loss": reference.losses[0], "grad_diff": diff,
            "grad_scale": scale, "same_loss_in_group": same_in_groups(module.losses[0], size),
            "sampler": trainer.strategy.distributed_sampler_kwargs,
        }


def plan_train(devices: int, out: dict[str, Any]) -> None:
    size = devices
    # activation checkpointing (transformers' gradient checkpointing: attention recomputed in backward), fp32 exact
    reference, module = LM("llama", checkpointing=True), LM("llama", checkpointing=True)
    fit(reference, devices=devices, stage=3, size=1, reference_for=size)
    fit(module, devices=devices, stage=3, size=size)
    diff, scale = grad_difference(module.grads, reference.grads)
    out["train/checkpointing"] = {"loss": module.losses[0], "reference_loss": reference.losses[0],
                                  "grad_diff": diff, "grad_scale": scale}
    # trainer.validate (ZeRO-3's evaluation engine): the same validation loss as without sequence parallelism
    losses = {}
    for k in (1, size):
        trainer = L.Trainer(accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=k > 1,
                            strategy=HPUDeepSpeedStrategy(stage=3, sequence_parallel_size=k))
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        loader = DataLoader(TokenData(), batch_size=BATCH) if k > 1 else reference_loader(devices, rank, size, False)
        losses[k] = trainer.validate(LM("llama"), loader, verbose=False)[0]["val_loss"]
    out["train/validate"] = {"loss": losses[size], "reference_loss": losses[1]}
    # bf16: a few steps, compared with the same steps without sequence parallelism
    for kind in ("llama", "gpt2"):
        reference, module = LM(kind, lr=0.5), LM(kind, lr=0.5)
        fit(reference, devices=devices, stage=2, size=1, reference_for=size, steps=3, precision="bf16-mixed")
        fit(module, devices=devices, stage=2, size=size, steps=3, precision="bf16-mixed")
        out[f"train/bf16/{kind}"] = {"losses": module.losses, "reference_losses": reference.losses,
                                     "same_loss_in_group": same_in_groups(module.losses[-1], size)}


def plan_fabric(devices: int, out: dict[str, Any]) -> None:
    from lightning.fabric import Fabric

    from lightning_gaudi_ds.fabric import HPUDeepSpeedStrategy as FabricStrategy

    results = {}
    for size in (1, devices):
        fabric = Fabric(accelerator="cpu", devices=devices, precision="32-true",
                        strategy=FabricStrategy(stage=3, sequence_parallel_size=size))
        fabric.launch()
        with fabric.init_module():
            model = hf_model("llama")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = fabric.setup(model, optimizer)
        if size == 1:  # every rank the batches of the K-way run's group
            loader = fabric.setup_dataloaders(reference_loader(devices, fabric.global_rank, devices, shuffle=False),
                                              use_distributed_sampler=False)
        else:
            loader = fabric.setup_dataloaders(DataLoader(TokenData(), batch_size=BATCH))
        losses = []
        for step, batch in enumerate(loader):
            loss = model(**batch).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            if step == 1:
                break
        results[size] = {"losses": losses, "batch_length": int(batch["input_ids"].shape[1]),
                         "sampler": fabric.strategy.distributed_sampler_kwargs}
        fabric.strategy.teardown()
    out["fabric"] = {"losses": results[devices]["losses"], "reference_losses": results[1]["losses"],
                     "batch_length": results[devices]["batch_length"], "sampler": results[devices]["sampler"],
                     "same_loss_in_group": same_in_groups(results[devices]["losses"][-1], devices)}


def plan_checkpoint(devices: int, out: dict[str, Any], folder: Path, load: str | None) -> None:
    def weights(module: LM) -> dict[str, torch.Tensor]:
        return {n: t for n, t in module.start_weights.items()}

    if load is None:  # write: 2 steps at K = 2 and at K = 1, each saved
        trained = {}
        for size in (devices, 1):
            module = LM("llama", lr=0.01, adam=True)
            trainer = fit(module, devices=devices, stage=3, size=size, steps=2,
                          reference_for=devices if size == 1 else 0)
            trainer.save_checkpoint(folder / f"k{size}.ckpt")
            probe = LM("llama", lr=0.01, adam=True)  # the weights after 2 steps: a resume reads them
            fit(probe, devices=devices, stage=3, size=size, steps=3, ckpt_path=str(folder / f"k{size}.ckpt"),
                reference_for=devices if size == 1 else 0)
            trained[size] = weights(probe)
        if dist.get_rank() == 0:
            torch.save(trained[1], folder / "k1_weights.pt")
        # the K-way checkpoint resumed at K = 1: the same weights as the K = 1 run's
        resumed = LM("llama", lr=0.01, adam=True)
        fit(resumed, devices=devices, stage=3, size=1, steps=3, ckpt_path=str(folder / f"k{devices}.ckpt"),
            reference_for=devices)
        out["checkpoint"] = {
            "trained_diff": max(float((trained[devices][n] - trained[1][n]).abs().max()) for n in trained[1]),
            "resumed_k1_diff": max(float((resumed.start_weights[n] - trained[1][n]).abs().max())
                                   for n in trained[1]),
            "scale": max(float(t.abs().max()) for t in trained[1].values()),
        }
        return
    # another world size: the K-way checkpoint of --load (another job), at K = 2 and at K = 1
    reference = torch.load(Path(load).parent / "k1_weights.pt")
    for size in (2, 1):
        module = LM("llama", lr=0.01, adam=True)
        fit(module, devices=devices, stage=3, size=size, steps=3, ckpt_path=load, reference_for=2 if size == 1 else 0)
        out[f"checkpoint/load/k{size}"] = {"diff": max(float((module.start_weights[n] - reference[n]).abs().max())
                                                       for n in reference), "losses": module.losses}


def plan_errors(devices: int, out: dict[str, Any]) -> None:
    def refused(make: Any) -> dict[str, str] | None:
        try:
            make()
        except Exception as err:  # noqa: BLE001 - recorded for the test
            return {"type": type(err).__name__, "message": str(err)}
        return None

    def no_attention() -> None:
        class Plain(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Linear(4, 4)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                return self.net(batch[0]).sum()

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=HPUDeepSpeedStrategy(
            stage=2, sequence_parallel_size=devices), max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Plain(), DataLoader([(torch.randn(4, 4),)] * 4, batch_size=None))

    def predict() -> None:
        trainer = L.Trainer(accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False,
                            strategy=HPUDeepSpeedStrategy(stage=2, sequence_parallel_size=devices))
        trainer.predict(LM("llama"), DataLoader(TokenData(), batch_size=BATCH))

    def heads() -> None:
        module = LM("gpt2")
        module.configure_model()
        module.model.config.num_attention_heads = 3  # the head count the check reads
        fit(module, devices=devices, stage=2, size=devices)

    out["errors"] = {"no_attention": refused(no_attention), "predict": refused(predict), "heads": refused(heads)}


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--plan", nargs="+", default=["grads"])
    parser.add_argument("--load", default=None, help="plan checkpoint: a K-way checkpoint saved on another world")
    args = parser.parse_args()
    start_process()
    out: dict[str, Any] = {}
    folder = Path(args.out)
    plans = {"grads": plan_grads, "train": plan_train, "fabric": plan_fabric, "errors": plan_errors}
    for name in args.plan:
        try:
            if name == "checkpoint":
                plan_checkpoint(args.devices, out, folder, args.load)
            else:
                plans[name](args.devices, out)
        except Exception:
            traceback.print_exc()
            raise
    write_result(folder, int(os.environ.get("LOCAL_RANK", "0")), {"devices": args.devices, "out": str(folder), **out})


if __name__ == "__main__":
    main()
