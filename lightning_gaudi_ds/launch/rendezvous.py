"""A bounded, talkative rendezvous: while the process group waits for ranks that have not joined (a second node
that was never started), say what is awaited every few seconds, and give up after a time limit with an error that
says how multi-node runs are started, instead of waiting silently for torch's 30 minutes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

from lightning_gaudi_ds.errors import SetupError
from lightning_gaudi_ds.launch import envvars
from lightning_gaudi_ds.launch._proc import say

# LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT, default 600 s: nodes of one job started by hand or by a scheduler are
# usually up within minutes.
TIMEOUT_ENV = envvars.RENDEZVOUS_TIMEOUT.name
FIRST_NOTICE = 3.0  # s before the first "waiting for" line: a rendezvous of ranks that are all there is done by then

HOW_TO_START = (
    "A multi-node run starts the same script on every node, each with the same MASTER_ADDR (node 0's address, reachable"
    " from the others) and MASTER_PORT and its own NODE_RANK (0..num_nodes-1); or let a launcher do it:"
    " `lightning-gaudi-ds spawn --hostfile hosts --use_deepspeed train.py` (every node over ssh),"
    " `lightning-gaudi-ds spawn --hostfile hosts --node_rank I --master_addr NODE0 train.py` (run on each node),"
    " SLURM's srun, or mpirun (docs/launching.md). On one machine, use Trainer(num_nodes=1)."
)


@contextmanager
def announce_wait(what: str, timeout: float, enabled: bool = True) -> Iterator[None]:
    """Say ``what`` is awaited after :data:`FIRST_NOTICE` s and then every ``min(10, timeout / 4)`` s, until the
    block ends."""
    if not enabled:
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def notify() -> None:
        pause = min(FIRST_NOTICE, timeout / 2)
        while not done.wait(pause):
            say(f"{what}; waited {time.monotonic() - start:.0f} s of {timeout:g} s ({TIMEOUT_ENV}).")
            pause = max(1.0, min(10.0, timeout / 4))

    thread = threading.Thread(target=notify, name="rendezvous-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)


def timed_out_message(what: str, timeout: float, error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"The ranks did not meet within {timeout:g} s: {what}, and not every rank joined ({first}). {HOW_TO_START}"
            f" To wait longer, set {TIMEOUT_ENV}=<seconds>.")


def waiting_message(global_rank: int, world_size: int, num_nodes: int, num_processes: int, address: str,
                    port: int) -> str:
    """What a rank waits for while the process group forms (said while it waits, and in the time-out error)."""
    return (f"rank {global_rank} waits for {world_size} processes (Trainer(num_nodes={num_nodes}) x"
            f" {num_processes} per node) to meet at {address}:{port}")


def bounded_rendezvous(
    init: Callable[[], None], what: str, full: timedelta, set_timeout: Callable[[timedelta], None], *,
    limit: float, announce: bool,
) -> None:
    """Run ``init`` (which forms the process group with the timeout last given to ``set_timeout``) with the timeout
    bounded by ``limit`` seconds, announcing ``what`` while it waits when ``announce``; a rendezvous that runs out
    of time is a ``RuntimeError`` saying how multi-node runs start. Once the group has formed, its own timeout
    (``full``) applies again."""
    import torch

    from lightning_gaudi_ds._compat import set_process_group_timeout

    bounded = min(full, timedelta(seconds=limit))
    set_timeout(bounded)
    start = time.monotonic()
    try:
        with announce_wait(what, limit, enabled=announce):
            init()
    except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        if time.monotonic() - start < 0.9 * bounded.total_seconds():
            raise
        raise SetupError(timed_out_message(what, limit, err)) from err
    finally:
        set_timeout(full)
    if full > bounded and torch.distributed.is_initialized():
        set_process_group_timeout(full)
