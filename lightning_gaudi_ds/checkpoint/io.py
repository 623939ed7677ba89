"""What a checkpoint directory holds, whether it is complete, and how a save is made crash-safe.

A checkpoint is the directory DeepSpeed writes (``latest``, ``<tag>/`` with ``*_model_states.pt`` and one
``*_optim_states.pt`` shard per data-parallel rank). It is written into ``<name>.partial`` next to its final place;
once every rank has written, rank 0 adds a manifest (``lightning_gaudi_ds_manifest.json``: every file and its
size, stage, world size) and only then moves it into place. A directory without a manifest or with a file missing
is reported as incomplete, by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import pickle
import re
import shutil
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds.errors import (  # noqa: F401  (importable from here too)
    CheckpointError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    UnsafeCheckpointError,
)

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
MANIFEST = "lightning_gaudi_ds_manifest.json"
PARTIAL = ".partial"  # a save in progress, or one that was interrupted
REPLACED = ".replaced"  # the previous checkpoint of the same name, while the new one is moved into place
DELETING = ".deleting"  # a checkpoint being removed (top-k rotation)
_FORMAT = 1
T = TypeVar("T")


# --------------------------------------------------------------------------------------- safe loading
# How to load a trusted file anyway, for the error message: Lightning's switch, unless a caller names its own.
TRAINER_OPT_IN = "pass `weights_only=False` to trainer.fit / validate / test / predict"


def resolve_weights_only(weights_only: bool | None) -> bool:
    """What ``torch.load(weights_only=weights_only)`` does: None is torch's default (True since torch 2.6), and the
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` / ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` environment variables apply."""
    def truthy(name: str) -> bool:
        return os.environ.get(name, "0").lower() in ("1", "y", "yes", "true")

    if truthy("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return True
    if weights_only is None:
        return not truthy("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    return weights_only


@contextlib.contextmanager
def deepspeed_types_allowed() -> Iterator[None]:
    """Inside: torch's safe unpickler may also build the few classes DeepSpeed saves in its shards
    (:func:`lightning_gaudi_ds._compat.checkpoint_safe_globals`); the allowlist is restored on exit."""
    with torch.serialization.safe_globals(_compat.checkpoint_safe_globals()):
        yield


def load_file(
    file: PathLike, weights_only: bool | None = None, opt_in: str = TRAINER_OPT_IN, *, mmap: bool = False
) -> Any:
    """``torch.load(file, map_location="cpu")``; with ``weights_only`` (resolved as torch does) through torch's safe
    unpickler, which may build tensors, builtins and DeepSpeed's few checkpoint classes only.

    Raises:
        UnsafeCheckpointError: the file holds anything else; the message names the file and ``opt_in``.
        pickle.UnpicklingError: the file is not a pickle (damaged), as torch raises it.
    """
    if not resolve_weights_only(weights_only):
        return torch.load(file, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        with deepspeed_types_allowed():
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        refused = unsafe_refusal(file, err, opt_in)
        if refused is None:  # not a refusal: a damaged file, which callers report as such
            raise
        raise refused from err


def unsafe_refusal(file: PathLike, err: pickle.UnpicklingError,
                   opt_in: str = TRAINER_OPT_IN) -> UnsafeCheckpointError | None:
    """torch's refusal of ``file`` with ``weights_only=True`` as the package's error, naming the file, what was
    refused and ``opt_in``; None when ``err`` is no such refusal (a damaged file)."""
    if "Weights only load failed" not in str(err):
        return None
    lines = [line.strip() for line in str(err).splitlines() if "nsupported" in line]  # torch's one-line reason
    what = re.sub(r"^WeightsUnpickler error: | was not an allowed global by default.*", "",
                  lines[0] if lines else str(err).strip().splitlines()[-1])
    return UnsafeCheckpointError(
        f"{file} holds what torch's safe loader (weights_only=True) refuses to build ({what}): loading it could"
        f" run code from the file. If you trust where this checkpoint came from, {opt_in}."
    )


@contextlib.contextmanager
def refusal_named(file: PathLike, opt_in: str = TRAINER_OPT_IN) -> Iterator[None]:
    """Inside (a loader of one file that calls ``torch.load`` itself, e.g. Lightning's for ``load_full_weights``):
    torch's ``weights_only`` refusal of ``file`` is raised as :func:`unsafe_refusal`'s error."""
    try:
        yield
    except pickle.UnpicklingError as err:
        refused = unsafe_refusal(file, err, opt_in)
        if refused is None:
            raise
        raise refused from err


def verify_files(files: Iterable[PathLike], weights_only: bool | None = None, opt_in: str = TRAINER_OPT_IN) -> None:
    """Read each file through torch's safe unpickler first (its tensors memory-mapped, not read) when
    ``weights_only`` resolves to True; for the files a loader that cannot be told ``weights_only`` (DeepSpeed's,
    ``zero_to_fp32``, ``ds_to_universal``) is about to read.

    Raises:
        UnsafeCheckpointError: a file holds anything but tensors, builtins and DeepSpeed's checkpoint classes.
    """
    if not resolve_weights_only(weights_only):
        return
    for file in files:
        load_file(file, True, opt_in, mmap=zipfile.is_zipfile(file))


def verify_checkpoint(path: PathLike, weights_only: bool | None = None, opt_in: str = TRAINER_OPT_IN) -> None:
    """:func:`verify_files` for every ``*.pt`` file of the checkpoint directory ``path`` (its universal form too)."""
    verify_files(sorted(Path(path).rglob("*.pt")), weights_only, opt_in)


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
        ranks_with_model_states = range(world_size) if zero_stage == 3 else range(1)
        names += [_compat.model_states_name(zero_stage, r, mp) for r in ranks_with_model_states]
        if zero_stage > 0:
            for r in range(world_size):
                bf16 = _compat.optim_states_name(r, mp, bf16=True)
                names.append(bf16 if (tag_dir / bf16).exists() else _compat.optim_states_name(r, mp))
    return names


def _read_model_states_meta(tag_dir: Path, weights_only: bool | None = None,
                            opt_in: str = TRAINER_OPT_IN) -> tuple[int, int, int]:
    """(zero stage, data-parallel world size, model-parallel world size) from a model-states file."""
    candidates = sorted(tag_dir.glob("*model_states.pt"))
    if not candidates:
        raise CheckpointNotFoundError(f"no *_model_states.pt file in {tag_dir}")
    try:
        state = load_file(candidates[0], weights_only, opt_in, mmap=True)
    except UnsafeCheckpointError:
        raise
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, ValueError) as err:  # torch's for a cut-short file
        raise IncompleteCheckpointError(
            f"{candidates[0]} is unreadable, probably cut short by an interrupted save ({type(err).__name__}: {err})."
            " Resume from another checkpoint."
        ) from err
    return _compat.model_states_meta(state)


def _whole_torch_file(path: Path) -> bool:
    """Whether a ``torch.save`` file ends with its zip directory (a cut-short file does not); reads only its end."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def _is_ds_checkpoint(path: Path) -> bool:
    return path.is_dir() and ((path / "latest").is_file() or (path / MANIFEST).is_file())


def _enclosing_checkpoint(path: Path) -> Path | None:
    """The checkpoint ``path`` (a file or folder) lies inside: its tag folder or a file in that folder. Lightning
    saves under the tag ``checkpoint``, which identifies a checkpoint even without its ``latest`` file."""
    tag_folder = path.parent if path.is_file() else path
    candidates = [path.parent] + ([path.parent.parent] if path.is_file() else [])
    for candidate in candidates:
        if _is_ds_checkpoint(candidate) or (candidate == tag_folder.parent and tag_folder.name == "checkpoint"):
            return candidate
    return None


_NOT_VALID = "The provided path is not a valid DeepSpeed checkpoint"  # Lightning's words, which callers may match


def _interrupted_saves(path: Path) -> list[Path]:
    return [p for p in (path.with_name(path.name + PARTIAL), path.with_name(path.name + REPLACED)) if p.exists()]


def validate_checkpoint(
    checkpoint_dir: PathLike, tag: str | None = None, zero_stage: int | None = None,
    weights_only: bool | None = None, opt_in: str = TRAINER_OPT_IN,
) -> CheckpointInfo:
    """Check that ``checkpoint_dir`` is a complete ZeRO checkpoint (of ``zero_stage``, if given).

    Without a manifest, a model-states file is read for the stage and world size, with ``weights_only`` (see
    :func:`load_file`). The other shards are not read: :func:`verify_checkpoint` does that.

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotACheckpointError: a file, a folder inside a checkpoint, or a folder without one.
        CheckpointError: a checkpoint of another ZeRO stage.
        IncompleteCheckpointError: shards, the manifest or the ``latest`` file are missing or truncated.
        UnsafeCheckpointError: the model-states file read holds what ``weights_only=True`` refuses.
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
        parent = _enclosing_checkpoint(path)
        if parent is not None:
            raise NotACheckpointError(
                f"{_NOT_VALID}: {path} is a file inside the DeepSpeed checkpoint {parent}. Try to load using this"
                f" parent directory instead: {parent}"
            )
        raise NotACheckpointError(
            f"{_NOT_VALID}: {path} is a file, not a DeepSpeed ZeRO checkpoint directory (a directory with a `latest`"
            " file and a `<tag>/` folder of *_model_states.pt and *_optim_states.pt shards). A single-file Lightning"
            " checkpoint loads with `HPUDeepSpeedStrategy(stage=3, load_full_weights=True)` or a non-DeepSpeed"
            " strategy."
        )
    manifest = _read_manifest(path)
    incomplete = path.name.endswith(PARTIAL)
    if manifest is None and not (path / "latest").is_file():
        if _enclosing_checkpoint(path) is not None:
            raise NotACheckpointError(
                f"{_NOT_VALID}: {path} is the tag folder inside the DeepSpeed checkpoint {path.parent}. Try to load"
                f" using this parent directory instead: {path.parent}"
            )
        if incomplete or any(path.glob("*/*model_states.pt")):
            raise _incomplete(path, ["latest", MANIFEST, *_missing_shards(path, tag, weights_only)])
        listing = sorted(p.name for p in path.iterdir())[:10]
        raise NotACheckpointError(
            f"{_NOT_VALID}: {path} is not a DeepSpeed ZeRO checkpoint: it has no `latest` file and no {MANIFEST}"
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
            stage, world_size, mp_world_size = _read_model_states_meta(tag_dir, weights_only, opt_in)
        except (IncompleteCheckpointError, UnsafeCheckpointError):  # an unreadable or refused file: its own message
            raise
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"Checkpoint {path} is incomplete: no *_model_states.pt file in {tag_dir}."
            ) from None
        missing = _missing_shards(path, tag, weights_only)
        if missing or incomplete:
            what = f"ZeRO stage {stage}, {world_size} ranks"
            raise _incomplete(path, [*missing, *([MANIFEST] if incomplete else [])], what)
        cut = [f"{tag}/{p.name} (truncated)" for p in sorted(tag_dir.glob("*.pt")) if not _whole_torch_file(p)]
        if cut:
            raise _incomplete(path, cut, f"ZeRO stage {stage}, {world_size} ranks")
        files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
        info = CheckpointInfo(path, tag, stage, world_size, files, False)
    if zero_stage is not None and info.zero_stage != zero_stage:
        raise CheckpointError(
            f"Checkpoint {path} was saved with ZeRO stage {info.zero_stage}, but the strategy runs stage {zero_stage}."
            f" Resume with `HPUDeepSpeedStrategy(stage={info.zero_stage})`, or start a new run from its weights:"
            f" `lightning-gaudi-ds convert {path} model.pt`, then `Model.load_from_checkpoint('model.pt')`."
        )
    return info


def _missing_shards(path: Path, tag: str | None, weights_only: bool | None = None) -> list[str]:
    """The shards (``<tag>/<file>``) missing from a checkpoint without manifest, as far as they can be told."""
    tag_dirs = [path / tag] if tag else sorted(p for p in path.iterdir() if p.is_dir())
    for tag_dir in tag_dirs:
        try:
            stage, world_size, mp_world_size = _read_model_states_meta(tag_dir, weights_only)
        except (CheckpointError, FileNotFoundError, AttributeError, TypeError, ValueError):
            # no, a half-written or a foreign model-states file: nothing more to tell
            continue
        expected = _expected_shards(tag_dir, stage, world_size, mp_world_size)
        return [f"{tag_dir.name}/{n}" for n in expected if not (tag_dir / n).is_file()]
    return []


def _incomplete(path: Path, missing: list[str], what: str = "") -> IncompleteCheckpointError:
    if path.name.endswith(PARTIAL):
        final = path.with_name(path.name[: -len(PARTIAL)])
        hint = f"It is an unfinished save of {final.name}"
        hint += ", which still holds the previous complete checkpoint." if final.exists() else "."
        hint += " Resume from a complete checkpoint; this directory can be deleted."
    else:
        hint = "A rank did not finish writing it, or files were lost: resume from another checkpoint."
    return IncompleteCheckpointError(
        f"Checkpoint {path}{f' ({what})' if what else ''} is incomplete; missing: {', '.join(missing)}. {hint}"
    )


def _read_manifest(path: Path) -> dict[str, Any] | None:
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
        if manifest.get("format") != _FORMAT:
            raise InvalidArgumentError(f"unknown format {manifest.get('format')!r}")
        return manifest
    except ValueError as err:
        raise IncompleteCheckpointError(f"Checkpoint {path}: its manifest {MANIFEST} is unreadable ({err}).") from err


# ---------------------------------------------------------------------------------------- crash-safe save
def partial_path(final: PathLike) -> Path:
    """Where a checkpoint is written before it is complete: ``<name>.partial`` next to ``final``."""
    final = Path(final)
    return final.with_name(final.name + PARTIAL)


def prepare_save(final: PathLike) -> Path:
    """Rank 0, before a save: remove what an earlier interrupted save of ``final`` left; return the staging dir."""
    final = Path(final)
    staging = partial_path(final)
    if not (final.exists() or final.is_symlink()) and (staging / MANIFEST).is_file():
        os.replace(staging, final)  # a commit interrupted between its two renames: finish it
        log.warning("%s was a complete checkpoint whose save stopped before its rename: renamed to %s, which this"
                    " save of the same name now replaces", staging, final)
    for leftover in (staging, final.with_name(final.name + REPLACED)):
        if leftover.exists():
            log.warning("Removing %s, left by an interrupted save", leftover)
            _rmtree(leftover)
    final.parent.mkdir(parents=True, exist_ok=True)
    return staging


def commit_save(
    staging: PathLike, final: PathLike, zero_stage: int, world_size: int, weights_only: bool = False
) -> None:
    """Rank 0, after every rank finished writing ``staging``: add the manifest and move it to ``final``.

    ``final`` is replaced atomically where the OS can swap two directories (Linux ``renameat2``); elsewhere it is
    renamed aside first, for a moment in which only ``<name>.replaced`` and the complete ``<name>.partial`` exist.
    """
    staging, final = Path(staging), Path(final)
    if not staging.is_dir() or not any(staging.iterdir()):
        # Nothing written (an engine stand-in, a save_checkpoint that writes elsewhere): nothing to commit, and the
        # checkpoint already under `final`, if any, stays as it was.
        log.warning("The engine wrote nothing into %s: no checkpoint committed to %s", staging, final)
        _rmtree(staging)
        return
    tag = _saved_tag(staging, final)
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


def _saved_tag(staging: Path, final: Path) -> str:
    """The tag a save wrote: from DeepSpeed's ``latest`` file, else its one tag folder (an engine that was told
    ``save_latest=False``, or writes ``latest`` last)."""
    latest = staging / "latest"
    if latest.is_file():
        return latest.read_text().strip()
    tags = sorted(p.name for p in staging.iterdir() if p.is_dir())
    if len(tags) != 1:
        raise IncompleteCheckpointError(
            f"Checkpoint save to {final} wrote no `latest` file and {len(tags)} tag folders ({tags}) into {staging}:"
            " which one it saved cannot be told; not committing it. Save with one tag per checkpoint directory."
        )
    return tags[0]


def remove_checkpoint(path: PathLike) -> None:
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


# ------------------------------------------------------------------------------------------ rank zero
class RankZeroComm(Protocol):
    """What :func:`on_rank_zero` needs from the running job (Lightning's strategies have both)."""

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: T, src: int = 0) -> T: ...


