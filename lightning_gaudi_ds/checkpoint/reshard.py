"""Loading a checkpoint written by another number of ranks.

DeepSpeed's own loader refuses a different data-parallel world size. For training, the checkpoint is converted
once (by rank 0) into DeepSpeed's universal form, which every rank re-partitions on load: weights *and*
optimizer state. For evaluation, the weights are merged to fp32 by ``zero_to_fp32`` instead: an inference engine
has no optimizer for the universal loader to fill.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.nn import Module

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds.checkpoint.io import (
    PARTIAL,
    TRAINER_OPT_IN,
    CheckpointError,
    CheckpointInfo,
    PathLike,
    RankZeroComm,
    _rmtree,
    deepspeed_types_allowed,
    on_rank_zero,
    resolve_weights_only,
    validate_checkpoint,
    verify_checkpoint,
)
from lightning_gaudi_ds.checkpoint.read import read_full_checkpoint

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from lightning.pytorch import LightningModule

log = logging.getLogger(__name__)

UNIVERSAL = "universal"  # sub-directory of a checkpoint: its universal form, made for a world-size change


class ReshardComm(RankZeroComm, Protocol):
    """What resharding needs from the running job: its size, and rank 0's broadcast (Lightning's strategies)."""

    @property
    def world_size(self) -> int: ...


def universal_checkpoint(info: CheckpointInfo, comm: RankZeroComm) -> Path:
    """DeepSpeed universal form of ``info`` (made once, by rank 0, into ``<checkpoint>/universal``).

    Loadable on any number of ranks with the ``load_universal_checkpoint`` engine option; returns its root.
    """
    root = info.path / UNIVERSAL

    def convert() -> None:
        if (root / "latest_universal").is_file():
            return
        work = root.with_name(UNIVERSAL + PARTIAL)
        _rmtree(work)
        log.info("Converting %s (%d ranks) to a universal checkpoint in %s", info.path, info.world_size, root)
        _compat.ds_to_universal(info.tag_dir, work / info.tag)
        _rmtree(root)
        os.replace(work, root)

    on_rank_zero(comm, f"Converting {info.path} to a DeepSpeed universal checkpoint", convert)
    return root


def load_resharded(
    info: CheckpointInfo, comm: ReshardComm, engine: DeepSpeedEngine | None, module: Module, *, fitting: bool,
    strict: bool = True, weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load ``info``, written by another number of ranks, into ``engine``; return the client (Lightning) state.

    Args:
        info: the checkpoint, validated against the running ZeRO stage (``validate_checkpoint(zero_stage=...)``).
        comm: the running job (world size, rank 0, broadcast).
        engine: the DeepSpeed engine built for this run.
        module: the module the engine wraps.
        fitting: restore the optimizer state too (needs an engine with an optimizer).
        strict: the module's ``strict_loading``.
        weights_only: Lightning's switch, for the files read here (see :func:`load_checkpoint`).
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    rank_zero_info(
        f"Checkpoint {info.path} was saved by {info.world_size} ranks and is loaded on {comm.world_size}:"
        " resharding it."
    )
    if fitting and engine is not None and getattr(engine, "optimizer", None) is not None:
        root = universal_checkpoint(info, comm)
        with _compat.universal_checkpoint_loading(engine):
            _, client_state = engine.load_checkpoint(
                str(root), tag=info.tag, load_optimizer_states=True, load_lr_scheduler_states=False,
                load_module_strict=strict,
            )
    else:
        client_state = load_fp32_weights(info, comm, module, strict, weights_only)
    if client_state is None:
        raise CheckpointError(f"DeepSpeed could not load the resharded checkpoint {info.path}.")
    return client_state


def load_fp32_weights(
    info: CheckpointInfo, comm: RankZeroComm, module: Module, strict: bool = True, weights_only: bool | None = None
) -> dict[str, Any]:
    """Weights of ``info`` merged to fp32 and copied into the (possibly ZeRO-3 partitioned) module, from any number
    of ranks; returns the checkpoint :func:`~lightning_gaudi_ds.checkpoint.read.read_full_checkpoint` reads. Needs
    no optimizer: what an evaluation engine can load. ``info`` was validated and verified by the caller
    (:func:`load_checkpoint`)."""
    checkpoint = read_full_checkpoint(info.path, info.tag, weights_only, info=info)
    state_dict = checkpoint["state_dict"]
    if info.zero_stage == 3:  # the module's parameters are partitions: gather, load on rank 0, re-partition
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            if comm.is_global_zero:
                module.load_state_dict(state_dict, strict=strict)
    else:
        with torch.no_grad():
            module.load_state_dict(state_dict, strict=strict)
    return checkpoint


def load_checkpoint(
    path: PathLike, comm: ReshardComm, *, zero_stage: int, module: LightningModule | Module | None,
    fitting: bool | None,
    engine: DeepSpeedEngine | None, deepspeed_load: Callable[[], dict[str, Any]], weights_only: bool | None = None,
    strict: bool | None = None, opt_in: str = TRAINER_OPT_IN,
) -> dict[str, Any]:
    """Validate the ZeRO checkpoint at ``path`` against the running ``zero_stage``, then load it the way the run
    allows; returns the client (Lightning) state.

    An evaluation engine at ZeRO-3 (``fitting`` False) gets the merged fp32 weights: DeepSpeed's loader ends by
    restoring an optimizer's fp32 partitions from the weights, which an evaluation engine has none of
    ("'DeepSpeedZeRoOffload' object has no attribute '_restore_from_bit16_weights'"). The same world size (or
    stage 0) goes through ``deepspeed_load``, DeepSpeed's own loader; another world size is resharded.

    Args:
        comm: the running job (world size, rank 0, broadcast).
        module: the LightningModule (under Fabric, the module the engine wraps), if any.
        fitting: whether the attached Trainer fits; None when no Trainer is attached.
        engine: the DeepSpeed engine built for this run.
        weights_only: Lightning's switch (``trainer.fit(..., weights_only=...)``); None is torch's default (True).
            When it resolves to True, every ``*.pt`` file of the checkpoint is first read through torch's safe
            unpickler (DeepSpeed's own readers and ``zero_to_fp32`` cannot be told ``weights_only``), and a file
            holding anything but tensors, builtins and DeepSpeed's few checkpoint classes is refused with an
            :class:`~lightning_gaudi_ds.checkpoint.UnsafeCheckpointError` before anything else reads it.
        strict: whether the module's keys must match (default: the LightningModule's ``strict_loading``).
        opt_in: how the error for an unsafe checkpoint tells the user to opt in (Trainer or Fabric wording).
    """
    info = validate_checkpoint(path, zero_stage=zero_stage, weights_only=weights_only, opt_in=opt_in)
    verify_checkpoint(info.path, weights_only, opt_in)
    if strict is None:
        strict = bool(getattr(module, "strict_loading", True))
    # DeepSpeed's readers pass weights_only=False, which TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 overrides: allow its types
    with deepspeed_types_allowed() if resolve_weights_only(weights_only) else contextlib.nullcontext():
        if zero_stage == 3 and module is not None and fitting is False:
            return load_fp32_weights(info, comm, module, strict=bool(strict), weights_only=weights_only)
        if info.world_size == comm.world_size or info.zero_stage == 0:
            state = deepspeed_load()
        else:
            assert module is not None
            if fitting is None:  # no Trainer attached: Lightning's own error
                fitting = module.trainer.state.fn == "fit"  # type: ignore[union-attr]
            state = load_resharded(info, comm, engine, module, fitting=fitting, strict=bool(strict),
                                   weights_only=weights_only)
        _compat.drop_hpz_secondary_partitions(engine)  # ZeRO++ hpZ: gather the loaded weights, not the old copy
        return state
