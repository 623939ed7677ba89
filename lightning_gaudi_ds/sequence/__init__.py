"""DeepSpeed-Ulysses sequence parallelism: ``K`` ranks share each sequence, each holding ``1/K`` of it, so that a
sequence ``K`` times longer trains in the same memory (activations and the batch are split; ZeRO splits the model
states as without it).

``HPUDeepSpeedStrategy(sequence_parallel_size=K)`` (Trainer and Fabric) does it all: the groups (:mod:`.groups`),
each batch split along the sequence (:mod:`.batch`), the all-to-all around attention (:mod:`.attention`; for Hugging
Face models :mod:`.hf`, with no change to their code; for your own attention modules
``sequence_parallel_modules=[...]``), and the loss across the split (:mod:`.loss`). The strategies call the entry
points of :class:`~.runtime.SequenceParallel`.

For a model of your own, compute the loss with :func:`causal_lm_loss`: it is Hugging Face's causal language model
loss at any ``K`` (every rank returns the loss of the whole sequences).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_gaudi_ds.sequence.batch import IGNORE_INDEX, shard_batch
from lightning_gaudi_ds.sequence.loss import causal_lm_loss as _causal_lm_loss
from lightning_gaudi_ds.sequence.runtime import SequenceParallel, active_groups

__all__ = ["SequenceParallel", "causal_lm_loss", "shard_batch"]


def causal_lm_loss(logits: Tensor, labels: Tensor | None = None, *, ignore_index: int = IGNORE_INDEX,
                   shift_labels: Tensor | None = None, num_items_in_batch: Any = None) -> Tensor:
    """Next-token cross-entropy, the mean over every label that is not ``ignore_index`` (Hugging Face's
    ``ForCausalLMLoss``), of the whole sequences: under ``HPUDeepSpeedStrategy(sequence_parallel_size=K)``
    ``logits`` and ``labels`` are this rank's part of the sequences (the strategy split the batch), and every rank
    returns the same loss; without it, the plain loss.

    Args:
        logits: ``(batch, sequence part, vocabulary)``.
        labels: ``(batch, sequence part)``, unshifted: position ``i`` is scored on predicting ``labels[i + 1]``.
        shift_labels: already shifted labels, instead of ``labels``.
        num_items_in_batch: what to divide the summed loss by (default: the labels counted over the whole
            sequences).
    """
    groups = active_groups()
    return _causal_lm_loss(logits, labels, group=groups.group if groups is not None else None,
                           ignore_index=ignore_index, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                           gradient_scale=groups.gradient_scale if groups is not None else 1.0)
