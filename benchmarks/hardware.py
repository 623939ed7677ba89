"""This CPU's achieved rates, the inputs of the step-time model's ``cpu`` row (lightning_gaudi_ds/planning/steptime.py).

    python benchmarks/hardware.py            # results/hardware.json and .md (about a minute)

One thread per process, as the benchmarks' ranks run. Each rate is given per second of the process's CPU time (user +
system, all its threads: what other jobs on a shared machine change least) and per wall second:

- **matmul**: ``torch.mm`` of a micro-batch of 16 rows by a 1024 x 1024 weight, fp32 and bf16, FLOPs 2·m·n·k;
- **training matmul**: forward and backward of 4 ``Linear(1024, 1024)`` layers on a micro-batch of 16, in fp32 and
  under ``autocast(bfloat16)`` (as the benchmarks' model trains), FLOPs 6·in·out per sample (the forward's 2 and the
  backward's 4): the step-time model's ``cpu`` peak;
- **memory bandwidth**: copies of 256 MB fp32 tensors (bytes read + written);
- **gloo**: two processes on this host (loopback): all-reduce, all-gather and reduce of a 64 MB bf16 buffer, as bytes
  one rank sends per second (gloo's ring: 2(N-1)/N of the buffer for all-reduce, (N-1)/N for all-gather; reduce:
  (N-1)/N + the root's share), per the sender's CPU time (its gloo threads included) and per wall second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import publish  # noqa: E402
from flags import positive_float  # noqa: E402

RESULTS = HERE / "results"


def timed(fn: Callable[[], None], seconds: float) -> tuple[int, float, float]:
    """Run ``fn`` repeatedly for about ``seconds`` of wall time after one warm-up call: (calls, cpu s, wall s)."""
    fn()
    calls, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - wall0 < seconds:
        fn()
        calls += 1
    return calls, time.process_time() - cpu0, time.perf_counter() - wall0


def rate(amount: float, calls: int, cpu: float, wall: float) -> dict[str, float]:
    return {"per_cpu_second": amount * calls / cpu, "per_wall_second": amount * calls / wall}


def compute_rates(seconds: float) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    m, k, n = 16, 1024, 1024
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        name = f"matmul_{str(dtype).split('.')[-1]}_flops"
        out[name] = rate(2 * m * k * n, *timed(lambda: torch.mm(a, b), seconds))  # noqa: B023
    layers = torch.nn.Sequential(*[torch.nn.Linear(k, n) for _ in range(4)])
    x = torch.randn(m, k)

    def train_step(dtype: torch.dtype) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = layers(x)
        y.float().square().mean().backward()

    for dtype in (torch.float32, torch.bfloat16):
        name = f"train_matmul_{str(dtype).split('.')[-1]}_flops"
        out[name] = rate(6 * m * k * n * 4, *timed(lambda: train_step(dtype), seconds))  # noqa: B023
    src, dst = torch.empty(64 * 2**20), torch.empty(64 * 2**20)  # 256 MB each
    out["memory_bytes"] = rate(2 * src.numel() * 4, *timed(lambda: dst.copy_(src), seconds))
    out["shapes"] = {"micro_batch": m, "in": k, "out": n}
    return out


def _gloo_rank(rank: int, port: int, seconds: float, queue: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    numel = 32 * 2**20  # 64 MB of bf16
    buf = torch.ones(numel, dtype=torch.bfloat16)
    gathered = torch.empty(numel, dtype=torch.bfloat16)
    half = buf[: numel // 2]
    sent = {  # bytes one rank sends per call (gloo, N = 2), averaged over the ranks for reduce
        "all_reduce": (lambda: dist.all_reduce(buf), 2 * 0.5 * numel * 2),
        "all_gather": (lambda: dist.all_gather_into_tensor(gathered, half), 0.5 * numel * 2),
        "reduce": (lambda: dist.reduce(buf, dst=0), (0.5 + 0.5 * 0.5) * numel * 2),
    }
    result = {}
    for op, (fn, nbytes) in sent.items():
        dist.barrier()
        result[op] = rate(nbytes, *timed(fn, seconds))
        dist.barrier()
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def gloo_rates(seconds: float) -> dict[str, Any]:
    import multiprocessing as mp

    sys.path.insert(0, str(HERE.parent))
    from lightning_gaudi_ds.launch._proc import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, seconds, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a gloo rank failed: exit codes {[p.exitcode for p in procs]}")
    return {f"gloo_{op}_bytes_sent": r for op, r in result.items()}


def markdown(meta: dict[str, Any], rates: dict[str, Any]) -> str:
    lines = [f"# This CPU's achieved rates ({meta['cpu']}, {meta['date']})", "",
             f"`python benchmarks/hardware.py`; 1 thread per process; torch {meta['torch']}; load average"
             f" {', '.join(map(str, meta['load']))} at the end (CPU-time rates change least with it).", "",
             "| rate | per CPU-second | per wall second |", "|---|---|---|"]
    for name, value in rates.items():
        if isinstance(value, dict) and "per_cpu_second" in value:
            unit = "GFLOP/s" if name.endswith("flops") else "GB/s"
            lines.append(f"| {name} | {value['per_cpu_second'] / 1e9:.2f} {unit} |"
                         f" {value['per_wall_second'] / 1e9:.2f} {unit} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=positive_float, default=4.0, help="wall seconds per measurement")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    import torch

    rates = {**compute_rates(args.seconds), **gloo_rates(args.seconds)}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
            "isa": sorted(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2"))),
            "torch": torch.__version__, "load": [round(x, 1) for x in os.getloadavg()]}
    with publish.staged(args.out) as stage:
        (stage.path / "hardware.json").write_text(json.dumps({"meta": meta, "rates": rates}, indent=1) + "\n")
        (stage.path / "hardware.md").write_text(markdown(meta, rates))
    print(markdown(meta, rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
