"""Run every benchmark of issue 7 in one job and write JSON lines, a markdown table and PNG charts.

    python benchmarks/run_all.py            # full run (~10-20 min on 2 CPU cores), results in benchmarks/results/
    python benchmarks/run_all.py --quick    # small models, few steps (development), benchmarks/results/quick/

Two ranks on gloo, one torch thread each. Every case runs in fresh forked processes (see worker.py); the
speed cases pair each Trainer step with a step of the same training written by hand, and rotate the arms'
order from round to round.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cases import FLIPPED, Case  # noqa: E402
from flags import non_negative_int, positive_float, positive_int, regex  # noqa: E402
from launch import run_one, run_ranks  # noqa: E402

WORLD = 2
SPEED_ARMS = ("ddp", "ddp_fused", "z0", "z1", "z2", "z3", "z2_offload", "z3_offload")
SWEEP_ARMS = ("ddp", "z0", "z1", "z2", "z3")
EXTRA_ARMS = ("z2_offload", "z3_offload", "z1_allreduce", "z2_allreduce", "z2_overlap", "z2_nocontig",
              "z3_overlap")  # main size only
# A CPU communication default switched the other way (issue 16 items 2-3): in the memory census (not in --quick);
# in the speed part only with --flipped-speed (results/cpu_defaults.md: two runs of all of them).
FLIPPED_ARMS = tuple(FLIPPED)  # z1_allreduce, z2_allreduce, z2_overlap, z2_nocontig, z3_overlap
FP32_ARMS = ("ddp", "z0", "z1", "z2", "z3", "z2_offload", "z3_offload")
MMAP_THRESHOLD = 64 * 1024


@dataclass
class Settings:
    hidden: int
    layers: tuple[int, ...]  # the RSS sweep; the census model is main_layers
    main_layers: int
    batch_size: int
    memory_steps: int
    speed_rounds: int
    speed_warmup: int
    speed_measured: int
    offload: bool
    fp32: bool
    mmap_sweep: bool
    speed: bool
    memory: bool
    flipped: bool = True
    flipped_speed: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        if args.quick:
            base = dict(hidden=512, layers=(2, 4, 6, 8), main_layers=4, batch_size=16, memory_steps=3,
                        speed_rounds=1, speed_warmup=1, speed_measured=3)
        else:  # Ψ = 12.6M, 25.2M, 37.8M, 50.4M; census at 25.2M
            base = dict(hidden=1024, layers=(12, 24, 36, 48), main_layers=24, batch_size=16, memory_steps=3,
                        speed_rounds=3, speed_warmup=3, speed_measured=8)
        for key in ("hidden", "batch_size", "speed_rounds", "speed_warmup", "speed_measured"):
            if getattr(args, key) is not None:
                base[key] = getattr(args, key)
        if args.layers:
            base["layers"] = tuple(args.layers)
            base["main_layers"] = args.layers[len(args.layers) // 2 - 1] if len(args.layers) > 1 else args.layers[0]
        only = set(args.only or ("memory", "speed"))
        return cls(**base, offload=not args.no_offload and not args.quick or args.offload,
                   fp32=not args.quick or args.fp32, mmap_sweep=not args.quick and not args.no_mmap_sweep,
                   speed="speed" in only, memory="memory" in only, flipped=not args.quick,
                   flipped_speed=tuple(args.flipped_speed or FLIPPED_ARMS) if args.flipped_speed is not None else ())


def plan(s: Settings) -> list[Case]:
    cases: list[Case] = []
    if s.memory:
        for layers in s.layers:
            for arm in SWEEP_ARMS:
                cases.append(Case(id=f"mem_bf16_{arm}_l{layers}", kind="memory", arm=arm, hidden=s.hidden,
                                  layers=layers, batch_size=s.batch_size, steps=s.memory_steps,
                                  extra={"gc_check": layers == s.main_layers}))
                if s.mmap_sweep:  # the same with glibc returning freed blocks at once (see worker.pin_mmap_threshold)
                    cases.append(Case(id=f"mem_bf16_{arm}_l{layers}_mmap", kind="memory", arm=arm, hidden=s.hidden,
                                      layers=layers, batch_size=s.batch_size, steps=s.memory_steps,
                                      extra={"mmap_threshold": MMAP_THRESHOLD}))
        extras = [a for a in EXTRA_ARMS if (s.offload or "offload" not in a) and (s.flipped or a not in FLIPPED_ARMS)]
        for arm in extras:
            cases.append(Case(id=f"mem_bf16_{arm}_l{s.main_layers}", kind="memory", arm=arm, hidden=s.hidden,
                              layers=s.main_layers, batch_size=s.batch_size, steps=s.memory_steps,
                              extra={"gc_check": True}))
        if s.fp32:
            for arm in FP32_ARMS:
                if "offload" in arm and not s.offload:
                    continue
                cases.append(Case(id=f"mem_fp32_{arm}_l{s.main_layers}", kind="memory", arm=arm, hidden=s.hidden,
                                  layers=s.main_layers, precision="32-true", batch_size=s.batch_size,
                                  steps=s.memory_steps, extra={"gc_check": True}))
    if s.speed:
        arms = tuple(a for a in SPEED_ARMS + tuple(s.flipped_speed) if s.offload or "offload" not in a)
        for r in range(s.speed_rounds):
            k = r % len(arms)
            order = [(arm, arm) for arm in arms[k:] + arms[:k]]  # rotate the order each round
            if "ddp" in arms and len(arms) > 2:  # DDP is every ÷ DDP ratio's denominator: time it twice per round,
                half = (order.index(("ddp", "ddp")) + len(order) // 2) % len(order)  # half a round apart
                order.insert(half + 1, ("ddp", "ddp_b"))
            for arm, name in order:
                cases.append(Case(id=f"speed_r{r}_{name}", kind="speed", arm=arm, hidden=s.hidden,
                                  layers=s.main_layers, batch_size=s.batch_size,
                                  steps=s.speed_warmup + s.speed_measured + 1, warmup=s.speed_warmup, round=r))
    return cases


def previous_cases(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The per-rank results of every case in a results.jsonl, by case id (rank order)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("type") == "case":
            row.pop("type")
            case_id = row.pop("id")
            out.setdefault(case_id, []).append(row)
    return out


def prebuild_cpu_adam(log_dir: Path) -> dict[str, Any]:
    """ZeRO-Offload's DeepSpeedCPUAdam is JIT-built on first use (~100 s): build it before anything is timed."""
    res = run_one([sys.executable, "-m", "lightning_gaudi_ds", "env", "--build-ops", "cpu_adam"],
                  log_dir / "build_cpu_adam.log",
                  timeout=900)
    return {"ok": res.ok, "seconds": round(res.seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models and few steps (development, tests)")
    parser.add_argument("--only", nargs="+", choices=("memory", "speed"), help="run only these benchmarks")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results[/quick])")
    parser.add_argument("--hidden", type=positive_int)
    parser.add_argument("--layers", type=positive_int, nargs="+",
                        help="model sizes of the RSS sweep (layers of hidden²)")
    parser.add_argument("--batch-size", dest="batch_size", type=positive_int)
    parser.add_argument("--speed-rounds", dest="speed_rounds", type=positive_int)
    parser.add_argument("--speed-warmup", dest="speed_warmup", type=non_negative_int)
    parser.add_argument("--speed-measured", dest="speed_measured", type=positive_int)
    parser.add_argument("--offload", action="store_true", help="include ZeRO-Offload arms in --quick")
    parser.add_argument("--no-offload", dest="no_offload", action="store_true")
    parser.add_argument("--flipped-speed", dest="flipped_speed", nargs="*", choices=FLIPPED_ARMS, metavar="ARM",
                        help="also time these arms with a CPU communication default switched (none named: all of "
                             f"{', '.join(FLIPPED_ARMS)})")
    parser.add_argument("--fp32", action="store_true", help="include the fp32 census in --quick")
    parser.add_argument("--no-mmap-sweep", dest="no_mmap_sweep", action="store_true",
                        help="skip the second RSS sweep with glibc's mmap threshold pinned to 64 KiB")
    parser.add_argument("--timeout", type=positive_float, default=3600, help="time-out of the whole job (s)")
    parser.add_argument("--no-readme", dest="no_readme", action="store_true", help="do not update benchmarks/README.md")
    parser.add_argument("--cases", metavar="REGEX", type=regex,
                        help="run only the planned cases whose id matches; the report takes every other case from the"
                             " last run's results.jsonl (its `case` lines), so a partial rerun keeps the full tables")
    parser.add_argument("--report-only", dest="report_only", action="store_true",
                        help="rebuild the report from the raw results of the last run (no training)")
    args = parser.parse_args(argv)

    settings = Settings.from_args(args)
    out: Path = (args.out or (HERE / "results" / ("quick" if args.quick else ""))).resolve()  # file:// stores
    raw = out / "raw"
    if args.report_only:
        from report import write_report

        if not (raw / "run.json").is_file() or not (raw / "plan.json").is_file():
            parser.error(f"--report-only: no run to report in {raw} (run.json and plan.json); run run_all.py first,"
                         " or pass --out with the folder of an earlier run")
        saved = json.loads((raw / "run.json").read_text())
        cases = [Case.from_json(c) for c in json.loads((raw / "plan.json").read_text())["cases"]]
        failed = write_report(out, cases, saved["settings"], WORLD, saved["elapsed"], saved["build"], args.quick,
                              update_readme=not args.quick and not args.no_readme and args.out is None, keep_meta=True)
        return 1 if failed else 0
    previous = out / "results.jsonl"
    kept = previous_cases(previous) if args.cases and previous.exists() else {}
    if raw.exists():
        shutil.rmtree(raw)
    (raw / "cases").mkdir(parents=True)
    (raw / "rdv").mkdir()
    cases = plan(settings)
    to_run = cases
    if args.cases:
        to_run = [c for c in cases if re.search(args.cases, c.id)]
        for case in cases:
            if case not in to_run:
                for rank, row in enumerate(kept.get(case.id, [])):
                    (raw / "cases" / f"{case.id}.rank{rank}.json").write_text(json.dumps(row))
        print(f"--cases: running {len(to_run)} of {len(cases)} cases; {len(kept)} taken from {previous}", flush=True)
    (raw / "plan.json").write_text(json.dumps({"cases": [c.to_json() for c in cases]}, indent=1))
    (raw / "run_plan.json").write_text(json.dumps({"cases": [c.to_json() for c in to_run]}, indent=1))
    started = time.time()
    build = prebuild_cpu_adam(raw) if settings.offload else None
    print(f"running {len(to_run)} cases on {WORLD} ranks; logs in {raw}", flush=True)
    job = run_ranks([sys.executable, str(HERE / "worker.py"), "--plan", str(raw / "run_plan.json"), "--out",
                     str(raw / "cases")], WORLD, raw, args.timeout,
                    {"BENCH_RDV_DIR": str(raw / "rdv"), "BENCH_ROOT_DIR": str(raw / "root")})
    elapsed = time.time() - started
    print(f"job {'ok' if job.ok else 'FAILED'} in {elapsed:.0f}s", flush=True)
    (raw / "run.json").write_text(json.dumps({"settings": settings.__dict__, "elapsed": elapsed, "build": build}))

    from report import write_report

    failed = write_report(out, cases, settings.__dict__, WORLD, elapsed, build, args.quick,
                          update_readme=not args.quick and not args.no_readme and args.out is None, job_ok=job.ok)
    return 0 if job.ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
