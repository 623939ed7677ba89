"""Where each ZeRO stage starts to fit a fixed model: `plan`'s boundary held against a memory cap (issue 43).

For issue 43's 3-layer MLP (64 -> 2048 -> 2048 -> 64) and a small Hugging Face GPT-2, the ranks train a few optimizer
steps with ``HPUDeepSpeedStrategy(stage=S)`` as ``stage="auto"`` trains the stage it picks: the strategy's default
config (buckets from the model, the device's defaults), torch's AdamW, bf16-mixed. Each rank's trial runs in its own
memory cgroup with a hard limit (capacity.py's trials: forked from a parent that imported everything, OOM-killed past
the cap), and for each stage the cap is searched for the smallest at which every rank trains: the measured boundary.

The planner's boundary is what ``lightning-gaudi-ds plan`` prints for the same model (its ``--json`` rows, with
``--measure-activations`` on one micro batch): each row's device bytes per rank, where ``plan --headroom 0`` says it
starts to fit (with the default 10% kept free it says so at bytes / 0.9, also reported). As in capacity.py the
measured boundary is compared less the fixed cost the planner does not model (the libraries' pages a trial touches,
gloo's and DeepSpeed's set-up): the boundary, searched the same way, of the same trial on a tiny model of the same
kind. That boundary holds the tiny model's own bytes too, which the subtraction removes from the model's: the twin is
kept small enough that they are negligible (the planner's bytes for it are reported beside it).

    python benchmarks/boundary.py                              # both models, ZeRO-0..3, 2 ranks (~25 min on 2 cores)
    python benchmarks/boundary.py --models mlp --stages 0 3 --out /tmp/boundary
    python benchmarks/boundary.py --report-only                # table from the last results

Writes ``<out>/boundary.jsonl`` (one row per model and stage, with every trial) and ``boundary.md``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(HERE), str(REPO)):
    if path not in sys.path:
        sys.path.insert(0, path)

import publish  # noqa: E402
from capacity import Cgroup, agree, check_cgroups, wait_rank  # noqa: E402
from flags import fraction, int_at_least, positive_float, positive_int, size  # noqa: E402

from lightning_gaudi_ds.planning.units import format_bytes  # noqa: E402

RESULTS = HERE / "results" / "boundary"
EXIT_NO_CGROUP = 3
MODELS = ("mlp", "gpt2")
# GPT-2 as tests/test_planning.py plans it; the tiny one measures the fixed cost of a GPT-2 trial. Its sequences are
# short (n_positions, the trial's sequence length): at 128 tokens its attention's activations were 2.5 MiB, which the
# fixed cost then took off the model's measured bytes (the planner counts them for the model); at 8, under 0.2 MiB
GPT2 = {"n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 2048, "n_positions": 128}
GPT2_TINY = {"n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 64, "n_positions": 8}
_TOKENS = {"bos_token_id": 0, "eos_token_id": 0}  # GPT-2's 50256 lies outside these vocabularies
MLP_WIDTH, MLP_TINY_WIDTH = 2048, 8


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = MODELS
    stages: tuple[int, ...] = (0, 1, 2, 3)
    world: int = 2
    batch_size: int = 4
    steps: int = 3
    tolerance: float = 0.02  # stop when the bracket is at most this fraction of the boundary above the fixed cost
    trial_timeout: float = 300.0
    precision: str = "bf16-mixed"
    mmap_threshold: int = 64 * 2**10  # glibc's, pinned: freed tensors leave the process (capacity.py --mmap-threshold)
    mlp_width: int = MLP_WIDTH
    baseline_cap: int = 2 * 2**30  # the tiny model's trial: capped too, far above what it needs


# ------------------------------------------------------------------------------------------- the models
def gpt2_config(tiny: bool) -> Any:
    import transformers

    return transformers.GPT2Config(**(GPT2_TINY if tiny else GPT2), **_TOKENS)


def build(model: str, s: Settings, tiny: bool) -> tuple[Any, Any]:
    """(LightningModule, train loader) of ``model``; ``tiny``: the same kind at the smallest size (its fixed cost)."""
    from bench_model import CausalLM, IssueMLP, issue_mlp_loader, token_loader

    batches = s.steps * s.world
    if model == "mlp":
        return IssueMLP(MLP_TINY_WIDTH if tiny else s.mlp_width, s.batch_size), issue_mlp_loader(s.batch_size, batches)
    config = gpt2_config(tiny)
    return CausalLM(config), token_loader(config.vocab_size, config.n_positions, s.batch_size, batches)


def plan_arguments(model: str, s: Settings, folder: Path, tiny: bool = False) -> list[str]:
    """``lightning-gaudi-ds plan``'s arguments for ``model`` (``tiny``: its twin) as the trials train it."""
    common = ["--devices", str(s.world), "--device", "cpu", "--precision", s.precision, "--device-memory", "64GiB",
              "--host-memory", "64GiB", "--measure-activations", "--json"]
    if model == "mlp":
        return ["--model", "bench_model:IssueMLP", "--init-args",
                json.dumps({"width": MLP_TINY_WIDTH if tiny else s.mlp_width, "batch_size": s.batch_size}), *common]
    name = "gpt2-tiny" if tiny else "gpt2"
    gpt2_config(tiny).save_pretrained(folder / name)
    return ["--hf-config", str(folder / name / "config.json"), "--batch-size", str(s.batch_size), "--seq-len",
            str((GPT2_TINY if tiny else GPT2)["n_positions"]), *common]


