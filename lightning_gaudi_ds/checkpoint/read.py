"""The full weights of a sharded ZeRO checkpoint, in memory: the one reader behind serving (``ckpt_path=`` with
tensor parallelism), resharding for evaluation, and ``lightning-gaudi-ds convert``."""

from __future__ import annotations

import contextlib
from typing import Any

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds.checkpoint.io import (
    TRAINER_OPT_IN,
    CheckpointInfo,
    PathLike,
    deepspeed_types_allowed,
    load_file,
    resolve_weights_only,
    validate_checkpoint,
    verify_checkpoint,
)


def read_full_checkpoint(
    checkpoint_dir: PathLike, tag: str | None = None, weights_only: bool | None = None, opt_in: str = TRAINER_OPT_IN,
    *, info: CheckpointInfo | None = None,
) -> dict[str, Any]:
    """The Lightning state of ``tag`` with ``"state_dict"``: the module's weights merged to fp32 (DeepSpeed's
    ``zero_to_fp32`` for stages 1-3; stage 0's whole weights cast), from a checkpoint of any world size.

    The Lightning state is the rank-0 model-states file without the DeepSpeed keys Lightning's own converter drops,
    so the dict is what ``convert_zero_checkpoint_to_fp32_state_dict`` writes.

    Args:
        checkpoint_dir: the checkpoint directory; validated (:func:`~lightning_gaudi_ds.checkpoint.validate_checkpoint`:
            an unfinished or truncated save is refused by name) unless ``info`` is given.
        tag: the tag to read (default: the manifest's or ``latest``).
        weights_only: as in ``torch.load`` (None: torch's default, True); when it resolves to True every file is
            first read through torch's safe unpickler (:func:`~lightning_gaudi_ds.checkpoint.verify_checkpoint`).
        opt_in: how to load a trusted file anyway, for the error message.
        info: a checkpoint already validated and verified by the caller.
    """
    if info is None:
        info = validate_checkpoint(checkpoint_dir, tag=tag, weights_only=weights_only, opt_in=opt_in)
        verify_checkpoint(info.path, weights_only, opt_in)
    model_states = load_file(info.tag_dir / _compat.model_states_name(info.zero_stage, 0), weights_only, opt_in)
    if info.zero_stage == 0:
        weights = {k: v.float() if v.is_floating_point() else v for k, v in model_states["module"].items()}
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # zero_to_fp32 passes weights_only=False, which TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 overrides: allow its types
        with deepspeed_types_allowed() if resolve_weights_only(weights_only) else contextlib.nullcontext():
            weights = get_fp32_state_dict_from_zero_checkpoint(str(info.path), info.tag)
    checkpoint = {k: v for k, v in model_states.items() if k not in _compat.LIGHTNING_CONVERTER_DROPPED_KEYS}
    # Lightning < 2.1 saved the weights under its wrapper's name, as Lightning's converter strips too
    checkpoint["state_dict"] = {k.removeprefix("_forward_module."): v for k, v in weights.items()}
    return checkpoint
