"""What a mid-epoch resume's skip costs (lightning_gaudi_ds/checkpoint/data_position.py), on a 10M-sample index.

Times, on the CPU, the first batch of an epoch from Lightning's ``DistributedSampler(shuffle=True)`` (the index
pass every epoch makes: the permutation), the same after skipping half the epoch's batches by index (the resume),
and, for scale, making those skipped batches of indices one by one as a custom batch sampler's skip does (no
sample is read in any of them)::

    PYTHONPATH=. python benchmarks/data_skip.py [--samples 10000000] [--batch 32] [--ranks 8]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_gaudi_ds.checkpoint.data_position import SkipBatchSampler


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class _Custom(BatchSampler):
    """Not torch's own BatchSampler: the skip makes its batches (lists of indices) and drops them."""


def _first_batch(batch_sampler: Any) -> float:
    started = time.perf_counter()
    next(iter(batch_sampler))
    return time.perf_counter() - started


def measure(samples: int, batch: int, ranks: int) -> dict[str, Any]:
    sampler = DistributedSampler(_Sized(samples), num_replicas=ranks, rank=0, shuffle=True)  # type: ignore[arg-type]
    batches = BatchSampler(sampler, batch, drop_last=False)
    skip = len(batches) // 2
    whole = min(_first_batch(batches) for _ in range(3))
    skipped = min(_first_batch(SkipBatchSampler(batches, skip)) for _ in range(3))
    custom = _Custom(sampler, batch, drop_last=False)  # a batch sampler of the user's: skipped batch by batch
    by_batch = min(_first_batch(SkipBatchSampler(custom, skip)) for _ in range(3))
    return {"samples": samples, "ranks": ranks, "batch": batch, "skipped_batches": skip,
            "first_batch_s": round(whole, 4), "first_batch_after_skip_s": round(skipped, 4),
            "skip_cost_s": round(skipped - whole, 4), "custom_first_batch_after_skip_s": round(by_batch, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.samples, args.batch, args.ranks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