def planned(model: str, s: Settings, folder: Path, tiny: bool = False) -> list[dict[str, Any]]:
    """The rows `plan` prints (``--json``) for ``model`` (``tiny``: its twin): what it and stage="auto" decide
    with."""
    from lightning_gaudi_ds.planning import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = io.StringIO()
    command.run(parser.parse_args(plan_arguments(model, s, folder, tiny)), out)
    return json.loads(out.getvalue())


# ------------------------------------------------------------------------------------------- one trial
def train_trial(s: Settings, model: str, stage: int, tiny: bool, rank: int, store: Path) -> None:
    """Inside the capped child: ``s.steps`` optimizer steps of ``model`` with ``HPUDeepSpeedStrategy(stage)``."""
    from datetime import timedelta

    import lightning as L
    import torch
    import torch.distributed as dist
    from worker import quiet

    from lightning_gaudi_ds import HPUDeepSpeedStrategy

    quiet()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=s.world,
                            timeout=timedelta(seconds=s.trial_timeout))
    module, loader = build(model, s, tiny)
    trainer = L.Trainer(accelerator="cpu", devices=s.world, strategy=HPUDeepSpeedStrategy(stage=stage),
                        precision=s.precision, max_steps=s.steps, limit_val_batches=0, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(store.parent / "root"))
    trainer.fit(module, loader)
    if trainer.global_step != s.steps:
        raise RuntimeError(f"trained {trainer.global_step} steps, not {s.steps}")


def run_trial(s: Settings, model: str, stage: int, tiny: bool, cap: int, rank: int, work: Path,
              tag: str) -> dict[str, Any]:
    """Fork a child into a fresh cgroup capped at ``cap``, train, and say how it ended: ok, oom, error, peer (killed
    because another rank's trial failed) or timeout."""
    trials = work / "trials"
    cg = Cgroup.create(f"lgds-boundary-{os.getppid()}-{tag}-r{rank}", cap)
    error_file = trials / f"{tag}.rank{rank}.error"
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            cg.join(os.getpid())
            from worker import pin_mmap_threshold

            pin_mmap_threshold(s.mmap_threshold)
            train_trial(s, model, stage, tiny, rank, work / "rdv" / tag)
            code = 0
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            import traceback

            error_file.write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        status, killed_for_peer = wait_rank(pid, s.trial_timeout, trials, tag, rank, t0)
    finally:
        oom, peak = cg.oom_kills(), cg.peak()
        cg.remove()
    outcome = ("ok" if status == 0 else "oom" if oom else "peer" if killed_for_peer
               else "timeout" if status == -signal.SIGKILL else "error")
    result = {"tag": tag, "cap": cap, "rank": rank, "outcome": outcome, "exit": status, "peak_bytes": peak,
              "seconds": round(time.monotonic() - t0, 1)}
    if error_file.exists():
        result["error"] = error_file.read_text()[:3000]
    out = trials / f"{tag}.rank{rank}.json"
    out.with_suffix(".tmp").write_text(json.dumps(result))
    out.with_suffix(".tmp").rename(out)
    return result


