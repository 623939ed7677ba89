"""Start-up time (process start to first training step, 2 ranks) and the CPU shm op's all-reduce vs gloo.

    python benchmarks/startup.py                 # both parts; results in benchmarks/results/startup.{jsonl,md}
    python benchmarks/startup.py --part startup --rounds 3 --offload-rounds 1
    python benchmarks/startup.py --part allreduce --iters 30

Every run uses private, fresh ``TORCH_EXTENSIONS_DIR`` temp dirs (never the shared cache).

Start-up scenarios (each a real 2-rank Lightning job on gloo, ZeRO-2):
- ``deepspeed_jit``: ``LIGHTNING_GAUDI_DS_SHM_COMM=on`` = DeepSpeed's own behaviour, the op compiled at
  start-up when missing; ``cold`` on an empty cache, ``warm`` once built.
- ``default``: this project's default (``off``): the op is neither built nor loaded (training's collectives
  never use it); ``cold`` on an empty cache, ``warm`` with the op prebuilt.
- ``offload`` (``--offload-rounds N``): ZeRO-2 with CPU optimizer offload, which needs the ``cpu_adam`` op.
- ``prebuild``: ``python -m lightning_gaudi_ds env --build-ops OP`` on an empty cache (what scripts/setup.sh runs).

All-reduce: 2 ranks with ``LOCAL_SIZE=2`` (so DeepSpeed's kernel engages), the same tensors reduced by
``deepspeed.comm.inference_all_reduce`` (the shm op) and by ``torch.distributed.all_reduce`` (gloo),
interleaved, alternating which goes first; per iteration the slower rank's time; the median over iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import publish
from flags import file_stem, int_at_least, int_list, non_negative_int, positive_int

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------- the jobs
def training_job(argv: list[str]) -> None:
    """A 2-rank job that writes the wall-clock time of its first training step (started by the driver)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--offload", action="store_true")
    args = parser.parse_args(argv)

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 4))
            self.first_step: float | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.first_step is None:
                self.first_step = time.time()
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            if args.offload:  # the strategy steps it with DeepSpeedCPUAdam (the cpu_adam op)
                return torch.optim.AdamW(self.parameters(), lr=1e-3)
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    L.seed_everything(0)
    data = TensorDataset(torch.randn(64, 32), torch.randn(64, 4))
    model = Model()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HPUDeepSpeedStrategy(stage=2, offload_optimizer=args.offload),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps({"first_step": model.first_step}))


