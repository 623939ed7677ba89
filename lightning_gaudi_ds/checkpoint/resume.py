"""Resuming: ``ckpt_path="last"`` with crash-safe sharded checkpoints, and the default under a restart.

Lightning's ``"last"`` is the newest ``last*.ckpt`` of the ``ModelCheckpoint`` callbacks (and the
``OnExceptionCheckpoint`` path). Here it is the newest of those that :func:`validate_checkpoint` accepts: a save in
progress or cut short (``*.partial``, no manifest, a shard missing or truncated) is skipped with a warning, never
loaded. With none at all, Lightning's own message is given ("no last checkpoint available", not an error).

A "last" checkpoint left complete as ``<name>.partial`` (the save died between its manifest and its rename) is
adopted when a fit starts: renamed to ``<name>``, with one line saying so. A fit that asked for "last" where
Lightning saw it among the candidates, or a restart, then resumes from it if it is the newest. Lightning resolves
``ckpt_path="last"`` before the strategy is connected, so when it was the only one Lightning found none, and that
fit starts without it, saying so (``ModelCheckpoint``'s version counter then saves ``last-v1.ckpt`` beside it).

Under ``lightning-gaudi-ds spawn --max_restarts N`` every rank of a restart sees ``LIGHTNING_GAUDI_DS_RESTART`` > 0,
and every task of a requeued SLURM job ``SLURM_RESTART_COUNT`` > 0: a ``trainer.fit`` without ``ckpt_path`` then
resumes from ``"last"``.

Preemption: SIGTERM, and under Lightning's ``SLURMEnvironment(auto_requeue=True)`` its requeue signal (SIGUSR1,
``sbatch --signal=USR1@N``), stop every rank at one step boundary (:class:`PreemptionWatch`) and save ``last.ckpt``
crash-safe (:func:`save_on_preemption`); after the requeue signal rank 0 then requeues the job (``scontrol
requeue``), as Lightning's auto-requeue does, but after a save that every rank made at the same step.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_gaudi_ds.checkpoint.io import (
    MANIFEST,
    PARTIAL,
    CheckpointError,
    on_rank_zero,
    partial_path,
    validate_checkpoint,
)
from lightning_gaudi_ds.launch import envvars


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """Which restart of the job this process belongs to: ``LIGHTNING_GAUDI_DS_RESTART`` (set by the runner, which
    counts SLURM's requeues in), else ``SLURM_RESTART_COUNT`` (a task srun started in a requeued job); 0 for the
    first start."""
    from lightning_gaudi_ds.launch import slurm

    if env.get(envvars.RESTART.name, "").strip():
        return int(envvars.read(envvars.RESTART, env))
    return slurm.restart_count(env)


def _saved_at(path: Path) -> float:
    manifest = path / MANIFEST
    return (manifest if manifest.is_file() else path).stat().st_mtime


def newest_complete(candidates: Iterable[str]) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint of ``candidates`` (a file, as Lightning takes it, or a sharded checkpoint
    directory that :func:`validate_checkpoint` accepts), ordered by when it was committed; and why each newer or
    other candidate was skipped."""
    complete: list[tuple[float, str]] = []
    skipped: list[str] = []
    for candidate in sorted(set(candidates)):
        path = Path(candidate)
        if not path.exists():
            continue
        if path.is_dir():
            try:
                validate_checkpoint(path)
            except (CheckpointError, OSError) as err:
                skipped.append(f"{path}: {err}")
                continue
        complete.append((_saved_at(path), candidate))
    return (max(complete)[1] if complete else None), skipped


def hook_trainer(trainer: Any, *, data_position: bool) -> None:
    """In the strategy's ``connect``: ``Trainer._run`` connects before it restores from the path it made of
    ``ckpt_path``, the moment to have ``trainer`` resolve "last" (and a restart's default) with
    :func:`resolve_ckpt_path`, and (``data_position``: the strategy's ``resume_data_position``) to skip the batches a
    mid-epoch checkpoint consumed (:mod:`~lightning_gaudi_ds.checkpoint.data_position`)."""
    import functools

    from lightning_gaudi_ds._compat import hook_resume_path

    hook_resume_path(trainer, functools.partial(resolve_ckpt_path, trainer))
    if data_position:
        from lightning_gaudi_ds.checkpoint import data_position as position

        position.hook(trainer)


def resolve_ckpt_path(trainer: Any, checkpoint_path: Any) -> Any:
    """The checkpoint this Trainer restores from, given the path Lightning made of the user's ``ckpt_path`` (see
    the module's docstring): a restart's fit without one resumes from "last"; one of the "last" candidates that is
    incomplete (Lightning's "last" takes the newest by time, complete or not) gives way to the newest complete one,
    or to none; a "last" checkpoint left complete as ``<name>.partial`` is adopted first (:func:`adopt_interrupted`,
    at every fit). Any other path is Lightning's."""
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    from lightning_gaudi_ds import _compat

    fitting = trainer.state.fn == TrainerFn.FITTING
    restart = restart_count()
    if checkpoint_path is None and not fitting:
        return None  # nothing to restore: no listing of the checkpoint directories
    candidates = _compat.last_checkpoint_candidates(trainer)
    if checkpoint_path is not None and str(checkpoint_path) not in candidates:
        return checkpoint_path  # a path of the user's: Lightning's
    adopted = adopt_interrupted(trainer)
    if checkpoint_path is None and not restart:  # no ckpt_path, or "last" that Lightning found none for
        for final in adopted:
            rank_zero_warn(f'{_adopted(final)} This fit starts without it (ckpt_path=None, or "last" that Lightning'
                           f' resolved before the rename); to resume from it, pass ckpt_path="last" (or {final!r}).')
        return None
    for final in adopted:
        rank_zero_info(_adopted(final))
    candidates |= set(adopted)
    if checkpoint_path is None:
        source = envvars.RESTART.name if os.environ.get(envvars.RESTART.name, "").strip() else "SLURM_RESTART_COUNT"
        rank_zero_info(f"Restart {restart} of the job ({source}={restart}): resuming from ckpt_path='last'.")
    elif not adopted and _complete(Path(checkpoint_path)):
        return checkpoint_path
    chosen, skipped = newest_complete(candidates)
    for reason in skipped:
        rank_zero_warn(f'ckpt_path="last": skipping an incomplete checkpoint, {reason}')
    if chosen is None:
        if skipped:
            rank_zero_warn('ckpt_path="last": no complete checkpoint to resume from. No checkpoint will be loaded.')
            return None
        return _compat.lightning_last_checkpoint(trainer, trainer.state.fn)  # None, with Lightning's own message
    rank_zero_info(f'ckpt_path="last": resuming from {chosen}')
    return chosen


def adopt_interrupted(trainer: Any) -> list[str]:
    """Rank 0 renames each "last" checkpoint left complete as ``<name>.partial`` (its manifest written and every
    file it lists in place: only the rename was missing) to ``<name>``; returns those names, on every rank. One left
    without a manifest is a save cut short: left as it is (the next save of that name removes it)."""
    from lightning_gaudi_ds import _compat

    adopted: list[str] = []

    def adopt() -> None:
        for final in sorted(_compat.interrupted_last_checkpoints(trainer, PARTIAL)):
            staging = partial_path(final)
            try:
                if not validate_checkpoint(staging).has_manifest:
                    continue
            except (CheckpointError, OSError):
                continue
            os.replace(staging, final)
            adopted.append(final)

    on_rank_zero(trainer.strategy, "Adopting a checkpoint whose save stopped before its rename", adopt)
    return list(trainer.strategy.broadcast(adopted))


def _adopted(final: str) -> str:
    return (f"{final}{PARTIAL} was a complete checkpoint whose save stopped before its rename (its manifest"
            f" verifies): renamed to {final}.")


def _complete(path: Path) -> bool:
    if not path.is_dir():
        return path.exists()
    try:
        validate_checkpoint(path)
    except (CheckpointError, OSError):
        return False
    return True


def save_on_preemption(trainer: Any, *, has_engine: bool, watch: PreemptionWatch | None = None) -> str | None:
    """After SIGTERM (or SLURM's requeue signal, which ``watch`` noted): save ``last.ckpt`` of the first
    ``ModelCheckpoint`` and make the exit code ``PREEMPTED_EXIT``; after the requeue signal, rank 0 then requeues the
    SLURM job.

    Lightning notes SIGTERM (``trainer.received_sigterm``, rank 0's flag broadcast to every rank at the next batch)
    and stops every rank at that step boundary with ``SIGTERMException``, which would exit with 0. Called from the
    strategy's ``teardown`` while that exception is being handled, on every rank: the save is the usual crash-safe
    one, so a SIGKILL during it (the grace period ran out) leaves the previous checkpoint as it was. The requeue comes
    after the save returned on rank 0, that is once the checkpoint is committed. Returns the path saved, or None
    when there was nothing to do.
    """
    import sys

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    from lightning_gaudi_ds.launch._proc import PREEMPTED_EXIT

    exc = sys.exc_info()[1]
    if (not isinstance(exc, SIGTERMException) or trainer is None or trainer.state.fn != TrainerFn.FITTING
            or not has_engine):
        return None
    name = watch.signal_name if watch is not None else "SIGTERM"
    requeue = watch is not None and watch.requeue and trainer.is_global_zero
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if not callbacks:
        rank_zero_warn(f"{name}: no ModelCheckpoint to save the preemption checkpoint with; stopping without one.")
        if requeue:
            _requeue(name)
        return None
    callback = callbacks[0]
    path = callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST)
    trainer.save_checkpoint(path)
    rank_zero_info(f"{name}: saved {path} at step {trainer.global_step}; exiting with {PREEMPTED_EXIT} (preempted).")
    exc.code = PREEMPTED_EXIT
    if requeue:
        _requeue(name)
    return path