# ------------------------------------------------------------------------------------------- the search
@dataclass
class CapSearch:
    """The smallest cap that trains: from a guess, x1.15 up (or /1.15 down) until the outcome flips, then bisect until
    the bracket is at most ``tolerance`` of the boundary above ``floor`` (the fixed cost); up to 8x the guess."""

    guess: int
    floor: int
    tolerance: float
    fails: int = 0  # largest cap known to fail
    trains: int | None = None  # smallest cap known to train
    tried: int = 0

    def next(self) -> int | None:
        if not self.tried:
            return self.guess
        if self.trains is None:  # every trial failed: grow
            grown = int(max(self.fails, self.floor) * 1.15)
            return grown if grown <= 8 * self.guess else None
        if not self.fails:  # every trial trained: shrink, not below the fixed cost
            shrunk = max(self.floor + 1, int(self.trains / 1.15))
            return shrunk if shrunk < self.trains else None
        if self.trains - self.fails <= self.tolerance * (self.trains - self.floor):
            return None
        return (self.fails + self.trains) // 2

    def record(self, cap: int, ok: bool) -> None:
        self.tried += 1
        if ok:
            self.trains = cap if self.trains is None else min(self.trains, cap)
        else:
            self.fails = max(self.fails, cap)


def trial_round(s: Settings, model: str, stage: int, tiny: bool, cap: int, rank: int, work: Path,
                tag: str) -> dict[str, Any]:
    """Every rank's trial at ``cap``, agreed: ok when every rank trained."""
    run_trial(s, model, stage, tiny, cap, rank, work, tag)
    results = agree(work, tag, s.world, s.trial_timeout + 120)
    outcomes = sorted({r["outcome"] for r in results})
    if "oom" in outcomes:  # the others' errors follow from it (peer gone)
        outcomes = sorted({"peer" if o == "error" else o for o in outcomes})
    return {"cap": cap, "ok": outcomes == ["ok"], "outcomes": outcomes,
            "peak_bytes": max((r["peak_bytes"] or 0) for r in results),
            "seconds": max(r["seconds"] for r in results),
            "errors": [r["error"] for r in results if r["outcome"] == "error" and "error" in r][:1]}


def search(s: Settings, model: str, stage: int, tiny: bool, guess: int, floor: int, rank: int, work: Path,
           label: str) -> tuple[CapSearch, list[dict[str, Any]]]:
    """The smallest cap at which ``model`` (``tiny``: its tiny twin) trains at ``stage``, and the trials."""
    found, trials = CapSearch(guess, floor, s.tolerance), []
    while (cap := found.next()) is not None:
        tag = f"{model}-z{stage}-{'tiny' if tiny else 'full'}-{cap}"
        trial = trial_round(s, model, stage, tiny, cap, rank, work, tag)
        trials.append(trial)
        if rank == 0:
            print(f"{model}{' (tiny)' if tiny else ''} {label}: cap {format_bytes(cap)} ->"
                  f" {'/'.join(trial['outcomes'])}, peak {format_bytes(trial['peak_bytes'])}, {trial['seconds']}s",
                  flush=True)
        if not trial["ok"] and "oom" not in trial["outcomes"]:
            break  # not the memory limit: report it, do not search on
        found.record(cap, trial["ok"])
    return found, trials


def search_rank(s: Settings, rank: int, work: Path) -> int:
    """What every rank process runs: the same searches, trial by trial; rank 0 writes the rows. Per model and stage:
    the tiny twin's boundary (the fixed cost: its peak under a loose cap, searched down), then the model's (from the
    fixed cost plus the planner's bytes)."""
    rows = []
    for model in s.models:
        plan = {r["stage"]: r for r in json.loads((work / f"plan-{model}.json").read_text())
                if not r["offload_optimizer"]}
        for stage in s.stages:
            t0 = time.monotonic()
            label = plan[stage]["label"]
            loose = trial_round(s, model, stage, True, s.baseline_cap, rank, work, f"{model}-z{stage}-tiny-loose")
            row: dict[str, Any] = {"type": "boundary", "model": model, "stage": stage, "label": label,
                                   "loose_tiny": loose, "tiny_trials": [], "trials": []}
            if loose["ok"]:
                tiny, row["tiny_trials"] = search(s, model, stage, True, loose["peak_bytes"], 0, rank, work, label)
                row["fixed_bytes"] = tiny.trains
            if row.get("fixed_bytes"):
                fixed = row["fixed_bytes"]
                full, row["trials"] = search(s, model, stage, False, fixed + plan[stage]["device_bytes"], fixed, rank,
                                             work, label)
                row.update(measured_bytes=full.trains, failing_bytes=full.fails or None)
            row["seconds"] = round(time.monotonic() - t0, 1)
            rows.append(row)
    if rank == 0:
        (work / "rows.json").write_text(json.dumps(rows))
    return 0


