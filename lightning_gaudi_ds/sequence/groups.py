"""The process groups of sequence parallelism, and the ``mpu`` object DeepSpeed's engine reads them from.

``world`` ranks split into ``world / K`` sequence-parallel groups of ``K`` consecutive ranks (a node's ranks exchange
the attention all-to-all among themselves first). The ``K`` ranks of a group read the same batch, each one ``1/K``
of every sequence; the data-parallel groups join the ranks holding the same part across the ``world / K`` groups.

DeepSpeed (0.16 and later, Habana's fork included) takes them from a Megatron-style "model parallel unit" passed as
``deepspeed.initialize(mpu=...)`` (:class:`ParallelUnit`):

- its data-parallel size is ``world / K``: the batch arithmetic (``train_batch_size = micro batch x accumulation x
  world / K``) and the gradient average, which sums the ``K`` partial gradients of a sequence and averages over the
  ``world / K`` sequences;
- ZeRO partitions over the sequence-data-parallel group, every rank: the model states of a ``K``-way run take as
  little memory, and its checkpoints have the same layout, as those of the same world without sequence parallelism;
- there is no model (tensor) parallelism: a group of this rank alone, as DeepSpeed's norms and overflow checks
  all-reduce over it unconditionally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lightning_gaudi_ds.errors import InvalidArgumentError


def layout(world_size: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(sequence-parallel groups, data-parallel groups)`` of ``world_size`` ranks with ``size`` ranks per sequence:
    blocks of consecutive ranks, and the ranks at the same place in every block."""
    if size < 1 or world_size % size:
        raise InvalidArgumentError(f"sequence_parallel_size={size} does not divide the world size {world_size}")
    sequence = [list(range(start, start + size)) for start in range(0, world_size, size)]
    data = [list(range(offset, world_size, size)) for offset in range(size)]
    return sequence, data


@dataclass
class SequenceGroups:
    """This rank's place: its sequence-parallel group (``size`` ranks, this one at ``rank``) and its data-parallel
    group (``data_parallel_size`` ranks, this one at ``data_parallel_rank``).

    ``gradient_scale``: what the gradient of each rank's part of the loss is multiplied by
    (:func:`~lightning_gaudi_ds.sequence.loss.sum_over_group`): 1, or ``size`` under ZeRO-3, whose engine is made to
    average over every rank (see :meth:`~lightning_gaudi_ds.sequence.runtime.SequenceParallel.engine_ready`)."""

    size: int
    rank: int
    group: Any
    data_parallel_size: int
    data_parallel_rank: int
    data_parallel_group: Any
    data_parallel_ranks: tuple[int, ...]
    alone: Any  # a group of this rank only: the (absent) model parallelism
    gradient_scale: float = field(default=1.0)

    @classmethod
    def build(cls, size: int) -> SequenceGroups:
        """Create the groups on the default process group (collective: every rank calls it, in the same order)."""
        world, me = dist.get_world_size(), dist.get_rank()
        sequence, data = layout(world, size)
        mine: dict[str, Any] = {}
        for ranks in sequence:
            group = dist.new_group(ranks)
            if me in ranks:
                mine["group"] = group
        for ranks in data:
            group = dist.new_group(ranks)
            if me in ranks:
                mine["data"], mine["data_ranks"] = group, tuple(ranks)
        for rank in range(world):
            group = dist.new_group([rank])
            if rank == me:
                mine["alone"] = group
        return cls(size=size, rank=me % size, group=mine["group"], data_parallel_size=world // size,
                   data_parallel_rank=me // size, data_parallel_group=mine["data"],
                   data_parallel_ranks=mine["data_ranks"], alone=mine["alone"])


class ParallelUnit:
    """The ``mpu`` of ``deepspeed.initialize`` and ``deepspeed.zero.Init`` for sequence parallelism (see the module's
    docstring); also what DeepSpeed's ``groups.mpu`` holds while the engine lives."""

    def __init__(self, groups: SequenceGroups) -> None:
        self.groups = groups

    # sequence parallelism: the ranks that share one sequence
    def get_sequence_parallel_group(self) -> Any:
        return self.groups.group

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.size

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.rank

    # ZeRO's partitions and gradient reduction: every rank
    def get_sequence_data_parallel_group(self) -> Any:
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    # data parallelism: the sequences (batch sizes, the gradient average)
    def get_data_parallel_group(self) -> Any:
        return self.groups.data_parallel_group

    def get_data_parallel_world_size(self) -> int:
        return self.groups.data_parallel_size

    def get_data_parallel_rank(self) -> int:
        return self.groups.data_parallel_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.groups.data_parallel_ranks)

    # no model, tensor or pipeline parallelism: groups of one rank
    def get_model_parallel_group(self) -> Any:
        return self.groups.alone

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_pipeline_model_parallel_group = get_model_parallel_group
    get_pipeline_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()
