"""A rank that all-reduces over gloo every 0.2 s for ``--seconds`` s, printing each step: the multi-node tier cuts the
link under it. ``--pg-timeout`` is the process-group timeout (a collective that gets no answer fails after it)."""

import argparse
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=600)
parser.add_argument("--pg-timeout", type=float, default=20)
args = parser.parse_args()
for ours, *theirs in (("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"),
                      ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")):  # mpirun's, srun's
    for key in theirs:
        if ours not in os.environ and key in os.environ:
            os.environ[ours] = os.environ[key]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
rank, host, start, step = dist.get_rank(), socket.gethostname(), time.monotonic(), 0
while time.monotonic() - start < args.seconds:
    value = torch.ones(1)
    dist.all_reduce(value)
    print(f"rank {rank} on {host}: step {step} sum {int(value.item())}", flush=True)
    step += 1
    time.sleep(0.2)
dist.destroy_process_group()
