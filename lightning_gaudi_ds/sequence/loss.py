"""A causal language model's loss across the split: each rank of a sequence-parallel group holds the logits and the
labels of its part of the sequences, and every rank returns the loss of the whole sequences.

What makes it equal the loss without sequence parallelism (a mean over every label that is not ``-100``):

- the shift: the last position of a part predicts the first label of the next part, which another rank holds (one
  label per sequence is exchanged); the last part's last position predicts nothing, as without the split;
- the mean: each rank sums its cross-entropies and divides by the number of labels of the *whole* sequences (summed
  over the group), so that the parts add up to the mean;
- the sum over the group (:class:`_SumOverGroup`): an all-reduce forward, so every rank reports the same loss, and
  the identity backward (times a constant, ``gradient_scale``), so each rank back-propagates its own part only;
  DeepSpeed then sums the parts' gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import functional as F

from lightning_gaudi_ds.errors import InvalidArgumentError
from lightning_gaudi_ds.sequence.batch import IGNORE_INDEX


class _SumOverGroup(torch.autograd.Function):
    """The sum over a process group, forward; the identity times ``scale``, backward (each rank's part of a sum)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any, scale: float) -> Tensor:
        ctx.scale = scale
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return (grad * ctx.scale if ctx.scale != 1 else grad), None, None


def sum_over_group(tensor: Tensor, group: Any, gradient_scale: float = 1.0) -> Tensor:
    """The sum of ``tensor`` over ``group`` (None: no group, ``tensor`` itself), differentiable as each rank's own
    part of the sum: the value every rank reports, the gradient only of what this rank computed (times
    ``gradient_scale``)."""
    if group is None:
        return tensor
    return _SumOverGroup.apply(tensor, group, gradient_scale)


def shifted_labels(labels: Tensor, group: Any = None, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The label each position of ``labels`` (this rank's part, ``(batch, part)``) predicts: the next position's,
    the first of the next rank's part for its last position, ``ignore_index`` after the last part."""
    if group is None:
        tail = torch.full_like(labels[:, :1], ignore_index)
    else:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        first = labels[:, :1].contiguous()
        firsts = [torch.empty_like(first) for _ in range(size)]
        dist.all_gather(firsts, first, group=group)
        tail = firsts[rank + 1] if rank + 1 < size else torch.full_like(first, ignore_index)
    return torch.cat([labels[:, 1:], tail], dim=1)


def causal_lm_loss(
    logits: Tensor,
    labels: Tensor | None = None,
    *,
    group: Any = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
    gradient_scale: float = 1.0,
) -> Tensor:
    """The next-token cross-entropy of the whole sequences, from this rank's part (see the module's docstring).

    Args:
        logits: ``(batch, part, vocabulary)``, this rank's positions.
        labels: ``(batch, part)``, the same positions' token labels, unshifted (``-100``: not counted).
        group: the sequence-parallel group (None: the sequences are whole; then it is Hugging Face's
            ``ForCausalLMLoss``). Under ``HPUDeepSpeedStrategy(sequence_parallel_size=K)``, use
            :func:`lightning_gaudi_ds.sequence.causal_lm_loss`, which finds the group itself.
        shift_labels: the labels already shifted (instead of ``labels``).
        num_items_in_batch: the number of labels to divide by, counted over the whole sequences (default: those
            of this batch that are not ``ignore_index``).
        gradient_scale: multiplies the gradient of this rank's part (see :func:`sum_over_group`).
    """
    if shift_labels is None:
        if labels is None:
            raise InvalidArgumentError("causal_lm_loss needs `labels` (or `shift_labels`)")
        shift_labels = shifted_labels(labels, group, ignore_index)
    shift_labels = shift_labels.to(logits.device)
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is None:
        count = (shift_labels != ignore_index).sum()
        if group is not None:
            count = count.clone()
            dist.all_reduce(count, group=group)
        num_items_in_batch = count
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return sum_over_group(total / num_items_in_batch, group, gradient_scale)