# ------------------------------------------------------------------------------------------- report
def derive(rows: list[dict[str, Any]], plans: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The planner's device bytes and boundary beside the measured boundary less the fixed cost, and their errors;
    the planner's bytes for the tiny twin too (part of the fixed cost: they should be negligible)."""
    for r in rows:
        p = next(x for x in plans[r["model"]] if x["stage"] == r["stage"] and not x["offload_optimizer"])
        twin = next((x for x in plans.get(f"{r['model']}-tiny", ()) if x["stage"] == r["stage"]
                     and not x["offload_optimizer"]), None)
        r["twin_planned_bytes"] = None if twin is None else twin["device_bytes"]
        r["planned_bytes"] = p["device_bytes"]
        r["planned_boundary"] = int(p["device_bytes"] / (1 - p["headroom"]))
        r["headroom"] = p["headroom"]
        above = (r["measured_bytes"] - r["fixed_bytes"]) if r.get("measured_bytes") and r.get("fixed_bytes") else None
        r["measured_above_fixed"] = above
        r["boundary_error"] = r["planned_boundary"] / above - 1 if above else None
        r["bytes_error"] = r["planned_bytes"] / above - 1 if above else None
    return rows


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    def pct(v: float | None) -> str:
        return "–" if v is None else f"{v:+.1%}"

    def mib(v: int | None) -> str:
        return "–" if not v else format_bytes(v)

    lines = [
        f"{meta['world']} ranks on gloo, {meta['precision']}, torch AdamW (fused by the strategy on CPU), micro batch"
        f" {meta['batch_size']}, {meta['steps']} optimizer steps per trial, each rank in a memory cgroup (v"
        f"{meta['cgroup']}, swap off) with glibc's mmap threshold pinned to {format_bytes(meta['mmap_threshold'])};"
        f" search to {meta['tolerance']:.0%} of the boundary above the fixed cost; {meta['seconds']:.0f} s in all"
        f" ({meta['trials']} trials), {meta['machine']}; torch {meta['torch']}, deepspeed {meta['deepspeed']},"
        f" lightning {meta['lightning']}. Models: issue 43's MLP 64 -> {meta['mlp_width']} -> {meta['mlp_width']} ->"
        f" 64; GPT-2 {GPT2} (transformers {meta['transformers']}). Planner: `lightning-gaudi-ds plan --json"
        " --measure-activations` on the same model (the rows stage=\"auto\" decides with); its boundary is the"
        f" device bytes (with the default headroom of {meta['headroom']:.0%} kept free it says fits at bytes / 0.9)."
        " Fixed cost: the measured boundary of the same trial on a tiny model of the same kind (not modeled by the"
        " planner; on a GPU it lies outside device memory), GPT-2"
        f" {meta.get('gpt2_tiny', 'with 128 positions')}, MLP width {MLP_TINY_WIDTH}; it holds the tiny model's own"
        " bytes too, which the column \"twin's own bytes\" gives as the planner counts them.",
        "",
        "| model | configuration | planner's device bytes | measured boundary (smallest cap that trains) | fixed"
        " cost | measured − fixed | planner ÷ (measured − fixed) − 1 | with 10% headroom: planner's boundary |"
        " ÷ (measured − fixed) − 1 | twin's own bytes (planner) | trials (tiny + model) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        last = (r["trials"] or r["tiny_trials"] or [r["loose_tiny"]])[-1]
        note = "" if r.get("measured_bytes") else f" ({'/'.join(last['outcomes'])})"
        lines.append(
            f"| {r['model']} | {r['label']} | {mib(r['planned_bytes'])} | {mib(r.get('measured_bytes'))}{note} |"
            f" {mib(r.get('fixed_bytes'))} | {mib(r['measured_above_fixed'])} | {pct(r['bytes_error'])} |"
            f" {mib(r['planned_boundary'])} | {pct(r['boundary_error'])} | {mib(r.get('twin_planned_bytes'))} |"
            f" {len(r['tiny_trials'])} + {len(r['trials'])} |"
        )
    judged = [r for r in rows if r["bytes_error"] is not None]
    within = [r for r in judged if abs(r["bytes_error"]) <= 0.10]
    worst = max((abs(r["bytes_error"]) for r in judged), default=None)
    mark = "✓" if judged and len(within) == len(rows) else "✗"
    lines += ["", f"- Planner's boundary (device bytes) within 10% of the measured boundary less the fixed cost:"
              f" {len(within)} of {len(rows)} configurations (largest error {'–' if worst is None else f'{worst:.1%}'})"
              f" {mark}"]
    text = "\n".join(lines) + "\n"
    publish.write_text(out / "boundary.md", text)
    return text


def _model_name(text: str) -> str:
    if text not in MODELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: pass {' or '.join(MODELS)}")
    return text


def _stage(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: pass a ZeRO stage, 0, 1, 2 or 3")
    return int(text)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", type=_model_name, default=list(MODELS), help="mlp, gpt2 (default: both)")
    p.add_argument("--stages", nargs="+", type=_stage, default=[0, 1, 2, 3], help="ZeRO stages (default: 0 1 2 3)")
    p.add_argument("--world", type=int_at_least(2), default=2, help="ranks (default 2)")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=3, help="optimizer steps per trial (default 3)")
    p.add_argument("--tolerance", type=fraction, default=0.02)
    p.add_argument("--trial-timeout", type=positive_float, default=300.0)
    p.add_argument("--mmap-threshold", type=size, default=64 * 2**10,
                   help="glibc's mmap threshold pinned in every trial (default 64KiB)")
    p.add_argument("--mlp-width", type=positive_int, default=MLP_WIDTH)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.settings:
        return args, Settings(**{k: tuple(v) if isinstance(v, list) else v
                                 for k, v in json.loads(args.settings).items()})
    return args, Settings(models=tuple(args.models), stages=tuple(sorted(set(args.stages))), world=args.world,
                          batch_size=args.batch_size, steps=args.steps, tolerance=args.tolerance,
                          trial_timeout=args.trial_timeout, mmap_threshold=args.mmap_threshold,
                          mlp_width=args.mlp_width)


def main(argv: list[str] | None = None) -> int:
    args, s = parse(argv)
    out = Path(args.out).resolve()  # absolute: the trials meet through file:// stores under it
    work = out / "raw"
    if args.rank_worker:
        import gc

        from worker import preload

        preload()
        import lightning  # noqa: F401  (before any fork: every trial starts from the same imported parent)
        import transformers  # noqa: F401

        gc.collect()
        gc.freeze()  # the collector does not copy the imports' pages into a trial's cgroup (capacity.py)
        return search_rank(s, int(os.environ["RANK"]), Path(args.out))
    if args.report_only:
        return publish.report_only("boundary.py", out, "boundary", write_report)
    why = check_cgroups()
    if why:
        print(f"boundary.py: {why}. Not measuring: without a cap per rank there is no boundary.", file=sys.stderr)
        return EXIT_NO_CGROUP
    from launch import run_ranks

    shutil.rmtree(work, ignore_errors=True)
    for sub in ("trials", "rdv"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    plans = {}
    for model in s.models:
        plans[model] = planned(model, s, work)
        (work / f"plan-{model}.json").write_text(json.dumps(plans[model]))
        plans[f"{model}-tiny"] = planned(model, s, work, tiny=True)
    budget = len(s.models) * len(s.stages) * 12 * (s.trial_timeout + 60)
    job = run_ranks([sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--out", str(work),
                     "--settings", json.dumps(asdict(s))], s.world, work / "logs", budget)
    rows_file = work / "rows.json"
    if not rows_file.exists():
        print(f"boundary.py: the job ended without results ({job}); logs in {work / 'logs'}", file=sys.stderr)
        return 1
    import platform

    import deepspeed
    import lightning
    import torch
    import transformers

    rows = derive(json.loads(rows_file.read_text()), plans)
    meta = {"type": "meta", **asdict(s), "seconds": sum(r["seconds"] for r in rows),
            "trials": sum(len(r["trials"]) + len(r["tiny_trials"]) + 1 for r in rows),
            "headroom": rows[0]["headroom"] if rows else None,
            "cgroup": 1 if Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() else 2,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "lightning": lightning.__version__,
            "transformers": transformers.__version__, "gpt2_tiny": GPT2_TINY}
    with publish.staged(out) as stage:  # a run that fails leaves the last results as they were
        (stage.path / "boundary.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [meta, *rows]))
        text = write_report(rows, meta, stage.path)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
