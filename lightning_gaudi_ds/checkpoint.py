"""Sharded ZeRO checkpoints: validation, crash-safe saves, world-size changes and fp32 export.

A checkpoint is the directory DeepSpeed writes (``latest``, ``<tag>/`` with ``*_model_states.pt`` and one
``*_optim_states.pt`` shard per data-parallel rank). :class:`~lightning_gaudi_ds.HPUDeepSpeedStrategy` saves
it into ``<name>.partial`` next to its final place, waits until every rank has written, adds a manifest
(``lightning_gaudi_ds_manifest.json``: every file and its size, stage, world size) and only then moves it
into place. A directory without a manifest or with a file missing is reported as incomplete, by name.

Also the ``lightning-gaudi-ds convert CHECKPOINT_DIR OUTPUT_FILE [--tag T]`` subcommand.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.types import _PATH

log = logging.getLogger(__name__)

MANIFEST = "lightning_gaudi_ds_manifest.json"
PARTIAL = ".partial"  # a save in progress, or one that was interrupted
REPLACED = ".replaced"  # the previous checkpoint of the same name, while the new one is moved into place
DELETING = ".deleting"  # a checkpoint being removed (top-k rotation)
UNIVERSAL = "universal"  # sub-directory: DeepSpeed universal checkpoint made for a world-size change
_FORMAT = 1


class CheckpointError(ValueError):
    """The path is not a usable DeepSpeed ZeRO checkpoint; the message says why and what to do."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint was not completely written (a save was interrupted); the message names what is missing."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What a validated ZeRO checkpoint directory holds."""

    path: Path
    tag: str
    zero_stage: int
    world_size: int  # data-parallel ranks that wrote it
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes
    has_manifest: bool = False
    weights_only: bool = False

    @property
    def tag_dir(self) -> Path:
        return self.path / self.tag


# ------------------------------------------------------------------------------------------ validation
def _expected_shards(tag_dir: Path, zero_stage: int, world_size: int, mp_world_size: int = 1) -> list[str]:
    """The files DeepSpeed writes for this stage and world size (names relative to ``tag_dir``)."""
    names = []
    for mp in range(mp_world_size):
        if zero_stage == 3:
            names += [f"zero_pp_rank_{r}_mp_rank_{mp:02d}_model_states.pt" for r in range(world_size)]
        else:
            names.append(f"mp_rank_{mp:02d}_model_states.pt")
        if zero_stage > 0:
            for r in range(world_size):
                plain = f"zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt"
                names.append(f"bf16_{plain}" if (tag_dir / f"bf16_{plain}").exists() else plain)
    return names


def _read_model_states_meta(tag_dir: Path) -> tuple[int, int, int]:
    """(zero stage, data-parallel world size, model-parallel world size) from a model-states file."""
    candidates = sorted(tag_dir.glob("*model_states.pt"))
    if not candidates:
        raise FileNotFoundError(f"no *_model_states.pt file in {tag_dir}")
    try:
        state = torch.load(candidates[0], map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001  (torch raises several types for a cut-short file)
        raise IncompleteCheckpointError(
            f"{candidates[0]} is unreadable, probably cut short by an interrupted save ({type(err).__name__}: {err})."
            " Resume from another checkpoint."
        ) from err
    zero = (state.get("ds_config") or {}).get("zero_optimization") or {}
    return int(zero.get("stage", 0)), int(state.get("dp_world_size", 1)), int(state.get("mp_world_size", 1))


def _is_ds_checkpoint(path: Path) -> bool:
    return path.is_dir() and ((path / "latest").is_file() or (path / MANIFEST).is_file())


def _interrupted_saves(path: Path) -> list[Path]:
    return [p for p in (path.with_name(path.name + PARTIAL), path.with_name(path.name + REPLACED)) if p.exists()]


def validate_checkpoint(
    checkpoint_dir: _PATH, tag: Optional[str] = None, zero_stage: Optional[int] = None
) -> CheckpointInfo:
    """Check that ``checkpoint_dir`` is a complete ZeRO checkpoint (of ``zero_stage``, if given).

    Raises:
        CheckpointNotFoundError: the path does not exist.
        CheckpointError: not a ZeRO checkpoint, or one of another ZeRO stage.
        IncompleteCheckpointError: shards, the manifest or the ``latest`` file are missing or truncated.
    """
    path = Path(checkpoint_dir)
    if not path.exists():
        hint = ""
        if path.is_symlink():
            hint = f" It is a link to {os.readlink(path)}, which does not exist."
        leftovers = _interrupted_saves(path)
        if leftovers:
            hint += (
                " A save of it was interrupted and left " + ", ".join(str(p) for p in leftovers) + "; a '"
                + PARTIAL + "' directory with a manifest is complete and can be renamed to " + path.name + "."
            )
        raise CheckpointNotFoundError(f"Checkpoint {path} does not exist.{hint}")
    if path.is_file():
        for parent in (path.parent, path.parent.parent):
            if _is_ds_checkpoint(parent):
                raise CheckpointError(
                    f"{path} is a file inside the DeepSpeed checkpoint {parent}. Pass the directory {parent}."
                )
        raise CheckpointError(
            f"{path} is a file, not a DeepSpeed ZeRO checkpoint directory (a directory with a `latest` file and a"
            " `<tag>/` folder of *_model_states.pt and *_optim_states.pt shards). A single-file Lightning checkpoint"
            " loads with `HPUDeepSpeedStrategy(stage=3, load_full_weights=True)` or a non-DeepSpeed strategy."
        )
    manifest = _read_manifest(path)
    incomplete = path.name.endswith(PARTIAL)
    if manifest is None and not (path / "latest").is_file():
        if _is_ds_checkpoint(path.parent):
            raise CheckpointError(
                f"{path} is the tag folder inside the DeepSpeed checkpoint {path.parent}. Pass {path.parent}."
            )
        if incomplete or any(path.glob("*/*model_states.pt")):
            raise _incomplete(path, ["latest", MANIFEST, *_missing_shards(path, tag)])
        listing = sorted(p.name for p in path.iterdir())[:10]
        raise CheckpointError(
            f"{path} is not a DeepSpeed ZeRO checkpoint: it has no `latest` file and no {MANIFEST}"
            f" (contents: {listing or 'empty'}). Pass the directory that ModelCheckpoint or"
            " `trainer.save_checkpoint` wrote with a DeepSpeed strategy."
        )
    if manifest is not None:
        tag = tag or manifest["tag"]
    elif tag is None:
        tag = (path / "latest").read_text().strip()
    tag_dir = path / tag
    if not tag_dir.is_dir():
        tags = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise IncompleteCheckpointError(
            f"Checkpoint {path} has no folder for tag {tag!r} (folders: {tags}). Pass one of them as the tag."
        )
    if manifest is not None:
        missing = [
            f"{name} ({'missing' if not (path / name).exists() else 'truncated'})"
            for name, size in manifest["files"].items()
            if not (path / name).is_file() or (path / name).stat().st_size != size
        ]
        if missing:
            raise _incomplete(path, missing)
        info = CheckpointInfo(path, tag, int(manifest["zero_stage"]), int(manifest["world_size"]),
                              dict(manifest["files"]), True, bool(manifest.get("weights_only", False)))
    else:
        try:
            stage, world_size, mp_world_size = _read_model_states_meta(tag_dir)
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"Checkpoint {path} is incomplete: no *_model_states.pt file in {tag_dir}."
            ) from None
        missing = _missing_shards(path, tag)
        if missing or incomplete:
            what = f"ZeRO stage {stage}, {world_size} ranks"
            raise _incomplete(path, [*missing, *([MANIFEST] if incomplete else [])], what)
        files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
        info = CheckpointInfo(path, tag, stage, world_size, files, False)
    if zero_stage is not None and info.zero_stage != zero_stage:
        raise CheckpointError(
            f"Checkpoint {path} was saved with ZeRO stage {info.zero_stage}, but the strategy runs stage {zero_stage}."
            f" Resume with `HPUDeepSpeedStrategy(stage={info.zero_stage})`, or start a new run from its weights:"
            f" `lightning-gaudi-ds convert {path} model.pt`, then `Model.load_from_checkpoint('model.pt')`."
        )
    return info


def _missing_shards(path: Path, tag: Optional[str]) -> list[str]:
    """The shards (``<tag>/<file>``) missing from a checkpoint without manifest, as far as they can be told."""
    tag_dirs = [path / tag] if tag else sorted(p for p in path.iterdir() if p.is_dir())
    for tag_dir in tag_dirs:
        try:
            stage, world_size, mp_world_size = _read_model_states_meta(tag_dir)
        except Exception:  # noqa: BLE001  (no or a half-written model-states file: nothing more to tell)
            continue
        expected = _expected_shards(tag_dir, stage, world_size, mp_world_size)
        return [f"{tag_dir.name}/{n}" for n in expected if not (tag_dir / n).is_file()]
    return []


def _incomplete(path: Path, missing: list[str], what: str = "") -> IncompleteCheckpointError:
    if path.name.endswith(PARTIAL):
        final = path.with_name(path.name[: -len(PARTIAL)])
        hint = f"It is an unfinished save of {final.name}"
        hint += f", which still holds the previous complete checkpoint." if final.exists() else "."
        hint += " Resume from a complete checkpoint; this directory can be deleted."
    else:
        hint = "A rank did not finish writing it, or files were lost: resume from another checkpoint."
    return IncompleteCheckpointError(
        f"Checkpoint {path}{f' ({what})' if what else ''} is incomplete; missing: {', '.join(missing)}. {hint}"
    )


def _read_manifest(path: Path) -> Optional[dict[str, Any]]:
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        return manifest
    except ValueError as err:
        raise IncompleteCheckpointError(f"Checkpoint {path}: its manifest {MANIFEST} is unreadable ({err}).") from err


# ---------------------------------------------------------------------------------------- crash-safe save
def partial_path(final: _PATH) -> Path:
    """Where a checkpoint is written before it is complete: ``<name>.partial`` next to ``final``."""
    final = Path(final)
    return final.with_name(final.name + PARTIAL)


def prepare_save(final: _PATH) -> Path:
    """Rank 0, before a save: remove what an earlier interrupted save of ``final`` left; return the staging dir."""
    final = Path(final)
    staging = partial_path(final)
    if not (final.exists() or final.is_symlink()) and (staging / MANIFEST).is_file():
        os.replace(staging, final)  # a commit interrupted between its two renames: finish it
    for leftover in (staging, final.with_name(final.name + REPLACED)):
        if leftover.exists():
            log.warning("Removing %s, left by an interrupted save", leftover)
            _rmtree(leftover)
    final.parent.mkdir(parents=True, exist_ok=True)
    return staging


def commit_save(staging: _PATH, final: _PATH, zero_stage: int, world_size: int, weights_only: bool = False) -> None:
    """Rank 0, after every rank finished writing ``staging``: add the manifest and move it to ``final``.

    ``final`` is replaced atomically where the OS can swap two directories (Linux ``renameat2``); elsewhere it is
    renamed aside first, for a moment in which only ``<name>.replaced`` and the complete ``<name>.partial`` exist.
    """
    staging, final = Path(staging), Path(final)
    tag = (staging / "latest").read_text().strip()
    files = {}
    for file in sorted(staging.rglob("*")):
        if file.is_file():
            _fsync(file)
            files[str(file.relative_to(staging))] = file.stat().st_size
    missing = [n for n in _expected_shards(staging / tag, zero_stage, world_size) if not (staging / tag / n).is_file()]
    if missing:
        raise IncompleteCheckpointError(f"Checkpoint save to {final} lost shards {missing}; not committing it.")
    manifest = {
        "format": _FORMAT, "tag": tag, "zero_stage": zero_stage, "world_size": world_size,
        "weights_only": weights_only, "files": files, "saved_at": time.time(), "versions": _versions(),
    }
    tmp = staging / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    _fsync(tmp)
    os.replace(tmp, staging / MANIFEST)
    _fsync(staging)
    if (final.exists() or final.is_symlink()) and _exchange(staging, final):
        _rmtree(staging)  # now holds the previous checkpoint
    else:
        replaced = final.with_name(final.name + REPLACED)
        if final.exists() or final.is_symlink():
            os.replace(final, replaced)
        os.replace(staging, final)
        if replaced.exists() or replaced.is_symlink():
            _rmtree(replaced)
    _fsync(final.parent)


def remove_checkpoint(path: _PATH) -> None:
    """Delete a checkpoint so that no half-deleted one is ever left under its name (rename, then delete)."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    if not path.exists():
        return
    trash = path.with_name(path.name + DELETING)
    if trash.exists():
        _rmtree(trash)
    os.replace(path, trash)
    _rmtree(trash)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _rmtree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _versions() -> dict[str, str]:
    import deepspeed
    import lightning

    return {"deepspeed": deepspeed.__version__, "lightning": lightning.__version__, "torch": torch.__version__}