def allreduce_worker(argv: list[str]) -> None:
    """One rank of the all-reduce comparison (RANK/WORLD_SIZE/LOCAL_SIZE/MASTER_* set by the driver)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=positive_int, default=30)
    parser.add_argument("--warmup", type=non_negative_int, default=5)
    parser.add_argument("--sizes", default="1024,16384,262144,4194304")
    args = parser.parse_args(argv)

    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.comm.comm as dist_state
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    backend = dist_state.cdb
    if getattr(backend, "shm_comm_op", None) is None:
        raise SystemExit("the shm op was not loaded: build it first (lightning-gaudi-ds env --build-ops)")
    level = getattr(backend, "shm_vector_kernel_level", 0)
    sizes = [int(s) for s in args.sizes.split(",")]
    dtypes = [torch.float32] + ([torch.bfloat16] if level >= 2 else [])
    methods = {
        "shm": lambda t: dist.inference_all_reduce(t),
        "gloo": lambda t: tdist.all_reduce(t),
    }
    times: dict[str, list[float]] = {}
    for it in range(args.warmup + args.iters):
        order = list(methods) if it % 2 == 0 else list(methods)[::-1]
        for dtype in dtypes:
            for numel in sizes:
                for name in order:
                    t = torch.full((numel,), float(rank + 1), dtype=dtype)
                    tdist.barrier()
                    start = time.perf_counter()
                    methods[name](t)
                    elapsed = time.perf_counter() - start
                    expected = world * (world + 1) / 2
                    if float(t[0]) != expected or float(t[-1]) != expected:
                        raise SystemExit(f"{name} {dtype} {numel}: wrong result {float(t[0])} != {expected}")
                    if it >= args.warmup:
                        times.setdefault(f"{name}|{str(dtype).split('.')[-1]}|{numel}", []).append(elapsed)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({"times": times, "vector_kernel_level": level}))
    tdist.barrier()
    tdist.destroy_process_group()
    from lightning_gaudi_ds.jit_ops.startup import _unlink_own_segment

    _unlink_own_segment(rank)  # DeepSpeed leaks its 66 MB /dev/shm segment per rank otherwise


# ------------------------------------------------------------------------------------- the driver
_EXT_DIRS: list[Path] = []


def _fresh_ext_dir(tag: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"lgds_bench_ext_{tag}_"))
    _EXT_DIRS.append(path)
    return path


def _run(args: list[str], env: dict[str, str], timeout: float = 900) -> tuple[float, str]:
    from tests.procs import run_job

    result = run_job(args, timeout=timeout, env=env)
    result.check()
    return result.seconds, result.output


def run_startup(ext: Path, mode: str, offload: bool = False) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="lgds_bench_out_"))
    env = {"TORCH_EXTENSIONS_DIR": str(ext), "LIGHTNING_GAUDI_DS_SHM_COMM": mode}
    t0 = time.time()
    total, _ = _run([sys.executable, __file__, "_job", "--out", str(out), *(["--offload"] if offload else [])], env)
    firsts = [json.loads(p.read_text())["first_step"] for p in sorted(out.glob("rank*.json"))]
    shutil.rmtree(out, ignore_errors=True)
    if len(firsts) != 2:
        raise RuntimeError(f"expected 2 ranks' results, got {len(firsts)}")
    return {"startup_s": round(max(firsts) - t0, 2), "total_s": round(total, 2)}


def prebuild(ext: Path, op: str) -> float:
    seconds, _ = _run([sys.executable, "-m", "lightning_gaudi_ds", "env", "--build-ops", op], {"TORCH_EXTENSIONS_DIR": str(ext)})
    return round(seconds, 2)


def part_startup(rounds: int, offload_rounds: int, emit: Any) -> Path:
    """Cold and warm start-ups, interleaved in rounds so each pair meets the same machine load.

    Returns an extensions dir with the shm op prebuilt (for the all-reduce part).
    """
    ext_pre = _fresh_ext_dir("prebuilt")
    emit({"scenario": "prebuild", "op": "deepspeed_shm_comm", "seconds": prebuild(ext_pre, "deepspeed_shm_comm")})
    for _ in range(rounds):
        ext_jit = _fresh_ext_dir("jit")
        emit({"scenario": "deepspeed_jit", "cache": "cold", **run_startup(ext_jit, "on")})
        emit({"scenario": "deepspeed_jit", "cache": "warm", **run_startup(ext_jit, "on")})
        emit({"scenario": "default", "cache": "cold", **run_startup(_fresh_ext_dir("default"), "off")})
        emit({"scenario": "default", "cache": "warm", **run_startup(ext_pre, "off")})
    if offload_rounds:
        ext_adam = _fresh_ext_dir("adam")
        emit({"scenario": "prebuild", "op": "cpu_adam", "seconds": prebuild(ext_adam, "cpu_adam")})
        for _ in range(offload_rounds):
            emit({"scenario": "offload", "cache": "cold", **run_startup(_fresh_ext_dir("offload"), "off", True)})
            emit({"scenario": "offload", "cache": "warm", **run_startup(ext_adam, "off", True)})
    return ext_pre


def part_allreduce(ext: Path, iters: int, sizes: str, emit: Any) -> None:
    from tests.procs import free_port, job_env, kill_group

    out = Path(tempfile.mkdtemp(prefix="lgds_bench_ar_"))
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = job_env({"TORCH_EXTENSIONS_DIR": str(ext), "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "MASTER_PORT": port})
        procs.append(subprocess.Popen([sys.executable, __file__, "_allreduce", "--out", str(out), "--iters",
                                       str(iters), "--sizes", sizes], env=env, cwd=REPO, start_new_session=True))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p.pid)
    if any(codes):
        raise RuntimeError(f"all-reduce workers failed: {codes}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    for key in ranks[0]["times"]:
        per_iter = [max(r["times"][key][i] for r in ranks) for i in range(len(ranks[0]["times"][key]))]
        method, dtype, numel = key.split("|")
        emit({"scenario": "allreduce", "method": method, "dtype": dtype, "numel": int(numel),
              "median_us": round(statistics.median(per_iter) * 1e6, 1), "iters": len(per_iter),
              "vector_kernel_level": ranks[0]["vector_kernel_level"]})
    shutil.rmtree(out, ignore_errors=True)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    commands = list(dict.fromkeys(f"`{r['command']}` ({r['when']})" for r in rows if r.get("command")))
    lines = ["# Start-up and shm all-reduce", "",
             f"Machine: {meta['cpus']} CPUs, {meta['platform']}; torch {meta['torch']}, deepspeed {meta['deepspeed']},"
             f" lightning {meta['lightning']}. Rows from: {'; '.join(commands)}.",
             "The machine was shared with other jobs: see the load averages; medians, not means.", ""]
    lines += ["Scenarios: `deepspeed_jit` = DeepSpeed's own behaviour (`LIGHTNING_GAUDI_DS_SHM_COMM=on`: the shm op"
              " is compiled at start-up when missing); `default` = this project's default (`off`: the op is neither"
              " built nor loaded; training's all-reduce never uses it); `offload` = ZeRO-2 with CPU optimizer offload"
              " (needs `cpu_adam`). `cold` = empty TORCH_EXTENSIONS_DIR, `warm` = ops already built.", ""]
    starts = [r for r in rows if "startup_s" in r]
    if starts:
        lines += ["## Start-up: process start to first training step, 2 ranks (median; n runs)", "",
                  "| scenario | cache | start-up s | n | all runs | load avg (1 min, mean) |", "|---|---|---|---|---|---|"]
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in starts:
            groups.setdefault((r["scenario"], r["cache"]), []).append(r)
        for (scenario, cache), group in groups.items():
            vals = [r["startup_s"] for r in group]
            load = statistics.mean(r.get("loadavg", float("nan")) for r in group)
            lines.append(f"| {scenario} | {cache} | {statistics.median(vals):.1f} | {len(vals)} |"
                         f" {', '.join(map(str, vals))} | {load:.1f} |")
        lines.append("")
    builds = [r for r in rows if r["scenario"] == "prebuild"]
    if builds:
        lines += ["| prebuild (`python -m lightning_gaudi_ds env --build-ops OP`, empty cache) | seconds |", "|---|---|"]
        lines += [f"| {r['op']} | {r['seconds']} |" for r in builds] + [""]
    ar = [r for r in rows if r["scenario"] == "allreduce"]
    ar = [r for r in ar if r.get("when") == ar[-1].get("when")]  # the latest all-reduce run only
    if ar:
        load = statistics.mean(r.get("loadavg", float("nan")) for r in ar)
        lines += ["## All-reduce, 2 ranks, same tensors: shm op vs gloo (median of per-iteration max over ranks)", "",
                  f"{ar[0]['iters']} iterations after 5 warm-up, interleaved, alternating which goes first;"
                  f" load average {load:.1f} on {meta['cpus']} CPUs.", "",
                  "| dtype | elements | bytes | shm µs | gloo µs | gloo / shm |", "|---|---|---|---|---|---|"]
        by = {(r["dtype"], r["numel"], r["method"]): r for r in ar}
        for dtype, numel in sorted({(r["dtype"], r["numel"]) for r in ar}):
            shm, gloo = by[(dtype, numel, "shm")]["median_us"], by[(dtype, numel, "gloo")]["median_us"]
            nbytes = numel * (4 if dtype == "float32" else 2)
            lines.append(f"| {dtype} | {numel} | {nbytes} | {shm} | {gloo} | {gloo / shm:.1f}x |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_job"]:
        training_job(argv[1:])
        return 0
    if argv[:1] == ["_allreduce"]:
        allreduce_worker(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "startup", "allreduce", "table"), default="all",
                        help="table: only rewrite the markdown from the JSON-lines file")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds of cold+warm start-ups (interleaved)")
    parser.add_argument("--offload-rounds", type=non_negative_int, default=0,
                        help="rounds of cold+warm ZeRO-Offload start-ups (the cpu_adam op; slow to build)")
    parser.add_argument("--iters", type=int_at_least(20), default=30, help="all-reduce iterations (median), >= 20")
    parser.add_argument("--sizes", type=int_list, default="1024,16384,262144,4194304",
                        help="all-reduce sizes (elements)")
    parser.add_argument("--ext", type=Path, help="all-reduce part: a TORCH_EXTENSIONS_DIR to (re)use and keep")
    parser.add_argument("--tag", type=file_stem, default="startup", help="output file stem under benchmarks/results/")
    args = parser.parse_args(argv)

    import deepspeed
    import lightning
    import torch

    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "loadavg": round(os.getloadavg()[0], 2),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "lightning": lightning.__version__,
            "platform": platform.platform(), "command": "python benchmarks/startup.py " + " ".join(argv)}
    jsonl = RESULTS / f"{args.tag}.jsonl"
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        row = {**row, "loadavg": round(os.getloadavg()[0], 2), "command": meta["command"]}
        rows.append(row)
        print(json.dumps(row), flush=True)

    ext = None
    try:
        if args.part in ("all", "startup"):
            ext = part_startup(args.rounds, args.offload_rounds, emit)
        if args.part in ("all", "allreduce"):
            if args.ext is not None:
                ext = args.ext
                prebuild(ext, "deepspeed_shm_comm")
            elif ext is None:
                ext = _fresh_ext_dir("ar")
                prebuild(ext, "deepspeed_shm_comm")
            part_allreduce(ext, args.iters, ",".join(map(str, args.sizes)), emit)
    finally:
        for path in _EXT_DIRS:
            shutil.rmtree(path, ignore_errors=True)
    # Only a run that ended well adds its rows. The table covers every row in the JSON-lines file (a --part run adds
    # to an earlier one; delete it to restart).
    text = (jsonl.read_text() if jsonl.exists() else "") + "".join(
        json.dumps({**row, "when": meta["when"]}) + "\n" for row in rows)
    all_rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    with publish.staged(RESULTS) as stage:
        (stage.path / jsonl.name).write_text(text)
        (stage.path / f"{args.tag}.md").write_text(markdown(all_rows, meta))
    print(f"wrote {jsonl} and {RESULTS / f'{args.tag}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
