"""Fine-tune a pretrained Hugging Face causal LM under DeepSpeed ZeRO-3, then export it back to Hugging Face.

    python examples/finetune_hf.py fit --config examples/configs/hf/zero3_finetune.yaml
    python examples/finetune_hf.py fit --config examples/configs/hf/zero3_finetune.yaml \
        --model.pretrained meta-llama/Llama-3.2-1B          # on a machine that reaches the Hub

``--model.pretrained`` is anything ``from_pretrained`` takes: a Hub name or a local directory. Its default,
``runs/finetune_hf/tiny-llama``, is a tiny Llama (and a byte-level tokenizer) that this script makes itself the
first time (seeded, so every rank makes the same one): nothing is downloaded. The model is loaded in
``configure_model``, which under ZeRO-3 runs inside DeepSpeed's partitioned construction: transformers then loads
the weights straight into each rank's partitions, no rank holding the whole model. The text is *Pride and
Prejudice* (examples/data). After ``fit`` every rank saves its shard of the checkpoint, and rank 0 exports it to a
``from_pretrained`` directory (config, safetensors, tokenizer), the same as::

    lightning-gaudi-ds convert runs/finetune_hf/.../checkpoints/last.ckpt OUT --to hf

then loads that directory with ``AutoModelForCausalLM.from_pretrained`` and prints a sample from it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

import lightning_gaudi_ds  # noqa: F401  (registers the hpu_deepspeed* strategy names and the "hpu" accelerator)
from lightning_gaudi_ds import LightningCLI, export_hf

TINY = "runs/finetune_hf/tiny-llama"
DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice.txt"


# ------------------------------------------------------------------------------------- the tiny "pretrained" model
def make_tiny_pretrained(folder: str | Path) -> Path:
    """A 4-layer Llama (hidden 128) and a byte-level tokenizer, saved with ``save_pretrained`` (once; every rank
    makes the same files, and the first to finish moves its copy into place)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte symbols
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer, tok.decoder = byte_level, decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True)
    work = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(work)
    tokenizer.save_pretrained(work)
    try:
        os.replace(work, folder)
    except OSError:  # another rank was first
        shutil.rmtree(work, ignore_errors=True)
    return folder


# ------------------------------------------------------------------------------------------------ data
class TokenBlocks(Dataset):
    def __init__(self, ids: Tensor, block_size: int) -> None:
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i: int) -> Tensor:
        return self.ids[i * self.block_size:(i + 1) * self.block_size]


class TextData(L.LightningDataModule):
    def __init__(self, text: str = str(DEFAULT_TEXT), block_size: int = 64, batch_size: int = 8,
                 max_chars: int = 200_000) -> None:
        super().__init__()
        self.text, self.block_size, self.batch_size, self.max_chars = text, block_size, batch_size, max_chars

    def train_dataloader(self) -> DataLoader:
        tokenizer = self.trainer.lightning_module.tokenizer
        ids = torch.tensor(tokenizer(Path(self.text).read_text(encoding="utf-8")[:self.max_chars])["input_ids"])
        return DataLoader(TokenBlocks(ids, self.block_size), batch_size=self.batch_size, shuffle=True)


# ------------------------------------------------------------------------------------------------ model
class HFCausalLM(L.LightningModule):
    """A Hugging Face causal LM for LightningCLI (``--model.*``), loaded in ``configure_model``.

    Args:
        pretrained: a Hub name or a local directory; the default is the tiny model this script makes.
        dtype: the dtype ``from_pretrained`` loads in (``"bfloat16"`` with ``precision: bf16-true``); default fp32,
            the master weights of ``bf16-mixed``.
    """

    def __init__(self, pretrained: str = TINY, lr: float = 1e-3, dtype: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoTokenizer

        if pretrained == TINY:
            make_tiny_pretrained(TINY)
        self.tokenizer = AutoTokenizer.from_pretrained(pretrained)  # recorded in checkpoints, exported with --to hf
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, self.hparams.dtype) if self.hparams.dtype else None
        self.model = AutoModelForCausalLM.from_pretrained(self.hparams.pretrained, dtype=dtype)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


# ---------------------------------------------------------------------------------------------------- CLI
class FineTuneCLI(LightningCLI):
    """LightningCLI that saves a checkpoint after ``fit`` and exports it as a Hugging Face directory."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--export_dir", type=Optional[str], default=None,
                            help="where to write the Hugging Face model (default: <log dir>/hf)")

    def after_fit(self) -> None:
        trainer = self.trainer
        root = Path(trainer.log_dir or trainer.default_root_dir)  # broadcast from rank 0
        checkpoint = root / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(checkpoint, weights_only=False)  # every rank writes its shard, optimizer too
        if not trainer.is_global_zero:
            return
        out = Path(self.config.fit.export_dir or root / "hf")
        export_hf(checkpoint, out, overwrite=True)  # = lightning-gaudi-ds convert CKPT OUT --to hf --overwrite
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(out)
        ids = tokenizer("Elizabeth", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            sample = model.eval().generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        problems = {k: v for k, v in info.items() if v}
        print(f"finetune_hf: checkpoint {checkpoint}\nfinetune_hf: exported {out}"
              f" ({', '.join(sorted(p.name for p in out.iterdir()))}); from_pretrained:"
              f" {problems or 'no missing or unexpected keys'}\nfinetune_hf sample: {tokenizer.decode(sample[0])!r}",
              flush=True)


def main(args: Optional[list[str]] = None) -> None:
    warnings.filterwarnings("ignore", message=".*`tensorboardX` has been removed as a dependency.*")
    with warnings.catch_warnings():  # for this run only
        # Lightning 2.6's CombinedLoader builds torch's deprecated LeafSpec at every fit/validate: nothing to act on
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        FineTuneCLI(HFCausalLM, TextData, seed_everything_default=42, args=args)


if __name__ == "__main__":
    main()
