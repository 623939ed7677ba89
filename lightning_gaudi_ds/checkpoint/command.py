"""``lightning-gaudi-ds convert``: a sharded ZeRO checkpoint to one fp32 file
(:mod:`~lightning_gaudi_ds.checkpoint.convert`), a Hugging Face ``from_pretrained`` directory or one safetensors
file (:mod:`~lightning_gaudi_ds.checkpoint.export`)."""

from __future__ import annotations

import argparse

from lightning_gaudi_ds.checkpoint import convert, export
from lightning_gaudi_ds.checkpoint.convert import TRUST_FLAG
from lightning_gaudi_ds.errors import CheckpointError, ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="DeepSpeed checkpoint directory (e.g. 'epoch=0-step=100.ckpt')")
    parser.add_argument("output_file", help="file to write (a directory with --to hf)")
    parser.add_argument("--to", choices=("pt", "hf", "safetensors"), default="pt",
                        help="pt: one fp32 Lightning checkpoint file (default); hf: a Hugging Face model directory"
                             " for from_pretrained; safetensors: the module's fp32 state dict as one file")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in the manifest or `latest`)")
    parser.add_argument("--overwrite", action="store_true", help="replace output_file if it exists")
    parser.add_argument("--module", default=None,
                        help="--to hf: the model's attribute in the LightningModule, when it holds several")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="--to hf: largest safetensors shard, a number and KB, MB, GB or TB (default 5GB)")
    parser.add_argument("--merge-adapters", action="store_true",
                        help="--to hf, a PEFT model: write the model with its adapters merged, not the adapters")
    parser.add_argument(TRUST_FLAG, action="store_true",
                        help="load the checkpoint with Python's full unpickler (weights_only=False), which can run"
                             " code stored in the files: only for checkpoints from a trusted source. Without it,"
                             " anything but tensors and DeepSpeed's checkpoint classes is refused")


def run(args: argparse.Namespace) -> int:
    try:
        weights_only = not args.trust_pickles
        if args.to == "hf":
            folder = export.export_hf(args.checkpoint_dir, args.output_file, tag=args.tag, module=args.module,
                                      max_shard_size=args.max_shard_size, merge_adapters=args.merge_adapters,
                                      overwrite=args.overwrite, weights_only=weights_only)
            print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
            return 0
        if args.to == "safetensors":
            state = export.export_safetensors(args.checkpoint_dir, args.output_file, tag=args.tag,
                                              overwrite=args.overwrite, weights_only=weights_only)
        else:
            state = convert.convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag,
                                                                       overwrite=args.overwrite,
                                                                       weights_only=weights_only)["state_dict"]
    except (CheckpointError, ConfigError) as err:
        print(f"error: {err}")
        return 2
    except OSError as err:  # an output folder that cannot be created or written
        print(f"error: writing {args.output_file}: {err.strerror or err}")
        return 2
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {args.output_file}: {len(state)} tensors, {numel:,} values (fp32)")
    return 0