def on_rank_zero(comm: RankZeroComm, what: str, fn: Callable[[], object]) -> None:
    """Run ``fn`` on global rank 0 only. If it fails, every rank raises (rather than wait in a barrier forever)."""
    failure: BaseException | None = None
    if comm.is_global_zero:
        try:
            fn()
        except Exception as err:  # noqa: BLE001  (re-raised below, on every rank)
            failure = err
    message = comm.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"{what} failed on rank 0: {message}")


class SaveComm(RankZeroComm, Protocol):
    """What :func:`save` needs from the running job (Lightning's strategies have it all)."""

    @property
    def world_size(self) -> int: ...

    def barrier(self, name: str | None = None) -> None: ...


def save(
    checkpoint: Mapping[str, Any], filepath: PathLike, comm: SaveComm, write: Callable[[str], object],
    zero_stage: Callable[[], int], weights_only: bool | None = None,
) -> None:
    """Crash-safe save: every rank writes its shard with ``write`` into ``<name>.partial``; rank 0 adds the manifest
    and renames it into place only after every rank wrote, so ``<name>`` is always complete.

    ``zero_stage`` is read on rank 0 when the checkpoint is committed. ``weights_only``: whether the manifest says
    the checkpoint loads with ``weights_only=True`` (default: a Trainer checkpoint without scheduler state).
    """
    final = comm.broadcast(str(filepath))
    staging = partial_path(final)
    on_rank_zero(comm, f"Preparing {staging}", lambda: prepare_save(final))
    write(str(staging))
    comm.barrier("lightning_gaudi_ds.save_checkpoint.written")  # every rank has written its shard
    if weights_only is None:
        weights_only = "lr_schedulers" not in checkpoint
    on_rank_zero(comm, f"Committing checkpoint {final}", lambda: commit_save(
        staging, final, zero_stage(), comm.world_size, weights_only))