# ------------------------------------------------------------------------------------- world-size changes
def on_rank_zero(strategy: Any, what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on global rank 0 only. If it fails, every rank raises (rather than wait in a barrier forever)."""
    failure: Optional[BaseException] = None
    if strategy.is_global_zero:
        try:
            fn()
        except Exception as err:  # noqa: BLE001  (re-raised below, on every rank)
            failure = err
    message = strategy.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"{what} failed on rank 0: {message}")


def universal_checkpoint(info: CheckpointInfo, strategy: Any) -> Path:
    """DeepSpeed universal form of ``info`` (made once, by rank 0, into ``<checkpoint>/universal``).

    Loadable on any number of ranks with the ``load_universal_checkpoint`` engine option; returns its root.
    """
    root = info.path / UNIVERSAL

    def convert() -> None:
        if (root / "latest_universal").is_file():
            return
        from deepspeed.checkpoint import ds_to_universal

        work = root.with_name(UNIVERSAL + PARTIAL)
        _rmtree(work)
        args = argparse.Namespace(
            input_folder=str(info.tag_dir), output_folder=str(work / info.tag), num_extract_workers=1,
            num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
        )
        log.info("Converting %s (%d ranks) to a universal checkpoint in %s", info.path, info.world_size, root)
        ds_to_universal.main(args)
        _rmtree(root)
        os.replace(work, root)

    on_rank_zero(strategy, f"Converting {info.path} to a DeepSpeed universal checkpoint", convert)
    return root


def load_resharded(strategy: Any, info: CheckpointInfo) -> dict[str, Any]:
    """Load a checkpoint written by another number of ranks into ``strategy``'s engine; return the client state.

    Fitting: weights *and* optimizer state, through DeepSpeed's universal checkpoint. Evaluating: weights only,
    merged to fp32 by ``zero_to_fp32`` (an inference engine has no optimizer for the universal loader).
    """
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    module = strategy.lightning_module
    engine = strategy.deepspeed_engine
    rank_zero_info(
        f"Checkpoint {info.path} was saved by {info.world_size} ranks and is loaded on {strategy.world_size}:"
        " resharding it."
    )
    if module.trainer.state.fn == TrainerFn.FITTING and getattr(engine, "optimizer", None) is not None:
        root = universal_checkpoint(info, strategy)
        engine._config.load_universal_checkpoint = True
        try:
            _, client_state = engine.load_checkpoint(
                str(root), tag=info.tag, load_optimizer_states=True, load_lr_scheduler_states=False,
                load_module_strict=module.strict_loading,
            )
        finally:
            engine._config.load_universal_checkpoint = False
    else:
        client_state = _load_fp32_weights(strategy, info)
    if client_state is None:
        raise CheckpointError(f"DeepSpeed could not load the resharded checkpoint {info.path}.")
    return client_state


def _load_fp32_weights(strategy: Any, info: CheckpointInfo) -> dict[str, Any]:
    """Weights of ``info`` merged to fp32 and copied into the (possibly ZeRO-3 partitioned) module."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(info.path), info.tag)
    module = strategy.lightning_module
    if strategy.zero_stage_3:
        import deepspeed

        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if strategy.is_global_zero:
                module.load_state_dict(state_dict, strict=module.strict_loading)
    else:
        with torch.no_grad():
            module.load_state_dict(state_dict, strict=module.strict_loading)
    model_file = sorted(info.tag_dir.glob("*model_states.pt"))[0]
    return torch.load(model_file, map_location="cpu", weights_only=False)


# ------------------------------------------------------------------------------------------- fp32 export
def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: _PATH, output_file: _PATH, tag: Optional[str] = None
) -> dict[str, Any]:
    """Merge a sharded ZeRO checkpoint (stage 0-3, any world size) into one fp32 Lightning checkpoint file.

    The file loads without DeepSpeed: ``Model.load_from_checkpoint(output_file)`` or
    ``model.load_state_dict(torch.load(output_file)["state_dict"], strict=True)``. It keeps the Lightning
    state (epoch, global step, hyper-parameters, loops, callbacks) but no optimizer state. Uses DeepSpeed's
    ``zero_to_fp32``, which merges the fp32 master weights of every rank's shard.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    info = validate_checkpoint(checkpoint_dir, tag=tag)
    model_file = next(info.tag_dir.glob("mp_rank_00_model_states.pt"), None) or next(
        info.tag_dir.glob("zero_pp_rank_0_mp_rank_00_model_states.pt")
    )
    client_state = torch.load(model_file, map_location="cpu", weights_only=False)
    if info.zero_stage == 0:
        state_dict = {k: v.float() if v.is_floating_point() else v for k, v in client_state["module"].items()}
    else:
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(info.path), info.tag)
    deepspeed_keys = {
        "module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps", "global_steps",
        "global_samples", "dp_world_size", "mp_world_size", "buffer_names", "param_shapes", "frozen_param_shapes",
        "shared_params", "frozen_param_fragments", "data_sampler", "random_ltd", "sparse_tensor_module_names",
        "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
    }
    checkpoint = {k: v for k, v in client_state.items() if k not in deepspeed_keys}
    checkpoint["state_dict"] = {_strip(k, "_forward_module."): v for k, v in state_dict.items()}
    output_file = Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_file.with_name(output_file.name + PARTIAL)
    torch.save(checkpoint, tmp)
    os.replace(tmp, output_file)
    return checkpoint


def _strip(key: str, prefix: str) -> str:
    return key[len(prefix):] if key.startswith(prefix) else key


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="DeepSpeed checkpoint directory (e.g. 'epoch=0-step=100.ckpt')")
    parser.add_argument("output_file", help="single fp32 checkpoint file to write")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in the manifest or `latest`)")


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag)
    except CheckpointError as err:
        print(f"error: {err}")
        return 2
    numel = sum(t.numel() for t in checkpoint["state_dict"].values())
    print(f"wrote {args.output_file}: {len(checkpoint['state_dict'])} tensors, {numel:,} values (fp32)")
    return 0
