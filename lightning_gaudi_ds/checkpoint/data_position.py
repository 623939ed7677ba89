"""Exact mid-epoch resume: a resumed fit goes on with the batch after the last one its checkpoint consumed.

Lightning restores its loops' progress from the checkpoint (``fit_loop.epoch_loop.batch_progress``: the batches of
the current epoch already processed) but re-reads a plain ``DataLoader``'s epoch from its start; only a loader with
``state_dict`` / ``load_state_dict`` (torchdata's ``StatefulDataLoader``) resumes where it was. Here, as Hugging
Face accelerate's ``skip_first_batches``, the train loader's batch sampler drops the first ``N`` batches of the
resumed epoch's index order, without reading their samples: ``N`` is that restored progress. The index order must be
the same for the same epoch: Lightning's ``DistributedSampler`` (shuffled or not: seeded, ``set_epoch``), a
``SequentialSampler``, a ``RandomSampler`` with a seeded ``generator``, or the user's own deterministic sampler.

A loader with its own ``state_dict`` keeps Lightning's handling. One whose position cannot be restored (an
``IterableDataset`` without state, a ``RandomSampler`` drawing from the global RNG) gets one rank-0 warning naming
the loader and what to pass, and restarts its epoch as Lightning does. ``HPUDeepSpeedStrategy(resume_data_position=
False)`` turns all of it off (Hugging Face: ``ignore_data_skip=True``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

# Lightning 2.6.6's warning (``_TrainingEpochLoop.reset``) for a non-resumable loader: wrong once the skip applies.
LIGHTNING_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


class SkipBatchSampler(Sampler[list[int]]):
    """``batch_sampler``'s batches without the first ``skip`` of its next epoch (once; later epochs are whole).

    ``len`` stays the whole epoch's, as Lightning counts the skipped batches as done. A torch ``BatchSampler``
    skips ``skip * batch_size`` indices of its sampler (one pass over those indices, no batch built); any other
    batch sampler skips its first ``skip`` batches."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    @property
    def sampler(self) -> Any:  # Lightning's _set_sampler_epoch looks here for set_epoch
        return getattr(self.batch_sampler, "sampler", None)

    def __getattr__(self, name: str) -> Any:  # batch_size, drop_last, ... of the wrapped sampler
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        inner = self.batch_sampler
        if skip and type(inner) is BatchSampler:  # skip indices, in C; the batches after them as torch makes them
            rest = skip_indices(iter(inner.sampler), skip * inner.batch_size)
            yield from BatchSampler(rest, inner.batch_size, inner.drop_last)
            return
        batches = iter(inner)
        if skip:
            next(itertools.islice(batches, skip - 1, None), None)
        yield from batches


def skip_indices(indices: Iterator[int], count: int) -> Iterator[int]:
    """``indices`` without its first ``count`` (consumed in C on the first ``next``, one pass, nothing kept)."""
    return itertools.islice(indices, count, None)


class SkipSampler(Sampler[int]):
    """``sampler`` without the first ``skip`` indices of its next epoch (``DataLoader(batch_size=None)``)."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.inner, self.skip = sampler, skip

    def set_epoch(self, epoch: int) -> None:
        if callable(set_epoch := getattr(self.inner, "set_epoch", None)):
            set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return skip_indices(iter(self.inner), skip)


def unrestorable(loader: Any) -> str | None:
    """Why ``loader``'s position in an epoch cannot be found again by skipping indices, with what to pass; None
    when it can."""
    if not isinstance(loader, DataLoader):
        return (f"it is a {type(loader).__name__}, not a torch DataLoader; give it state_dict()/load_state_dict()"
                " (torchdata's StatefulDataLoader) to resume it exactly")
    if isinstance(loader.dataset, IterableDataset):
        return ("its dataset is an IterableDataset, which has no index order to skip in; pass torchdata's"
                " StatefulDataLoader (or a loader with state_dict()/load_state_dict()) to resume it exactly")
    sampler = getattr(loader.batch_sampler, "sampler", None) if loader.batch_sampler is not None else loader.sampler
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        return ("its RandomSampler draws a new order from the global random state; pass"
                " DataLoader(..., generator=torch.Generator().manual_seed(SEED)) or let Lightning's DistributedSampler"
                " shuffle (Trainer(use_distributed_sampler=True))")
    return None


def skip_batches(loader: DataLoader, batches: int) -> None:
    """Have ``loader``'s next epoch start after its first ``batches`` batches (see :class:`SkipBatchSampler`)."""
    if loader.batch_sampler is not None:
        object.__setattr__(loader, "batch_sampler", SkipBatchSampler(loader.batch_sampler, batches))
    else:  # batch_size=None: the sampler's indices are the batches
        object.__setattr__(loader, "sampler", SkipSampler(loader.sampler, batches))


def consumed_batches(trainer: Any) -> int:
    """The batches of the resumed epoch that the checkpoint had consumed: Lightning's restored
    ``batch_progress.current.processed`` of the training epoch loop (0 when not resuming)."""
    fit_loop = trainer.fit_loop
    if not fit_loop.restarting:
        return 0
    return int(fit_loop.epoch_loop.batch_progress.current.processed)


def apply(trainer: Any, loaders: list[Any]) -> tuple[int, bool]:
    """Skip, in each train loader of a fit resumed mid-epoch, the batches its checkpoint consumed; warn (rank 0,
    once per loader) where that cannot be done. Returns how many loaders skip, and whether every one resumes
    exactly (or none needed to)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    from lightning_gaudi_ds._compat import _Stateful

    batches = consumed_batches(trainer)
    skipping, exact = 0, True
    if batches == 0 or batches >= trainer.num_training_batches:
        return skipping, exact  # not resuming, or the checkpoint ended the epoch: the next one starts whole
    for index, loader in enumerate(loaders):
        if isinstance(loader, _Stateful):
            continue  # Lightning restores the loader's own state
        length = _length(loader)
        reason = unrestorable(loader)
        if reason is None and length is not None and batches >= length:
            reason = (f"it has {length} batches, fewer than the {batches} consumed, and the CombinedLoader cycles it;"
                      " give it state_dict()/load_state_dict() to resume it exactly")
        name = f"train loader {index} ({type(loader).__name__})"
        if reason is None:
            skip_batches(loader, batches)
            skipping += 1
            rank_zero_info(f"Resuming mid-epoch: {name} skips the {batches} batches of epoch"
                           f" {trainer.current_epoch} that the checkpoint consumed (by sampler indices, no data read).")
        else:
            exact = False
            rank_zero_warn(f"Resuming mid-epoch, after batch {batches} of epoch {trainer.current_epoch}: the position"
                           f" of {name} cannot be restored, so it re-reads the epoch from its start, as Lightning does:"
                           f" {reason}. (HPUDeepSpeedStrategy(resume_data_position=False) silences this.)")
    return skipping, exact


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def hook(trainer: Any) -> None:
    """For this fit of ``trainer``: where its first epoch starts (the checkpoint restored), apply the skip and make
    the train iterator again; where that made every loader exact, Lightning's warning that the loader is not
    resumable is not given."""
    from lightning_gaudi_ds import _compat

    def before_first_epoch() -> str | None:
        skipping, exact = apply(trainer, _compat.train_loaders_built(trainer))
        if skipping:
            _compat.restart_train_iterator(trainer)
        return LIGHTNING_NOT_RESUMABLE if skipping and exact else None

    _compat.hook_first_epoch_reset(trainer, before_first_epoch)


__all__ = ["SkipBatchSampler", "SkipSampler", "apply", "consumed_batches", "hook", "skip_batches", "unrestorable"]