@dataclass(frozen=True)
class RankFacts:
    """What :class:`PreemptionWatch` needs to know of this rank: the world, its ranks, the launcher that started
    the ranks (None: another launcher) and the cluster environment (SLURM's requeue signal)."""

    world_size: int
    global_rank: int
    local_rank: int
    launcher: Any
    cluster_environment: Any = None


def _requeue(name: str) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    from lightning_gaudi_ds.launch import slurm

    done, said = slurm.requeue()
    (rank_zero_info if done else rank_zero_warn)(f"{name} (SLURM auto-requeue): {said}")


def _requeue_signal(env: Any) -> int | None:
    """The signal Lightning's SLURM auto-requeue handles (``SLURMEnvironment.requeue_signal``) when it is on."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
        return int(env.requeue_signal)
    return None


class PreemptionWatch:
    """SIGTERM (and SLURM's requeue signal) noted without collectives, and agreed on in Lightning's own per-batch
    broadcast.

    Lightning's own SIGTERM handler broadcasts from inside the signal handler, on each rank that gets the signal: when
    the ranks get it at different moments (a scheduler signals every process, the launcher passes it on) those
    broadcasts pair with other collectives and the ranks hang until SIGKILL. Its SLURM requeue handler (SIGUSR1,
    ``sbatch --signal=USR1@N``) saves a checkpoint from inside the handler, a collective under DeepSpeed, at whatever
    point each rank was interrupted. This handler, installed for the fit (Lightning puts the original handlers back
    in its teardown), only takes note, of both. Global rank 0's note becomes Lightning's ``received_sigterm`` just
    before Lightning broadcasts that flag at the start of the next training batch, so every rank stops there together
    and the strategy saves (then, after the requeue signal, rank 0 requeues the job); no collective is added. A signal
    that reaches other ranks only is noted and waits for rank 0's (schedulers signal every rank). With one process
    the handler sets the flag at once, as Lightning's does.
    """

    def __init__(self) -> None:
        self.seen = False
        self.signal_name = "SIGTERM"  # the first signal noted
        self.requeue = False  # SLURM's requeue signal was noted: requeue the job after the save

    def install(self, trainer: Any, rank: RankFacts) -> None:
        import signal
        import threading

        import torch
        from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

        from lightning_gaudi_ds import _compat

        if threading.current_thread() is not threading.main_thread():
            return
        self.seen, self.signal_name, self.requeue = False, "SIGTERM", False
        requeue_signal = _requeue_signal(rank.cluster_environment)
        if requeue_signal is not None and _compat.handler_before_lightning(trainer, requeue_signal) is not None:
            requeue_signal = None  # the user's own handler: Lightning left it in place, and so does this
        signals = [signal.SIGTERM] + ([signal.Signals(requeue_signal)] if requeue_signal is not None else [])
        users = {signum: _compat.handler_before_lightning(trainer, signum) for signum in signals}  # Lightning calls
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and \
            rank.world_size > 1
        zero = rank.global_rank == 0

        def note(signum: int, frame: Any) -> None:
            if signum == requeue_signal:
                self.requeue = True
            if not self.seen:
                import logging

                self.signal_name = signal.Signals(signum).name
                when = "saving a checkpoint after this step" if zero else "stopping with global rank 0"
                if signum == requeue_signal:
                    when += ", then requeueing the SLURM job" if zero else ""
                logging.getLogger(__name__).info(rank_prefixed_message(
                    f"Received {self.signal_name}: {signum}; {when}", rank.local_rank))
                launcher = rank.launcher
                if launcher is not None:  # Lightning's own launcher: its other ranks get it too, as Lightning does
                    launcher.kill(signum)
            self.seen = True
            if not distributed:
                _compat.note_sigterm(trainer)
            user = users.get(signal.Signals(signum))
            if user is not None:
                user(signum, frame)

        def before_broadcast() -> None:
            if zero and self.seen:
                _compat.note_sigterm(trainer)

        _compat.hook_sigterm_broadcast(trainer, before_broadcast)
        for signum in signals:
            signal.signal(signum, note)
