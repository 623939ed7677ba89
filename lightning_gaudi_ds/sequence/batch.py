"""A batch cut along the sequence dimension: each of the ``K`` ranks of a sequence-parallel group keeps ``1/K`` of
every sequence, in order (rank 0 the first part).

The sequence length is that of ``input_ids`` (or ``inputs_embeds``) in a dict batch, else of the first tensor with
two or more dimensions; every tensor whose second dimension has that length is cut, everything else (a label per
sample, scalars, strings) is kept whole. A length that ``K`` does not divide is padded at the end where the values
are known: ``labels`` with -100 (ignored by the loss), ``attention_mask`` with 0, ``position_ids`` counting on, token
ids with 0 (a causal model's real tokens never attend to later positions). Any other batch is refused, naming the
length: pad it to a multiple of ``K`` in the collate function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning_utilities import apply_to_collection

from lightning_gaudi_ds.errors import ConfigError

IGNORE_INDEX = -100
# What the end of a dict batch's tensors is padded with; "count": position ids go on from the last one.
PAD_VALUES: dict[str, int | str] = {
    "input_ids": 0, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0, "token_type_ids": 0,
    "position_ids": "count", "loss_mask": 0,
}


def sequence_length(batch: Any) -> int | None:
    """The length of the batch's sequences (see the module's docstring), or None when it has none."""
    if isinstance(batch, Mapping):
        for key in ("input_ids", "inputs_embeds"):
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return int(value.shape[1])
    found: list[int] = []

    def first(tensor: torch.Tensor) -> torch.Tensor:
        if not found and tensor.dim() >= 2:
            found.append(int(tensor.shape[1]))
        return tensor

    apply_to_collection(batch, torch.Tensor, first)
    return found[0] if found else None


def shard_batch(batch: Any, size: int, rank: int) -> Any:
    """This rank's part of every sequence of ``batch`` (``size`` ranks per sequence, this one at ``rank``)."""
    if size == 1:
        return batch
    length = sequence_length(batch)
    if length is None:
        raise ConfigError(
            f"sequence_parallel_size={size}: the batch ({_describe(batch)}) has no tensor with a sequence dimension"
            " (batch, sequence, ...) to split. Give the model token ids shaped (batch, sequence), or use"
            " sequence_parallel_size=1 for this model."
        )
    if length % size:
        batch = _padded(batch, length, size)
        length = sequence_length(batch)
        assert length is not None
    part = length // size
    start = rank * part

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() >= 2 and tensor.shape[1] == length:
            return tensor[:, start:start + part]
        return tensor

    return apply_to_collection(batch, torch.Tensor, cut)


def _padded(batch: Any, length: int, size: int) -> Any:
    target = -(-length // size) * size
    if not isinstance(batch, Mapping):
        raise ConfigError(
            f"sequence_parallel_size={size}: the batch's sequences are {length} long, which {size} ranks cannot share"
            f" evenly, and a {type(batch).__name__} batch does not say which tensor holds labels or a mask to pad."
            f" Pad the sequences to a multiple of {size} (e.g. {target}) in the collate function (labels with -100),"
            " or return a dict batch (input_ids, labels, attention_mask), which the strategy pads itself."
        )
    unknown = [key for key, value in batch.items() if isinstance(value, torch.Tensor) and value.dim() >= 2
               and value.shape[1] == length and key not in PAD_VALUES]
    if unknown:
        raise ConfigError(
            f"sequence_parallel_size={size}: the batch's sequences are {length} long, which {size} ranks cannot share"
            f" evenly, and the strategy does not know what to pad {', '.join(map(repr, unknown))} with (it pads"
            f" {', '.join(sorted(PAD_VALUES))}). Pad the sequences to a multiple of {size} (e.g. {target}) in the"
            " collate function."
        )
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            out[key] = _pad(value, PAD_VALUES[key], target - length)
    return type(batch)(out) if _rebuildable(batch) else out  # type: ignore[call-arg]


def _pad(tensor: torch.Tensor, value: int | str, extra: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[1] = extra
    if value == "count":
        step = torch.arange(1, extra + 1, device=tensor.device, dtype=tensor.dtype)
        tail = tensor[:, -1:] + step.view(1, extra, *([1] * (tensor.dim() - 2)))
    else:
        tail = torch.full(shape, int(value), dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, tail.expand(shape) if value == "count" else tail], dim=1)


def _rebuildable(batch: Mapping[str, Any]) -> bool:
    """Whether ``type(batch)(dict)`` makes the same kind of batch (dict subclasses such as transformers'
    BatchEncoding do)."""
    try:
        return isinstance(type(batch)(dict(batch)), Mapping)  # type: ignore[call-arg]
    except Exception:
        return False


def _describe(batch: Any) -> str:
    if isinstance(batch, torch.Tensor):
        return f"a tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, Mapping):
        return "a dict of " + ", ".join(f"{k}: {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
                                        for k, v in batch.items())
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return f"a {type(batch).__name__} of " + ", ".join(
            str(tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__ for v in batch)
    return type(batch).__name__
