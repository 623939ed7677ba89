"""One fp32 Lightning checkpoint file from a sharded ZeRO checkpoint; also ``lightning-gaudi-ds convert``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from lightning_gaudi_ds.checkpoint.io import (
    PARTIAL,
    CheckpointError,
    PathLike,
    validate_checkpoint,
    verify_checkpoint,
)
from lightning_gaudi_ds.checkpoint.read import read_full_checkpoint

TRUST_FLAG = "--trust-pickles"
_OPT_IN = f"pass `weights_only=False` (`lightning-gaudi-ds convert {TRUST_FLAG}`)"


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: PathLike, output_file: PathLike, tag: str | None = None, overwrite: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Merge a sharded ZeRO checkpoint (stage 0-3, any world size) into one fp32 Lightning checkpoint file.

    The file loads without DeepSpeed: ``Model.load_from_checkpoint(output_file)`` or
    ``model.load_state_dict(torch.load(output_file)["state_dict"], strict=True)``. It keeps the Lightning
    state (epoch, global step, hyper-parameters, loops, callbacks) but no optimizer state.

    The file holds what Lightning's function of the same name (2.6.6) writes (DeepSpeed's ``zero_to_fp32`` merges
    the weights; the Lightning state keeps the keys Lightning's keeps), read by
    :func:`~lightning_gaudi_ds.checkpoint.read.read_full_checkpoint` after the checkpoint is validated (a missing,
    partial or foreign directory gets an error that says what to pass instead). Unlike Lightning's, this one:

    * converts stage 0 too (Lightning's reads the ZeRO optimizer shards, which stage 0 does not write);
    * reads the Lightning state from ``tag`` (Lightning's always reads the ``latest`` tag's);
    * writes ``output_file`` atomically (a ``.partial`` file renamed into place, removed if the conversion fails)
      and creates its folder; refuses an ``output_file`` that is a directory or inside the checkpoint, and an
      existing file unless ``overwrite`` (True, as in Lightning; ``lightning-gaudi-ds convert`` asks for
      ``--overwrite``).

    Frozen parameters are merged when the checkpoint holds them; a checkpoint saved with
    ``exclude_frozen_parameters=True`` converts without them, as in Lightning.

    ``weights_only`` (None: torch's default, True) reads every file of the checkpoint through torch's safe
    unpickler first, which builds tensors, builtins and DeepSpeed's few checkpoint classes only, and refuses
    anything else with an :class:`~lightning_gaudi_ds.checkpoint.UnsafeCheckpointError` before the merge reads it.
    Pass False only for a checkpoint from a trusted source.
    """
    info = validate_checkpoint(checkpoint_dir, tag=tag, weights_only=weights_only, opt_in=_OPT_IN)
    verify_checkpoint(info.path, weights_only, _OPT_IN)
    output_file = Path(output_file)
    check_output(info.path, output_file, overwrite, "model.pt")
    created = [p for p in (output_file.parent, *output_file.parent.parents) if not p.exists()]
    output_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_file.with_name(output_file.name + PARTIAL)
    try:
        checkpoint = read_full_checkpoint(info.path, info.tag, weights_only, _OPT_IN, info=info)
        torch.save(checkpoint, tmp)
        os.replace(tmp, output_file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        for folder in created:  # innermost first: only the folders this call made, and only if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return checkpoint


def check_output(checkpoint: Path, output: Path, overwrite: bool, file_example: str | None = None) -> None:
    """Refuse an output inside the checkpoint or holding it, or one that exists unless ``overwrite``; with
    ``file_example`` (a file name such as ``"model.pt"``) the output is a file, and a directory is refused too."""
    out, ckpt = output.resolve(), checkpoint.resolve()
    if out in ckpt.parents:  # checked first: with --overwrite, a folder that holds the input is no output either
        example = output / (file_example or "hf_model")
        raise CheckpointError(f"output {str(output)!r} holds the checkpoint {str(checkpoint)!r} that is read; write"
                              f" to a new {'file' if file_example else 'folder'} instead, e.g. {str(example)!r}.")
    if out == ckpt or ckpt in out.parents:
        where = f"the fp32 file elsewhere, e.g. {file_example!r}" if file_example else "it elsewhere"
        raise CheckpointError(f"output {str(output)!r} is inside the checkpoint {str(checkpoint)!r}; write {where}.")
    if file_example and output.is_dir():
        raise CheckpointError(f"output {str(output)!r} is a directory; pass a file name, e.g."
                              f" {str(output / file_example)!r}.")
    if output.exists() and not overwrite:
        raise CheckpointError(f"output {str(output)!r} exists; pass --overwrite to replace it, or another name.")


def read_fp32_checkpoint(
    checkpoint_dir: PathLike, tag: str | None = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """In memory, what :func:`convert_zero_checkpoint_to_fp32_state_dict` writes
    (:func:`~lightning_gaudi_ds.checkpoint.read.read_full_checkpoint`, with the CLI's opt-in in its errors)."""
    return read_full_checkpoint(checkpoint_dir, tag, weights_only, _OPT_IN)


# ------------------------------------------------------------------------------------------------ CLI
