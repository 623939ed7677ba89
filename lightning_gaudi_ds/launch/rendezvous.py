"""A bounded, talkative rendezvous: while the process group waits for ranks that have not joined (a second node
that was never started), say what is awaited every few seconds, and give up after a time limit with an error that
says how multi-node runs are started, instead of waiting silently for torch's 30 minutes."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from lightning_gaudi_ds.launch._proc import say

TIMEOUT_ENV = "LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT"
DEFAULT_TIMEOUT = 600.0  # s: nodes of one job started by hand or by a scheduler are usually up within minutes
FIRST_NOTICE = 3.0  # s before the first "waiting for" line: a rendezvous of ranks that are all there is done by then

HOW_TO_START = (
    "A multi-node run starts the same script on every node, each with the same MASTER_ADDR (node 0's address, reachable"
    " from the others) and MASTER_PORT and its own NODE_RANK (0..num_nodes-1); or let a launcher do it:"
    " `lightning-gaudi-ds spawn --hostfile hosts --use_deepspeed train.py` (every node over ssh),"
    " `lightning-gaudi-ds spawn --hostfile hosts --node_rank I --master_addr NODE0 train.py` (run on each node),"
    " SLURM's srun, or mpirun (docs/launching.md). On one machine, use Trainer(num_nodes=1)."
)


def rendezvous_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds the process group may take to form: ``$LIGHTNING_GAUDI_DS_RENDEZVOUS_TIMEOUT``, default 600."""
    text = environ.get(TIMEOUT_ENV)
    if text is None or text == "":
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: pass the seconds the ranks may take to meet, a number > 0"
                         f" (default {DEFAULT_TIMEOUT:g}).")
    return value


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
