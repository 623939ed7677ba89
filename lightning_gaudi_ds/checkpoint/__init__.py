"""Sharded ZeRO checkpoints: validation and crash-safe saves (``io``), their full weights in memory (``read``),
world-size changes (``reshard``), and one fp32 file for plain PyTorch (``convert``). Nothing here knows the
strategy: it passes plain values and an object with rank 0's ``broadcast``.
"""

from lightning_gaudi_ds.checkpoint.convert import convert_zero_checkpoint_to_fp32_state_dict, read_fp32_checkpoint
from lightning_gaudi_ds.checkpoint.export import export_hf, export_safetensors
from lightning_gaudi_ds.checkpoint.io import (
    MANIFEST,
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
    commit_save,
    on_rank_zero,
    partial_path,
    prepare_save,
    remove_checkpoint,
    save,
    validate_checkpoint,
    verify_checkpoint,
    verify_files,
)
from lightning_gaudi_ds.checkpoint.read import read_full_checkpoint
from lightning_gaudi_ds.checkpoint.reshard import (
    UNIVERSAL,
    load_checkpoint,
    load_fp32_weights,
    load_resharded,
    universal_checkpoint,
)

__all__ = [
    "MANIFEST",
    "UNIVERSAL",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "NotACheckpointError",
    "UnsafeCheckpointError",
    "commit_save",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "export_hf",
    "export_safetensors",
    "load_checkpoint",
    "load_fp32_weights",
    "load_resharded",
    "on_rank_zero",
    "partial_path",
    "prepare_save",
    "read_fp32_checkpoint",
    "read_full_checkpoint",
    "remove_checkpoint",
    "save",
    "universal_checkpoint",
    "validate_checkpoint",
    "verify_checkpoint",
    "verify_files",
]
